"""The wait at every epoch boundary: ``make_loader(ds, B)`` (workers run on into the next epoch)
against a plain DataLoader over the same ``PackedSampler``, collate and workers."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import List

from torch.utils.data import DataLoader

from ..loading.collate import collate_uint8
from ..loading.loader import TOTAL_PREFETCH, make_loader
from ..reading.dataset import PackedDataset
from ..reading.sampler import PackedSampler

VARIANTS = {"plain DataLoader (epoch by epoch)": False, "make_loader(ds, B) (runs on)": True}


@dataclass
class EpochRun:
    seconds: float          # wall time of the measured epochs
    steps: float            # the sum of the stand-in steps: the ideal wall time
    first_waits: List[float] = field(default_factory=list)  # waits for each epoch's first batch
    waits: List[float] = field(default_factory=list)  # waits for the other batches
    images: int = 0

    @property
    def kept(self) -> float:
        """Fraction of the ideal speed kept (1.0: the loader was never waited on)."""
        return self.steps / self.seconds


class StandInStep:
    """A fixed ``seconds`` wait per batch in the main process: a GPU step as the loader sees it."""

    pin_memory = False

    def __init__(self, seconds: float):
        self.seconds = seconds

    def feed(self, loader):
        return loader

    def __call__(self, x, y) -> float:
        time.sleep(self.seconds)
        return self.seconds

    def finish(self) -> None:
        pass


def plain_loader(ds, sampler: PackedSampler, batch_size: int, workers: int,
                 pin_memory: bool) -> DataLoader:
    """The baseline: a DataLoader with make_loader's collate, workers, prefetch; epoch by epoch."""
    return DataLoader(ds, batch_size, sampler=sampler, num_workers=workers,
                      collate_fn=collate_uint8, pin_memory=pin_memory,
                      persistent_workers=workers > 0,
                      prefetch_factor=max(2, math.ceil(TOTAL_PREFETCH / workers)) if workers else None)


def one_run(ds: PackedDataset, across: bool, *, batch_size: int, workers: int, epochs: int,
            step) -> EpochRun:
    """``epochs`` epochs after a warm-up, through ``make_loader`` (``across``) or ``plain_loader``;
    ``step``: seconds (``StandInStep``) or a step object."""
    step = StandInStep(step) if isinstance(step, (int, float)) else step
    if across:
        made = make_loader(ds, batch_size, num_workers=workers, pin_memory=step.pin_memory)
        set_epoch = made.set_epoch
    else:
        sampler = PackedSampler(ds, seed=0)
        made, set_epoch = plain_loader(ds, sampler, batch_size, workers, step.pin_memory), sampler.set_epoch
    loader = step.feed(made)
    for x, y in loader:  # warm-up epoch: workers started, caches warm
        step(x, y)
    step.finish()
    run = EpochRun(0.0, 0.0)
    t0 = time.perf_counter()
    for e in range(1, epochs + 1):
        set_epoch(e)
        t = time.perf_counter()
        for k, (x, y) in enumerate(loader):
            (run.waits if k else run.first_waits).append(time.perf_counter() - t)
            run.images += len(x)
            run.steps += step(x, y)
            t = time.perf_counter()
    step.finish()
    run.seconds = time.perf_counter() - t0
    del loader, made
    return run


def loader_batch_time(ds: PackedDataset, batch_size: int, workers: int) -> float:
    """Seconds per batch inside an epoch, nothing else running: from the end of the first wave
    (one batch per worker, made during start-up) to the last batch (0 if none come after)."""
    loader = make_loader(ds, batch_size, shuffle=False, num_workers=workers, pin_memory=False)
    arrivals = [time.perf_counter() for _ in loader]
    first = min(max(1, workers), len(arrivals)) - 1
    return (arrivals[-1] - arrivals[first]) / max(1, len(arrivals) - 1 - first)
