"""Loader efficiency (issue 16): images/s of ``make_loader`` with W workers ÷ (W × one core's
images/s of a plain ``ds[i]`` loop over the same samples), one core alone and with all W busy."""
from __future__ import annotations

import time
from typing import Iterable, List, Tuple

from torch.utils.data import Subset

from .allcores import median_rate_on_all_cores
from ..loading.loader import make_loader
from ..reading.sampler import PackedSampler

GOAL = 0.9  # issue 16: loader images/s >= GOAL x workers x one core's rate


def one_core_rate(ds, indices: List[int]) -> float:
    """images/s of a ``ds[i]`` loop on one torch thread, as a DataLoader worker runs it."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        for i in indices:
            ds[i]
        return len(indices) / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def steady_rate(batches: Iterable, workers: int) -> float:
    """images/s of ``(images, labels)`` ``batches`` between the first and last wave of one batch
    per worker (start-up and wind-down left out); a run under two waves is timed whole."""
    wave = max(1, workers)
    arrivals = [(time.perf_counter(), 0)]  # (time, images) of the start, then of each batch
    for x, _ in batches:
        arrivals.append((time.perf_counter(), len(x)))
    first, last = wave, len(arrivals) - 1 - wave
    if last <= first:  # too short for a steady state: the whole run
        first, last = 0, len(arrivals) - 1
    images = sum(n for _, n in arrivals[first + 1:last + 1])
    return images / (arrivals[last][0] - arrivals[first][0])


def steady_loader_rate(ds, indices: List[int], batch_size: int, workers: int,
                       **kwargs) -> float:
    """``steady_rate`` of ``make_loader`` over ``indices`` (a ``PackedSampler`` in a fixed
    order, no pinning; kwargs passed on). Give it many batches per worker."""
    part = Subset(ds, indices)
    return steady_rate(make_loader(part, batch_size, sampler=PackedSampler(part, shuffle=False),
                                   num_workers=workers, pin_memory=False,
                                   persistent_workers=False, **kwargs), workers)


def core_rates(ds, indices: List[int], workers: int) -> Tuple[float, float]:
    """A ``ds[i]`` loop over one worker's share of ``indices`` alone, and the same loop in
    ``workers`` processes at once (images/s of one of them)."""
    w = max(1, workers)
    core = one_core_rate(ds, indices[::w])
    return core, median_rate_on_all_cores(lambda share: one_core_rate(ds, share), indices, w)
