"""The training-step phase of ``packer bench --cuda``: a real step fed by each feeding variant,
against the same step on a batch kept on the device; data wait timed with CUDA events."""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Dict, List

import torch

from .._util.system import usable_cores
from ..loading.threaded import background
from ..reading.dataset import PackedDataset
from ..loading.loader import make_loader
from ..loading.prefetch import CUDAPrefetcher
from .models import TrainStep, make_model
from .phases import BenchInput, Runner, SeedWorker, has_module, n_workers

GPU_DECODE = "GPU decode (nvJPEG)"


class TrainRunner(Runner):
    """``Runner``'s phases and the training step's."""

    def train_phase(self, source: BenchInput, orders: Dict[str, List[int]], batch_size: int,
                    size: int, model: str, device: torch.device, repeats: int) -> None:
        """A real step (bf16 autocast, channels_last, SGD) fed by each variant, against the
        same step on one batch kept on the device."""
        loaders = self.report.of("loader", source.name)
        w = max(loaders, key=lambda r: r["images_per_s"])["workers"] if loaders else usable_cores()
        classes = len(PackedDataset(source.root).classes)
        net = make_model(model, max(1000, classes) if model != "tiny" else max(10, classes))
        net = net.to(device, memory_format=torch.channels_last)
        step = TrainStep(net, device)
        benchmark_before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cudnn pick its fastest kernels
        try:
            self._train_variants(source, orders, batch_size, size, model, device, repeats, w,
                                 classes, step)
        finally:
            torch.backends.cudnn.benchmark = benchmark_before

    def _train_variants(self, source, orders, batch_size, size, model, device, repeats, w,
                        classes, step) -> None:
        x_syn = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, device=device)
        x_syn = step.normalize(x_syn)
        y_syn = torch.randint(0, classes, (batch_size,), device=device)
        for _ in range(5):  # autotune and allocate once, outside every timed run
            step(x_syn, y_syn)
        _sync(device)
        names = ["synthetic (batch on device)", "plain", "pin_memory + non_blocking",
                 "background thread", "CUDAPrefetcher", "thread + CUDAPrefetcher"]
        if device.type == "cuda" and has_module("torchvision"):
            names.append(GPU_DECODE)  # packer's nvJPEG path: workers only read bytes
            self.bar.total += repeats
        runs: Dict[str, List[dict]] = {n: [] for n in names}
        for r in range(repeats):
            for name in names:
                self.bar.set_postfix_str(f"train {name}")
                if name.startswith("synthetic"):
                    resident = itertools.repeat((x_syn, y_syn))
                    runs[name].append(self._train_run(step, resident, 1, device))
                else:
                    self._evict(source, orders[source.name])
                    feed, closers = _feed(name, source.dataset(size), orders[source.name],
                                          batch_size, size, w, step, device, r)
                    try:
                        runs[name].append(self._train_run(step, feed, max(1, w) + 1, device))
                    finally:
                        for c in closers:
                            c()
                        del feed
                self.bar.update(1)
        syn = self._add(f"train {model}: synthetic (batch on {device.type})", "train", runs[names[0]],
                        workers=None, feed="synthetic")
        for name in names[1:]:
            res = self._add(f"train {model}: {name}, {n_workers(w)}", "train", runs[name],
                            source=source.name, workers=w, feed=name)
            if res and syn:
                res["starvation_pct"] = max(0.0, 100 * (1 - res["images_per_s"] / syn["images_per_s"]))
        if syn:
            syn["starvation_pct"] = 0.0
        self.report.environment["data_wait_method"] = (
            "CUDA events on the training stream: end of one step's optimizer update to the "
            "start of the next forward (includes the copy and normalize when they run on the "
            "training stream); no per-step synchronize" if device.type == "cuda"
            else "host clock between steps (CPU run)")

    def _train_run(self, step: "TrainStep", feed, warmup: int, device: torch.device) -> dict:
        """Throughput between two synchronizes; data wait from events around each step, so the host
        never waits inside the timed steps."""
        it = (as_labels(x, y) for x, y in feed)
        try:
            for _ in range(warmup):
                step(*next(it))
            _sync(device)
            marks = _Marks(device)
            host_wait = 0.0
            n, t0 = 0, time.perf_counter()
            limit = self.max_images or float("inf")
            while time.perf_counter() - t0 < self.seconds and n < limit:
                th = time.perf_counter()
                try:
                    x, y = next(it)
                except StopIteration:
                    break
                host_wait += time.perf_counter() - th
                marks.mark()
                step(x, y)
                marks.mark()
                n += len(x)
            _sync(device)
            el = time.perf_counter() - t0
        except StopIteration:
            return {}
        steps = len(marks.marks) // 2
        if steps == 0:
            return {}
        return {"images_per_s": n / el, "data_wait_ms": marks.mean_gap_ms(),
                "host_wait_ms": 1e3 * host_wait / steps}


def as_labels(x: torch.Tensor, y):
    """``(x, labels)`` for the classification step: other targets become a stand-in label 0."""
    if not torch.is_tensor(y):
        y = torch.zeros(len(x), dtype=torch.long, device=x.device)
    return x, y


def _feed(name: str, ds, order, batch_size: int, size: int, w: int, step: TrainStep,
          device: torch.device, r: int):
    """(iterator of normalized images and labels on ``device``, its closers) for one variant."""
    if name == GPU_DECODE:
        from ..gpu import GPUDecoder, make_gpu_loader  # needs torchvision or libnvjpeg: on demand
        loader = make_gpu_loader(ds, batch_size, sampler=order, num_workers=w, drop_last=True,
                                 persistent_workers=False)
        g = iter(GPUDecoder(loader, size=size, dtype=torch.float32, device=device, seed=r))
        return g, [g.close]
    gpu = device.type == "cuda"
    pin = gpu and name != "plain"
    loader = make_loader(ds, batch_size, sampler=order, num_workers=w, pin_memory=pin,
                         persistent_workers=False, drop_last=True, worker_init_fn=SeedWorker(r))
    src, closers = loader, []
    if name in ("background thread", "thread + CUDAPrefetcher"):
        src = background(loader, depth=2)  # batch hand-over from workers off the training thread
        closers.append(src.close)
    if name.endswith("CUDAPrefetcher"):
        g = iter(CUDAPrefetcher(src, device=device, channels_last=True))
    else:
        def gen():
            for x, y in src:  # the copy and normalize are queued on the training stream
                y = y.to(device, non_blocking=pin) if torch.is_tensor(y) else y  # (detection: lists)
                yield step.normalize(x.to(device, non_blocking=pin)), y
        g = gen()
    return g, [g.close] + closers


class _Marks:
    """Timestamps alternating step start / step end: CUDA events on the current stream (read
    after the final synchronize), or host clock readings on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def mean_gap_ms(self) -> float:
        """Mean time from one step's end to the next step's start (0 for a single step)."""
        gaps = [end.elapsed_time(start) if self.cuda else 1e3 * (start - end)
                for end, start in zip(self.marks[1:-1:2], self.marks[2::2])]
        return statistics.fmean(gaps) if gaps else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
