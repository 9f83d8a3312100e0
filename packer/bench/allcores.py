"""One core's rate while every core works (turbo clock, SMT sibling and caches shared): the
ceiling a multi-process stage can reach, measured in ``n`` forked processes started together."""
from __future__ import annotations

import multiprocessing as mp
import statistics
from typing import Callable, List, Sequence

__all__ = ["rates_on_all_cores", "median_rate_on_all_cores"]


def _run(fn, share, barrier, results, k) -> None:
    import torch
    torch.set_num_threads(1)  # as a DataLoader worker and a build worker run
    barrier.wait()
    results[k] = fn(share)


def rates_on_all_cores(fn: Callable[[Sequence], float], shares: Sequence[Sequence]) -> List[float]:
    """``fn(share)`` (images/s of one loop over ``share``) in one forked process per share,
    all released at once by a barrier. Fork, so ``fn`` may be a closure over open state."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(shares))
    results = ctx.Array("d", len(shares))
    procs = [ctx.Process(target=_run, args=(fn, share, barrier, results, k), daemon=True)
             for k, share in enumerate(shares)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(procs)} measuring processes failed "
                           f"(exit codes {bad})")
    return list(results)


def median_rate_on_all_cores(fn: Callable[[Sequence], float], items: Sequence,
                             n: int) -> float:
    """The median per-process rate of ``fn`` over ``n`` interleaved shares of ``items``."""
    n = max(1, n)
    return statistics.median(rates_on_all_cores(fn, [items[k::n] for k in range(n)]))
