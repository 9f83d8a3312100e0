"""What ``benchmarks/bench_prefetch.py`` measures: the GPU time each way of feeding batches
loses, against the same training step (``models.TrainStep``) on a batch already resident on
the device.

  resident    the same float batch, already on the device: the step's own speed
  plain       float32 batches normalized on the CPU, ``.to(device)`` from pageable memory
  pinned      uint8 batches in pinned memory, ``.to(device, non_blocking=True)``, then
              converted and normalized on the training stream
  prefetcher  uint8 pinned batches through ``CUDAPrefetcher`` (side-stream copy and
              normalization, overlapped with the previous step)

Batches are pre-made CPU tensors (``synthetic``), or with ``dataset`` a PackedDataset fed
through ``make_loader``. ``bench_prefetch`` times the modes (resident first and last);
``prefetch_table`` prints images/s, step time, data wait and starvation per mode.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from packer.reading.dataset import PackedDataset
from packer.transforms.decode import DecodeRandomResizedCrop
from packer.loading import collate_uint8, make_loader
from packer.loading.prefetch import IMAGENET_MEAN, IMAGENET_STD, CUDAPrefetcher, normalize_affine, normalize_uint8
from packer.bench.models import TrainStep, make_model

__all__ = ["MODES", "Endless", "FloatCollate", "PrefetchOptions", "Source", "bench_prefetch",
           "check_modes", "prefetch_table", "run_mode", "synthetic"]

MODES = ("resident", "plain", "pinned", "prefetcher")
CLASSES = 1000  # synthetic labels, and the model's outputs


@dataclass(frozen=True)
class PrefetchOptions:
    """``benchmarks/bench_prefetch.py``'s options."""
    model: str = "resnet50"
    batch: int = 256
    size: int = 224
    steps: int = 15             # steps per timed repeat
    repeats: int = 3
    warmup: int = 8
    pool: int = 4               # distinct synthetic batches
    modes: Tuple[str, ...] = MODES
    dataset: Optional[str] = None  # a packed dataset to feed through make_loader instead
    workers: Optional[int] = None  # loader workers (with dataset)
    device: Optional[str] = None   # default: cuda when available


def check_modes(text: str) -> List[str]:
    """The modes named in the comma-separated ``text``; ValueError for an unknown one."""
    modes = [m for m in text.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    return modes


def synthetic(n_batches: int, batch: int, size: int, seed: int = 0):
    """Pre-made uint8 batches (channels_last, as make_loader collates) and int64 labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=g)
        out.append((x.permute(0, 3, 1, 2), torch.randint(0, CLASSES, (batch,), generator=g)))
    return out


class Endless:
    """Re-iterates forever, so no mode pays a pipeline refill at an epoch boundary."""

    def __init__(self, iterable: Iterable):
        self.iterable = iterable

    def __iter__(self):
        while True:
            yield from self.iterable


class FloatCollate:
    """``collate_uint8``, then normalized to float32 (in the workers): the classic pipeline."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor):
        self.scale, self.shift = scale, shift

    def __call__(self, batch):
        x, y = collate_uint8(batch)
        return normalize_uint8(x, self.scale, self.shift), y


class Source:
    """An endless iterator of batches for one mode, plus a per-step transform to the device."""

    def __init__(self, mode: str, opts: PrefetchOptions, device: torch.device,
                 scale: torch.Tensor, shift: torch.Tensor):
        self.mode, self.opts, self.device = mode, opts, device
        self.scale, self.shift = scale.to(device), shift.to(device)
        if opts.dataset:
            self.batches = self._dataset_loader(scale, shift)
        else:
            base = synthetic(opts.pool, opts.batch, opts.size)
            if mode in ("resident", "plain"):  # float32 normalized on the CPU, pageable
                base = [(normalize_uint8(x, scale, shift), y) for x, y in base]
            elif device.type == "cuda":
                base = [(x.pin_memory(), y.pin_memory()) for x, y in base]
            self.batches = base
        if mode == "resident":
            x, y = next(iter(self.batches))
            x = x.to(device) if x.dtype != torch.uint8 else normalize_uint8(
                x.to(device), self.scale, self.shift)
            self.it = itertools.repeat((x.contiguous(memory_format=torch.channels_last), y.to(device)))
        elif mode == "prefetcher":
            self.it = iter(CUDAPrefetcher(Endless(self.batches), IMAGENET_MEAN, IMAGENET_STD,
                                          device=device))
        else:
            self.it = iter(Endless(self.batches))

    def _dataset_loader(self, scale: torch.Tensor, shift: torch.Tensor):
        ds = PackedDataset(self.opts.dataset, decode=DecodeRandomResizedCrop(self.opts.size))
        kwargs = {"num_workers": self.opts.workers, "drop_last": True}
        if self.mode == "plain":  # the classic pipeline: float normalized in the workers
            return make_loader(ds, self.opts.batch, pin_memory=False,
                               collate_fn=FloatCollate(scale, shift), **kwargs)
        return make_loader(ds, self.opts.batch, **kwargs)

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self.it)
        if self.mode in ("resident", "prefetcher"):
            return x, y
        if self.mode == "plain":
            return x.to(self.device), y.to(self.device)
        x = x.to(self.device, non_blocking=True)
        return normalize_uint8(x, self.scale, self.shift), y.to(self.device, non_blocking=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, opts: PrefetchOptions, device: torch.device, step: Callable,
             scale: torch.Tensor, shift: torch.Tensor) -> Tuple[float, float]:
    """(step seconds, host wait seconds per step), medians of ``opts.repeats`` timed runs of
    ``opts.steps`` steps after ``opts.warmup`` steps."""
    src = Source(mode, opts, device, scale, shift)
    for _ in range(opts.warmup):
        step(*src.next())
    _sync(device)
    times, host_waits = [], []
    for _ in range(opts.repeats):
        wait = 0.0
        t0 = time.perf_counter()
        for _ in range(opts.steps):
            t1 = time.perf_counter()
            x, y = src.next()
            wait += time.perf_counter() - t1
            step(x, y)
        _sync(device)
        times.append((time.perf_counter() - t0) / opts.steps)
        host_waits.append(wait / opts.steps)
    del src
    return statistics.median(times), statistics.median(host_waits)


def bench_prefetch(opts: PrefetchOptions = PrefetchOptions(),
                   log: Callable[[str], None] = print) -> Dict[str, Tuple[float, float]]:
    """``run_mode`` for each of ``opts.modes``, bracketed by ``resident`` (run first and last,
    the faster kept); mode -> (step seconds, host wait seconds per step), resident first."""
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modes = ["resident"] + [m for m in opts.modes if m != "resident"] + ["resident"]
    scale, shift = normalize_affine(IMAGENET_MEAN, IMAGENET_STD)
    model = make_model(opts.model, CLASSES).to(device, memory_format=torch.channels_last)
    step = TrainStep(model, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    src = f"PackedDataset {opts.dataset}" if opts.dataset else "pre-made CPU tensors"
    log(f"# {opts.model}, batch {opts.batch}, {opts.size}px, bf16 autocast, channels_last, "
        f"SGD; {name}; torch {torch.__version__}; batches from {src}")
    log(f"# median of {opts.repeats} x {opts.steps} steps after {opts.warmup} warm-up steps")
    benchmark_before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True  # fixed shapes: let cudnn pick its fastest kernels
    results: Dict[str, Tuple[float, float]] = {}
    try:
        for m in modes:
            r = run_mode(m, opts, device, step, scale, shift)
            results[m] = min(results.get(m, r), r)  # resident: the faster of its two runs
    finally:
        torch.backends.cudnn.benchmark = benchmark_before
    return results


def prefetch_table(results: Dict[str, Tuple[float, float]], batch: int) -> str:
    """``bench_prefetch``'s result as a markdown table: images/s, step ms, data wait (step
    time - resident step time), starvation (1 - rate / resident rate), host wait."""
    real = results["resident"][0]
    lines = ["| mode | images/s | step ms | data wait ms/step | starvation | host wait ms/step |",
             "|---|---:|---:|---:|---:|---:|"]
    for m, (t, hw) in results.items():
        lines.append(f"| {m} | {batch / t:,.0f} | {t * 1e3:.1f} | {(t - real) * 1e3:.1f} | "
                     f"{1 - real / t:.1%} | {hw * 1e3:.1f} |")
    return "\n".join(lines)
