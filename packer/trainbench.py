"""The training-step phase of ``packer bench --cuda``: a real step (bf16 autocast,
channels_last, SGD) of a model fed by each feeding variant (plain, pin_memory +
non_blocking, thread prefetcher, CUDAPrefetcher, thread + CUDAPrefetcher, GPU decode),
against the same step on a batch kept on the device; data wait timed with CUDA events.

Also the models it trains: ``make_model`` (torchvision's by name, else the built-in
``resnet50`` or ``tiny``), so ``--cuda`` works without torchvision.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch
from torch import nn

from .benchphases import Runner, SeedWorker, Source, has_module, n_workers
from .build import default_workers
from .dataset import PackedDataset
from .errors import PackerError

GPU_DECODE = "GPU decode (nvJPEG)"


class TrainRunner(Runner):
    """``Runner``'s phases and the training step's."""

    def train_phase(self, source: Source, orders: Dict[str, List[int]], batch_size: int,
                    size: int, model: str, device: torch.device, repeats: int) -> None:
        """A real step (bf16 autocast, channels_last, SGD) fed by each variant, against the
        same step on one batch kept on the device. See ``_train_run`` for the timing."""
        loaders = self.report.of("loader", source.name)
        w = max(loaders, key=lambda r: r["images_per_s"])["workers"] if loaders else default_workers()
        classes = len(PackedDataset(source.root).classes)
        net = make_model(model, max(1000, classes) if model != "tiny" else max(10, classes))
        net = net.to(device, memory_format=torch.channels_last)
        step = _Step(net, device)
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
                 "thread prefetcher", "CUDAPrefetcher", "thread + CUDAPrefetcher"]
        if device.type == "cuda" and has_module("torchvision") and has_module("packer.gpu_decode"):
            names.append(GPU_DECODE)  # packer's nvJPEG path: workers only read bytes
            self.bar.total += repeats
        runs: Dict[str, List[dict]] = {n: [] for n in names}
        for r in range(repeats):
            for name in names:
                self._begin(f"train {name}")
                if name.startswith("synthetic"):
                    runs[name].append(self._train_run(step, _repeat((x_syn, y_syn)), 1, device))
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
                self._tick()
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

    def _train_run(self, step: "_Step", feed, warmup: int, device: torch.device) -> dict:
        """Throughput from the wall clock between two synchronizes; data wait from marks
        recorded on the device stream around each step (events on CUDA), so the loop keeps
        its natural overlap: the host is never made to wait inside the timed steps."""
        it = iter(feed)
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


def _repeat(batch):
    while True:
        yield batch


# -- training harness ------------------------------------------------------------------------

class _Step:
    """One training step: bf16 autocast forward, loss, backward, SGD update."""

    def __init__(self, net: nn.Module, device: torch.device):
        from .prefetch import IMAGENET_MEAN, IMAGENET_STD
        self.net, self.device = net, device
        self.opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        self.loss = nn.CrossEntropyLoss()
        mean = torch.tensor(IMAGENET_MEAN).view(1, -1, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, -1, 1, 1)
        self.scale, self.shift = (1 / (255 * std)).to(device), (-mean / std).to(device)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 normalized, channels_last: what CUDAPrefetcher does, done in-loop."""
        from .prefetch import normalize_uint8
        return normalize_uint8(x, self.scale, self.shift, channels_last=True)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss(self.net(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _feed(name: str, ds, order, batch_size: int, size: int, w: int, step: _Step,
          device: torch.device, r: int):
    """An iterator of (normalized images, labels) on ``device`` for one feeding variant, and
    the callables that shut it down. Loader workers are forked after CUDA is initialised, as
    in any training script; they never touch CUDA."""
    from .loader import background, make_loader
    from .prefetch import CUDAPrefetcher
    if name == GPU_DECODE:
        from .gpu_decode import GPUDecoder, make_gpu_loader
        loader = make_gpu_loader(ds, batch_size, sampler=order, num_workers=w, drop_last=True,
                                 persistent_workers=False)
        g = iter(GPUDecoder(loader, size=size, dtype=torch.float32, channels_last=True,
                            device=device, seed=r))
        return g, [g.close]
    gpu = device.type == "cuda"
    pin = gpu and name != "plain"
    loader = make_loader(ds, batch_size, sampler=order, num_workers=w, pin_memory=pin,
                         persistent_workers=False, drop_last=True, worker_init_fn=SeedWorker(r))
    closers: List[Callable] = []
    if name in ("plain", "pin_memory + non_blocking", "thread prefetcher"):
        src = loader
        if name == "thread prefetcher":
            src = background(loader, depth=2)
            closers.append(src.close)

        def gen():
            for x, y in src:  # the copy and normalize are queued on the training stream
                yield (step.normalize(x.to(device, non_blocking=pin)), y.to(device, non_blocking=pin))
        g = gen()
        closers.insert(0, g.close)
        return g, closers
    src = loader
    if name == "thread + CUDAPrefetcher":
        src = background(loader, depth=2)  # batch hand-over from workers off the training thread
        closers.append(src.close)
    g = iter(CUDAPrefetcher(src, device=device, channels_last=True))
    closers.insert(0, g.close)
    return g, closers


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
        gaps = []
        for k in range(2, len(self.marks) - 1, 2):
            end, start = self.marks[k - 1], self.marks[k]
            gaps.append(end.elapsed_time(start) if self.cuda else 1e3 * (start - end))
        return statistics.fmean(gaps) if gaps else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(name: str, num_classes: int) -> nn.Module:
    """``torchvision.models.<name>`` when torchvision is installed; else the built-in
    ``resnet50`` (torchvision's layout: bottleneck blocks [3, 4, 6, 3], 25.6 M parameters
    with 1000 classes) or ``tiny``, so ``--cuda`` works without torchvision."""
    if name == "tiny":
        return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
    try:
        import torchvision
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ImportError:
        pass
    except ValueError as e:
        raise PackerError(f"--model {name}: {e}") from None
    if name != "resnet50":
        raise PackerError(f"--model {name} needs torchvision (pip install torchvision, then "
                          f"re-run scripts/install_pillow_simd.sh); built in: resnet50, tiny")
    return resnet50(num_classes)


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.skip(x))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (v1.5: stride in the 3x3 conv, as torchvision), randomly initialised."""
    layers: List[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if b == 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)

