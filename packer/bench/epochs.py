"""What ``benchmarks/bench_epochs.py`` measures: the wait at every epoch boundary, of
``make_loader(ds, B)`` (its workers run on into the next epoch) against a plain DataLoader
over the same ``PackedSampler``, collate and workers, epoch by epoch.

The training step is either stood in for (``StandInStep``: a fixed wait in the main process,
as a GPU step looks to the loader, set a little longer than the loader needs per batch inside
an epoch, so a perfect loader is never waited on) or real (``CudaStep``: a ResNet-50 step on
the GPU fed through ``CUDAPrefetcher``, its ideal the same step on a resident batch, measured
in the same round). The loop runs several epochs (``set_epoch`` each, as training does);
what is measured is the wall time against the sum of the ideal steps, the wait for each
epoch's first batch and the waits for the others. Variants alternate round by round.
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from torch.utils.data import DataLoader

from .._util.system import usable_cores
from ..loading.collate import collate_uint8
from ..loading.loader import TOTAL_PREFETCH, default_num_workers, make_loader
from ..reading.dataset import PackedDataset
from ..reading.sampler import PackedSampler
from ..transforms.decode import DecodeRandomResizedCrop

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
    """A fixed wait of ``seconds`` per batch in the main process: a GPU step as the loader
    sees it (the main process only waits for it)."""

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


class CudaStep:
    """A real training step on the GPU (``TrainStep``: bf16 autocast, channels_last, SGD) fed
    through ``CUDAPrefetcher``; ``calibrate()`` times it on a resident batch: the ideal."""

    pin_memory = True

    def __init__(self, model: str = "resnet50", batch_size: int = 256, size: int = 224,
                 device: str = "cuda"):
        import torch
        from ..loading.prefetch import CUDAPrefetcher
        from .models import TrainStep, make_model
        torch.backends.cudnn.benchmark = True
        self.dev, self.batch = torch.device(device), batch_size
        net = make_model(model, 1000).to(self.dev, memory_format=torch.channels_last)
        self.step, self.prefetcher = TrainStep(net, self.dev), CUDAPrefetcher
        self.x = torch.randn(batch_size, 3, size, size, device=self.dev).contiguous(
            memory_format=torch.channels_last)
        self.y = torch.randint(0, 1000, (batch_size,), device=self.dev)
        self.seconds = 0.0

    def calibrate(self, steps: int = 30) -> float:
        """Seconds per step on the resident batch (after a few untimed steps)."""
        for _ in range(5):
            self.step(self.x, self.y)
        self.finish()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(self.x, self.y)
        self.finish()
        self.seconds = (time.perf_counter() - t0) / steps
        return self.seconds

    def feed(self, loader):
        return self.prefetcher(loader, device=self.dev)

    def __call__(self, x, y) -> float:
        self.step(x, y)
        return self.seconds * len(x) / self.batch

    def finish(self) -> None:
        import torch
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)


def plain_loader(ds, sampler: PackedSampler, batch_size: int, workers: int,
                 pin_memory: bool) -> DataLoader:
    """The baseline: a DataLoader with make_loader's collate, workers and prefetch, epoch by
    epoch."""
    return DataLoader(ds, batch_size, sampler=sampler, num_workers=workers,
                      collate_fn=functools.partial(collate_uint8), pin_memory=pin_memory,
                      persistent_workers=workers > 0,
                      prefetch_factor=max(2, math.ceil(TOTAL_PREFETCH / workers)) if workers else None)


def one_run(ds: PackedDataset, across: bool, *, batch_size: int, workers: int, epochs: int,
            step) -> EpochRun:
    """``epochs`` epochs after a warm-up one, through ``make_loader(ds, batch_size)``
    (``across``) or ``plain_loader``; ``step`` a seconds count (``StandInStep``) or a step
    object (``CudaStep``)."""
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
    """Seconds per batch the loader needs inside an epoch, with nothing else running."""
    it = iter(make_loader(ds, batch_size, shuffle=False, num_workers=workers, pin_memory=False))
    next(it)
    t0, n = time.perf_counter(), 0
    for _ in it:
        n += 1
    return (time.perf_counter() - t0) / max(n, 1)


def bench_epochs(root, *, batch_size: int = 64, workers: Optional[int] = None, epochs: int = 3,
                 rounds: int = 5, size: int = 224, slack: float = 1.15, cuda_model: str = "",
                 log: Callable[[str], None] = print) -> Dict[str, List[EpochRun]]:
    """Interleaved rounds of every variant. The step: ``cuda_model`` trained on the GPU
    (``CudaStep``, re-timed on a resident batch each round), else a stand-in wait of
    ``slack`` x the loader's batch time."""
    ds = PackedDataset(root, decode=DecodeRandomResizedCrop(size))
    if cuda_model:
        workers = workers or default_num_workers()
        step = CudaStep(cuda_model, batch_size, size)
        log(f"{len(ds)} images, batch {batch_size}, {workers} workers: a {cuda_model} step, "
            f"{step.calibrate() * 1e3:.1f} ms on a resident batch")
    else:
        workers = workers or usable_cores()
        step = slack * loader_batch_time(ds, batch_size, workers)
        log(f"{len(ds)} images, batch {batch_size}, {workers} workers: the stand-in step is "
            f"{step * 1e3:.1f} ms ({slack}x the loader's time per batch inside an epoch)")
    out: Dict[str, List[EpochRun]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        if cuda_model:
            log(f"round {r + 1}/{rounds}: resident-batch step {step.calibrate() * 1e3:.1f} ms")
        for name, across in VARIANTS.items():
            run = one_run(ds, across, batch_size=batch_size, workers=workers, epochs=epochs,
                          step=step)
            out[name].append(run)
            log(f"round {r + 1}/{rounds}: {name}: kept {run.kept:.3f} of the ideal, first-batch "
                f"waits {', '.join(f'{w * 1e3:.1f}' for w in run.first_waits)} ms, in-epoch "
                f"median {statistics.median(run.waits) * 1e3:.2f} ms")
    return out


def epochs_table(results: Dict[str, List[EpochRun]]) -> str:
    rows = ["| loader | kept of ideal (median) | spread | epoch-start wait, median ms | "
            "in-epoch wait, median / mean ms | start / in-epoch median |",
            "|---|---:|---|---:|---:|---:|"]
    for name, runs in results.items():
        kept = [r.kept for r in runs]
        first = statistics.median([w for r in runs for w in r.first_waits]) * 1e3
        inner = [w * 1e3 for r in runs for w in r.waits]
        med = statistics.median(inner)
        rows.append(f"| {name} | {statistics.median(kept):.3f} | {min(kept):.3f}-{max(kept):.3f} "
                    f"| {first:.1f} | {med:.2f} / {statistics.fmean(inner):.2f} "
                    f"| {first / med:.1f}x |")
    return "\n".join(rows)
