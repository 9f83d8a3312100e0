"""What ``scripts/bench_epochs.py`` measures: the stall at every epoch boundary, with and
without ``EpochLoader`` (``make_loader(..., across_epochs=...)``).

A training step is stood in for by a fixed wait of ``step`` seconds in the main process (a
GPU step: the main process only waits for it), set a little longer than the loader needs per
batch inside an epoch, so a perfect loader is never waited on. The loop runs several epochs
(``set_epoch`` each, as training does); what is measured is the wall time against the sum
of the steps, and the wait for each epoch's first batch. Variants alternate round by round.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from .._system import usable_cores
from ..dataset import PackedDataset
from ..decode import DecodeRandomResizedCrop
from ..loader import make_loader
from ..sampler import PackedSampler

VARIANTS = {"plain DataLoader (epoch by epoch)": False, "EpochLoader (runs on)": True}


@dataclass
class EpochRun:
    seconds: float          # wall time of the measured epochs
    steps: float            # the sum of the stand-in steps: the ideal wall time
    first_waits: List[float] = field(default_factory=list)  # waits for each epoch's first batch
    images: int = 0

    @property
    def kept(self) -> float:
        """Fraction of the ideal speed kept (1.0: the loader was never waited on)."""
        return self.steps / self.seconds


def one_run(ds: PackedDataset, across: bool, *, batch_size: int, workers: int, epochs: int,
            step: float) -> EpochRun:
    sampler = PackedSampler(ds, seed=0)
    loader = make_loader(ds, batch_size, sampler=sampler, num_workers=workers, pin_memory=False,
                         across_epochs=across)
    for _ in loader:  # warm-up epoch: workers started, caches warm
        time.sleep(step)
    run = EpochRun(0.0, 0.0)
    t0 = time.perf_counter()
    for e in range(1, epochs + 1):
        sampler.set_epoch(e)
        t = time.perf_counter()
        for k, (x, _) in enumerate(loader):
            if k == 0:
                run.first_waits.append(time.perf_counter() - t)
            run.images += len(x)
            time.sleep(step)  # the step
            run.steps += step
    run.seconds = time.perf_counter() - t0
    del loader
    return run


def loader_batch_time(ds: PackedDataset, batch_size: int, workers: int) -> float:
    """Seconds per batch the loader needs inside an epoch, with nothing else running."""
    loader = make_loader(ds, batch_size, sampler=PackedSampler(ds, seed=1), num_workers=workers,
                         pin_memory=False, across_epochs=False)
    it = iter(loader)
    next(it)
    t0, n = time.perf_counter(), 0
    for _ in it:
        n += 1
    return (time.perf_counter() - t0) / max(n, 1)


def bench_epochs(root, *, batch_size: int = 64, workers: Optional[int] = None, epochs: int = 3,
                 rounds: int = 5, size: int = 224, slack: float = 1.15,
                 log: Callable[[str], None] = print) -> Dict[str, List[EpochRun]]:
    """Interleaved rounds of every variant; the step is ``slack`` x the loader's batch time."""
    workers = workers or usable_cores()
    ds = PackedDataset(root, decode=DecodeRandomResizedCrop(size))
    step = slack * loader_batch_time(ds, batch_size, workers)
    log(f"{len(ds)} images, batch {batch_size}, {workers} workers: the stand-in step is "
        f"{step * 1e3:.1f} ms ({slack}x the loader's time per batch inside an epoch)")
    out: Dict[str, List[EpochRun]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name, across in VARIANTS.items():
            run = one_run(ds, across, batch_size=batch_size, workers=workers, epochs=epochs,
                          step=step)
            out[name].append(run)
            log(f"round {r + 1}/{rounds}: {name}: kept {run.kept:.3f} of the ideal, first-batch "
                f"waits {', '.join(f'{w * 1e3:.0f}' for w in run.first_waits)} ms")
    return out


def epochs_table(results: Dict[str, List[EpochRun]]) -> str:
    rows = ["| loader | kept of ideal (median) | spread | epoch-start wait, median ms |",
            "|---|---:|---|---:|"]
    for name, runs in results.items():
        kept = [r.kept for r in runs]
        waits = [w for r in runs for w in r.first_waits]
        rows.append(f"| {name} | {statistics.median(kept):.3f} | {min(kept):.3f}-{max(kept):.3f} "
                    f"| {statistics.median(waits) * 1e3:.0f} |")
    return "\n".join(rows)
