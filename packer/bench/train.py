"""The training-step phase of ``packer bench --cuda``: a real step fed by each feeding variant,
against the same step on a batch kept on the device; data wait timed with CUDA events."""
from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import time
from typing import Dict, Iterator, List

import torch

from .._util.system import usable_cores
from ..loading.threaded import background
from ..reading.dataset import PackedDataset
from ..loading.loader import make_loader
from ..loading.prefetch import CUDAPrefetcher
from .models import TrainStep, make_model
from .phases import BenchInput, Runner, has_module, n_workers, seed_worker

GPU_DECODE = "GPU decode (nvJPEG)"
FEEDS = ["plain", "pin_memory + non_blocking", "background thread", "CUDAPrefetcher",
         "thread + CUDAPrefetcher"]


class TrainRunner(Runner):
    """``Runner``'s phases and the training step's."""

    def train_phase(self, source: BenchInput, orders: Dict[str, List[int]], batch_size: int,
                    size: int, model: str, device: torch.device, repeats: int) -> None:
        """A real step (bf16 autocast, channels_last, SGD) fed by each variant, against the
        same step on one batch kept on the device. See ``_train_run`` for the timing."""
        loaders = self.report.of("loader", source.name)
        w = max(loaders, key=lambda r: r["images_per_s"])["workers"] if loaders else usable_cores()
        classes = len(PackedDataset(source.root).classes)
        net = make_model(model, max(1000, classes) if model != "tiny" else max(10, classes))
        step = TrainStep(net.to(device, memory_format=torch.channels_last), device)
        x_syn = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, device=device)
        syn_batch = (step.normalize(x_syn), torch.randint(0, classes, (batch_size,), device=device))
        names = ["synthetic (batch on device)", *FEEDS]
        if device.type == "cuda" and has_module("torchvision"):
            names.append(GPU_DECODE)  # packer's nvJPEG path: workers only read bytes
            self.bar.total += repeats
        runs: Dict[str, List[dict]] = {n: [] for n in names}
        benchmark_before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cudnn pick its fastest kernels
        try:
            for _ in range(5):  # autotune and allocate once, outside every timed run
                step(*syn_batch)
            _sync(device)
            for r in range(repeats):
                for name in names:
                    if name == names[0]:
                        feed, warmup = (syn_batch for _ in itertools.count()), 1
                    else:
                        self._evict(source, orders[source.name])
                        feed = _feed(name, source.dataset(size), orders[source.name], batch_size,
                                     size, w, step, device, r)
                        warmup = max(1, w) + 1
                    with self._run(f"train {name}"), contextlib.closing(feed):
                        runs[name].append(self._train_run(step, feed, warmup, device))
        finally:
            torch.backends.cudnn.benchmark = benchmark_before
        syn = self._add(f"train {model}: synthetic (batch on {device.type})", "train",
                        runs[names[0]], workers=None, feed="synthetic")
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

    def _train_run(self, step: TrainStep, feed, warmup: int, device: torch.device) -> dict:
        """Throughput between two synchronizes; data wait from events around each step, so the host
        never waits inside the timed steps."""
        it = (as_labels(x, y) for x, y in feed)
        cuda = device.type == "cuda"
        try:
            for _ in range(warmup):
                step(*next(it))
            _sync(device)
            marks: list = []  # alternating step start / step end
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
                marks.append(_mark(cuda))
                step(x, y)
                marks.append(_mark(cuda))
                n += len(x)
            _sync(device)
            el = time.perf_counter() - t0
        except StopIteration:
            return {}
        if not marks:
            return {}
        gaps = [end.elapsed_time(start) if cuda else 1e3 * (start - end)  # step end -> next start
                for end, start in zip(marks[1:-1:2], marks[2::2])]
        return {"images_per_s": n / el, "data_wait_ms": statistics.fmean(gaps) if gaps else 0.0,
                "host_wait_ms": 1e3 * host_wait / (len(marks) // 2)}


def as_labels(x: torch.Tensor, y):
    """``(x, labels)`` for the classification step: other targets become a stand-in label 0."""
    if not torch.is_tensor(y):
        y = torch.zeros(len(x), dtype=torch.long, device=x.device)
    return x, y


def _feed(name: str, ds, order, batch_size: int, size: int, w: int, step: TrainStep,
          device: torch.device, r: int) -> Iterator:
    """(normalized images, labels) on ``device`` from one feeding variant; ``close()`` stops it."""
    if name == GPU_DECODE:
        from ..gpu import GPUDecoder, make_gpu_loader  # needs torchvision or libnvjpeg: on demand
        loader = make_gpu_loader(ds, batch_size, sampler=order, num_workers=w, drop_last=True,
                                 persistent_workers=False)
        yield from GPUDecoder(loader, size=size, dtype=torch.float32, device=device, seed=r)
        return
    pin = device.type == "cuda" and name != "plain"
    loader = make_loader(ds, batch_size, sampler=order, num_workers=w, pin_memory=pin,
                         persistent_workers=False, drop_last=True,
                         worker_init_fn=functools.partial(seed_worker, r))
    threaded = name in ("background thread", "thread + CUDAPrefetcher")
    src = background(loader, depth=2) if threaded else loader  # hand-over off the training thread
    try:
        if name.endswith("CUDAPrefetcher"):
            yield from CUDAPrefetcher(src, device=device, channels_last=True)
        else:
            for x, y in src:  # the copy and normalize are queued on the training stream
                y = y.to(device, non_blocking=pin) if torch.is_tensor(y) else y  # detection: list
                yield step.normalize(x.to(device, non_blocking=pin)), y
    finally:
        if threaded:
            src.close()


def _mark(cuda: bool):
    """Now: a CUDA event on the current stream (read after a synchronize), or the host clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
