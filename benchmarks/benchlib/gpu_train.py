"""The GPU-decode benchmark's training-side sections (``benchlib.gpu``): ResNet-18 steps
fed by GPUDecoder against synthetic batches, what each part of the GPU stage costs a step
beside it, the fed loop's diagnostics, and decoding under load (contention).
"""
from __future__ import annotations

import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from packer.gpu import make_gpu_loader
from packer.gpu.nvjpeg import NvjpegDecoder
from packer.loading.prefetch import CUDAPrefetcher
from benchlib.gpu_common import (GPUBench, capture_step, encoded_views, endless, fed_rate, median_rate,
                                  new_decoder, preload, synthetic_batch, sync)
from benchlib.gpu_probe import YuvDecoder
from packer.bench.models import TrainStep, make_model

__all__ = ["beside", "contention", "eager_step", "fed_diagnostics", "graphed_step", "resnet"]


def _resnet18(dev: torch.device):
    return make_model("resnet18", 1000).to(dev, memory_format=torch.channels_last)


def eager_step(dev: torch.device) -> TrainStep:
    """The ResNet-18 training step (bf16 autocast, channels_last, SGD), eager."""
    torch.backends.cudnn.benchmark = True
    return TrainStep(_resnet18(dev), dev)


def graphed_step(dev: torch.device, x: torch.Tensor, y: torch.Tensor):
    """A ResNet-18 training step (forward, backward, SGD) captured whole as one CUDA graph
    (PyTorch's whole-network capture recipe): the training thread then launches one graph per
    step instead of ~hundreds of kernels, leaving the GIL and the CPU to the decode threads."""
    import torch.nn.functional as F
    model = _resnet18(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def body(sx, sy):
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = F.cross_entropy(model(sx), sy)
        loss.backward()
        opt.step()
    return capture_step(body, x.clone(), y.clone())


def _steps_rate(b: GPUBench, step, x, y) -> float:
    return median_rate(lambda: [step(x, y) for _ in range(b.a.steps)], b.a.steps * b.a.batch,
                       3, b.dev)


def resnet(b: GPUBench, name: str, cpu_loader=None, variants=(), path: Path = None) -> None:
    """ResNet-18 training steps fed by GPUDecoder (one fresh loader per row), against the
    same step on a batch already on the GPU; eager, and captured as one CUDA graph (the
    training thread then needs no CPU: what remains is the pipeline)."""
    a, dev = b.a, b.dev
    step = eager_step(dev)
    x, y = synthetic_batch(b)
    for _ in range(a.warmup):
        step(x, y)
    syn, syn_all = _steps_rate(b, step, x, y)
    b.results[f"resnet18_{name}"] = {"synthetic": syn_all}
    b.row("6", "ResNet-18 step (bf16, channels_last, SGD) on a synthetic on-GPU batch", syn)
    graph = None
    for label, kw in variants:
        kw = dict(kw)
        graphed = kw.pop("graphed", False)
        if graphed and graph is None:  # the whole step as one CUDA graph
            graph = graphed_step(dev, x, y)
            graph_syn, _ = _steps_rate(b, graph, x, y)
            b.row("6", "ResNet-18 step as one CUDA graph, synthetic on-GPU batch", graph_syn)
        run_step, base = (graph, graph_syn) if graphed else (step, syn)
        gc.collect()  # nothing of the last row left to be collected in a forked worker
        g = new_decoder(b, path, kw)
        real, real_all = fed_rate(b, run_step, endless(g))
        b.results[f"resnet18_{name}"][label] = {"rates": real_all, "ratio": real / base,
                                                "stats": g.stats.as_dict(), "backend": g.backend}
        b.log(f"   pipeline stats while training ({label}): {g.stats.as_dict()}")
        wait, throttle = (1e3 * g.stats.seconds.get(k, 0) / max(1, g.stats.batches)
                          for k in ("consumer", "throttle"))
        b.row("6", f"ResNet-18 fed by GPUDecoder, {label} [{name}]", real,
              f"{real / base:.1%} of synthetic{' (graphed)' if graphed else ''}; waited for batches "
              f"{wait:.1f}, for its own GPU work {throttle:.1f} ms/batch")
    if cpu_loader is not None:  # the CPU path into the same step, for comparison
        pf = CUDAPrefetcher(cpu_loader, device=dev, dtype=torch.bfloat16)

        def cpu_batches():
            while True:
                yield from pf
        cpu, cpu_all = fed_rate(b, step, cpu_batches())
        b.results[f"resnet18_{name}"]["cpu_path"] = {"rates": cpu_all, "ratio": cpu / syn}
        b.row("6", f"ResNet-18 step fed by the CPU path ({a.cpus} workers + CUDAPrefetcher) [{name}]",
              cpu, f"{cpu / syn:.1%} of synthetic")


def _pipeline_loop(b: GPUBench, path: Path, kw: dict, count: list):
    def run(stop):
        g = new_decoder(b, path, kw, max_ahead=None)
        e = 0
        while not stop.is_set():
            g.set_epoch(e)
            for _, y in g:
                count[0] += len(y)
                if stop.is_set():
                    break
            e += 1
    return run


def _side_loop(dev: torch.device, fn, items, count: list):
    def run(stop):
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            while not stop.is_set():
                for it in items:
                    n = fn(it)
                    torch.cuda.current_stream(dev).synchronize()
                    count[0] += n
                    if stop.is_set():
                        return
    return run


def _beside_parts(b: GPUBench, path: Path, count: list) -> dict:
    """label -> run(stop): one part of the GPU stage, flat out, counting images in count[0]."""
    dev = b.dev
    batches = preload(make_gpu_loader(path, b.a.batch, num_workers=b.a.loader_workers,
                                      drop_last=True), b.a.preload)
    nv = NvjpegDecoder.shared(dev, 7)
    yuv = YuvDecoder(NvjpegDecoder.shared(dev, 8))
    g = new_decoder(b, [], {}, backend="nvjpeg", overlap=0)
    decoded = [g.decode_batch(x) for x in batches]
    parts = {
        "nvJPEG decode (RGB, decode_flat)":
            _side_loop(dev, lambda x: len(nv.decode_flat(x.data, x.offsets, dev)), batches, count),
        "nvJPEG decode (YUV planes)":
            _side_loop(dev, lambda x: (yuv(x.images(), dev), len(x.labels))[1], batches, count),
        "fused augment (triton)":
            _side_loop(dev, lambda it: len(g.augment_batch(it, 0)[1]), decoded, count),
    }
    for label, kw in (("default settings", {}), ("loader pinned", {"loader": {"pin_memory": True}})):
        parts[f"whole GPUDecoder, {label}"] = _pipeline_loop(b, path, kw, count)

    def loader_only(stop):  # make_gpu_loader's DataLoader (unpinned) and nothing else
        ld = make_gpu_loader(path, b.a.batch, num_workers=b.a.loader_workers, drop_last=True)
        while not stop.is_set():
            for x in ld:
                count[0] += len(x.labels)
                if stop.is_set():
                    break
    parts["DataLoader alone (make_gpu_loader, unpinned)"] = loader_only
    return parts


def beside(b: GPUBench, path: Path) -> None:
    """What the GPU stage costs a training step that shares the GPU: the step (ResNet-18,
    captured as one CUDA graph, so the training thread needs no CPU) runs on synthetic
    batches while a thread runs one part of the GPU stage flat out; both rates are measured
    over the same seconds. The step's loss is the GPU time that part takes from it."""
    dev = b.dev
    x, y = synthetic_batch(b)
    step = graphed_step(dev, x, y)
    steps = 4 * b.a.steps

    def train_rate():  # synced every step: a loop that runs ahead fills the driver's launch
        for _ in range(5):  # queue and blocks the other threads' CUDA calls (GPUDecoder's
            step(x, y)      # max_ahead exists for that)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(x, y)
            sync(dev)
        return steps * b.a.batch / (time.perf_counter() - t0)
    alone = statistics.median(train_rate() for _ in range(3))
    b.row("8", "ResNet-18 step as one CUDA graph, synthetic batch, nothing beside it", alone)
    count = [0]
    for label, run in _beside_parts(b, path, count).items():
        gc.collect()  # nothing of the last part left to be collected in a forked worker
        stop = threading.Event()
        th = threading.Thread(target=run, args=(stop,), daemon=True)
        th.start()
        time.sleep(1.5)
        c0, t0 = count[0], time.perf_counter()
        rate = train_rate()
        side = (count[0] - c0) / (time.perf_counter() - t0)
        stop.set()
        th.join(30)
        count[0] = 0
        b.results[f"beside_{label}"] = {"train": rate, "train_alone": alone, "side_rate": side}
        b.row("8", f"ResNet-18 graphed step beside: {label}", rate,
              f"{rate / alone:.1%} of alone; beside it {side:,.0f} images/s")


def fed_diagnostics(b: GPUBench, name: str, path: Path, variants, graphed: bool = True) -> None:
    """The fed loop under settings that move one part each, with where each stage's time
    went; the step eager or captured as one CUDA graph (no training-side host work).
    Variants are (label, GPUDecoder/GPUOptions keyword arguments, make_gpu_loader's)."""
    dev = b.dev
    x, y = synthetic_batch(b)
    step = graphed_step(dev, x, y) if graphed else eager_step(dev)
    for _ in range(b.a.warmup):
        step(x, y)
    how = "as one CUDA graph" if graphed else "eager"
    base, _ = _steps_rate(b, step, x, y)
    b.row("9", f"ResNet-18 step {how}, synthetic on-GPU batch", base)
    for label, kw, lkw in variants:
        gc.collect()  # nothing of the last row left to be collected in a forked worker
        g = new_decoder(b, path, {**kw, "loader": lkw})
        torch.cuda.reset_peak_memory_stats(dev)
        real, real_all = fed_rate(b, step, endless(g))
        peak = torch.cuda.max_memory_allocated(dev) / 2**30
        per = {k: round(1e3 * v / max(1, g.stats.batches), 1) for k, v in g.stats.seconds.items()}
        b.results.setdefault(f"fed_{name}_{how}_{label}", []).append(
            {"rates": real_all, "ratio": real / base, "ms_per_batch": per, "peak_gib": peak})
        b.row("9", f"ResNet-18 {how}, fed by GPUDecoder: {label} [{name}]", real,
              f"{real / base:.1%}; peak {peak:.1f} GiB; ms/batch {per}")


def _decode_beside(dev: torch.device, decoder, views, work, seconds: float = 3.0):
    """(decode images/s in a thread, main-thread work calls/s) while ``work`` loops."""
    per = sum(len(v) for v in views)
    done, stop, steps = [], threading.Event(), 0

    def run():
        s = torch.cuda.Stream(dev)
        with torch.cuda.stream(s):
            decoder(views[0], dev)
            t0 = time.perf_counter()
            while not stop.is_set():
                for v in views:
                    decoder(v, dev)
                done.append(per)
            s.synchronize()
            done.append(time.perf_counter() - t0)
    th = threading.Thread(target=run)
    th.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        work()
        steps += 1
    sync(dev)
    busy = time.perf_counter() - t0
    stop.set()
    th.join()
    return sum(done[:-1]) / done[-1], steps / busy


def contention(b: GPUBench, loader, decoders: dict) -> None:
    """Why decoding slows while a model trains: nvJPEG on in-memory batches in a thread,
    with the main thread idle, running large matmuls (GPU busy, Python idle), or training
    ResNet-18 (GPU and Python busy), on the default stream or another, synced or not."""
    dev = b.dev
    views = [encoded_views(x) for x in preload(loader, b.a.preload)]
    step = eager_step(dev)
    x, y = synthetic_batch(b)
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def train():
        step(x, y)

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize(dev)
        return run
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))

    def on_side():  # is it the legacy default stream that nvJPEG's work waits behind?
        with torch.cuda.stream(side):
            train()
    loads = {"idle": lambda: time.sleep(0.01), "matmul": lambda: (m @ m, m @ m),
             "matmul, sync each step": synced(lambda: (m @ m, m @ m)),
             "resnet18": train, "resnet18, sync each step": synced(train),
             "resnet18 on a non-default stream": on_side,
             "resnet18 on a non-default stream, sync each step": synced(on_side)}
    train(), train()
    switch = sys.getswitchinterval()
    for dname, decoder in decoders.items():
        for name, work in loads.items():
            rate, main_rate = _decode_beside(dev, decoder, views, work)
            note = f"main: {main_rate:.1f} {name} steps/s; GIL switch {switch * 1e3:g} ms"
            b.results[f"contention_{dname}_{name}"] = {"decode_rate": rate, "main_steps_s": main_rate}
            b.row("2b", f"decode ({dname}) in a thread, main thread: {name}", rate, note)
