#!/usr/bin/env python3
"""How much GPU time does each way of feeding batches lose? (ResNet-50-like training step.)

Each mode feeds the same training step (ResNet-50, bf16 autocast, channels_last, SGD) and is
compared with that step on a batch already resident on the GPU:

  resident    the same float batch, already on the GPU: the step's own speed (``real``)
  plain       float32 batches normalized on the CPU, ``.to(device)`` from pageable memory
              (the classic ToTensor + Normalize pipeline)
  pinned      uint8 batches in pinned memory, ``.to(device, non_blocking=True)``, then
              converted and normalized on the training stream
  prefetcher  uint8 pinned batches through ``packer.CUDAPrefetcher`` (side-stream copy and
              normalization, overlapped with the previous step)

By default batches come from a list of pre-made CPU tensors, so loading costs nothing and
only the host-to-device path is measured. ``--dataset PATH`` feeds a real PackedDataset
through ``make_loader`` (decode + RandomResizedCrop in workers) instead.

Reported per mode: images/s, step time, and
  data wait (ms/step) = step time of the mode - step time of ``resident``: the GPU time per
                        step lost to getting the batch in;
  starvation          = 1 - rate(mode) / rate(resident) = wait / step time of the mode: the
                        fraction of the GPU's time spent not training.
Each figure is the median of ``--repeats`` timed runs of ``--steps`` steps after warm-up.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packer.prefetch import IMAGENET_MEAN, IMAGENET_STD, CUDAPrefetcher, _affine, normalize_uint8  # noqa: E402

MODES = ("resident", "plain", "pinned", "prefetcher")


def make_model(name: str, device):
    try:
        import torchvision
        model = getattr(torchvision.models, name)(num_classes=1000)
    except ImportError:  # no torchvision (CPU smoke tests): a small conv net
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, 2, 1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, 2, 1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 1000))
    return model.to(device, memory_format=torch.channels_last)


def make_step(model, device):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(x, y):
        with amp:
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def synthetic(n_batches, batch, size, seed=0):
    """Pre-made uint8 batches (channels_last, as make_loader collates) and int64 labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=g)
        out.append((x.permute(0, 3, 1, 2), torch.randint(0, 1000, (batch,), generator=g)))
    return out


class Endless:
    """Re-iterates forever, so no mode pays a pipeline refill at an epoch boundary."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        while True:
            yield from self.iterable


class Source:
    """An endless iterator of batches for one mode, plus a per-step transform to the GPU."""

    def __init__(self, mode, args, device, scale, shift):
        self.mode, self.args, self.device = mode, args, device
        self.scale, self.shift = scale.to(device), shift.to(device)
        if args.dataset:
            self.batches = self._dataset_loader()
        else:
            base = synthetic(args.pool, args.batch, args.size)
            if mode in ("resident", "plain"):  # float32 normalized on the CPU, pageable
                base = [(normalize_uint8(x, scale, shift), y) for x, y in base]
            elif device.type == "cuda":
                base = [(x.pin_memory(), y.pin_memory()) for x, y in base]
            self.batches = base
        if mode == "resident":
            x, y = next(iter(self.batches))
            x = x.to(device) if x.dtype != torch.uint8 else normalize_uint8(
                x.to(device), self.scale, self.shift)
            self.fixed = (x.contiguous(memory_format=torch.channels_last), y.to(device))
            self.it = itertools.repeat(self.fixed)
        elif mode == "prefetcher":
            self.it = iter(CUDAPrefetcher(Endless(self.batches), IMAGENET_MEAN, IMAGENET_STD,
                                          device=device))
        else:
            self.it = iter(Endless(self.batches))

    def _dataset_loader(self):
        from packer.dataset import PackedDataset
        from packer.imaging import DecodeRandomResizedCrop
        from packer.loader import make_loader
        ds = PackedDataset(self.args.dataset, decode=DecodeRandomResizedCrop(self.args.size))
        kwargs = {"num_workers": self.args.workers, "drop_last": True}
        if self.mode == "plain":  # the classic pipeline: float normalized in the workers
            return make_loader(ds, self.args.batch, pin_memory=False,
                               collate_fn=_FloatCollate(self.scale.cpu(), self.shift.cpu()), **kwargs)
        return make_loader(ds, self.args.batch, **kwargs)

    def next(self):
        x, y = next(self.it)
        if self.mode in ("resident", "prefetcher"):
            return x, y
        if self.mode == "plain":
            return x.to(self.device), y.to(self.device)
        x = x.to(self.device, non_blocking=True)
        return normalize_uint8(x, self.scale, self.shift), y.to(self.device, non_blocking=True)


class _FloatCollate:
    def __init__(self, scale, shift):
        self.scale, self.shift = scale, shift

    def __call__(self, batch):
        from packer.loader import collate_uint8
        x, y = collate_uint8(batch)
        return normalize_uint8(x, self.scale, self.shift), y


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode, args, device, step, scale, shift):
    src = Source(mode, args, device, scale, shift)
    for _ in range(args.warmup):
        step(*src.next())
    sync(device)
    times, host_waits = [], []
    for _ in range(args.repeats):
        wait = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            t1 = time.perf_counter()
            x, y = src.next()
            wait += time.perf_counter() - t1
            step(x, y)
        sync(device)
        times.append((time.perf_counter() - t0) / args.steps)
        host_waits.append(wait / args.steps)
    del src
    return statistics.median(times), statistics.median(host_waits)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--steps", type=int, default=15, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--pool", type=int, default=4, help="distinct synthetic batches")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dataset", help="a packed dataset to feed through make_loader instead")
    p.add_argument("--workers", type=int, default=None, help="loader workers (--dataset)")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cudnn.benchmark = True
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if "resident" in modes:
        modes.remove("resident")
    modes = ["resident"] + modes + ["resident"]  # first and last: the baseline brackets the rest
    scale, shift = _affine(IMAGENET_MEAN, IMAGENET_STD)
    model = make_model(args.model, device)
    step = make_step(model, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    src = f"PackedDataset {args.dataset}" if args.dataset else "pre-made CPU tensors"
    print(f"# {args.model}, batch {args.batch}, {args.size}px, bf16 autocast, channels_last, "
          f"SGD; {name}; torch {torch.__version__}; batches from {src}")
    print(f"# median of {args.repeats} x {args.steps} steps after {args.warmup} warm-up steps")
    results = {}
    for m in modes:
        r = run_mode(m, args, device, step, scale, shift)
        results[m] = min(results.get(m, r), r)  # resident: the faster of its two runs
    modes = list(dict.fromkeys(modes))
    real = results["resident"][0]
    print("| mode | images/s | step ms | data wait ms/step | starvation | host wait ms/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in modes:
        t, hw = results[m]
        print(f"| {m} | {args.batch / t:,.0f} | {t * 1e3:.1f} | {(t - real) * 1e3:.1f} | "
              f"{1 - real / t:.1%} | {hw * 1e3:.1f} |")


if __name__ == "__main__":
    main()
