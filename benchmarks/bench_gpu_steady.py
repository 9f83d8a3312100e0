#!/usr/bin/env python3
"""Steady-state GPU input pipelines: DALI's RN50 training pipeline against packer's GPU
path (and its CPU path), each variant in a fresh process, on the same JPEGs (GPU machine).

Makes --images photo-like JPEGs (~500x375, ~56 KiB, from packer's shipped photos) as an
ImageFolder tree, packs them with ``packer.build`` (stored, not transcoded), then runs every
variant as a child process of this script (``--variant NAME``, one JSON line out), in
--rounds rounds, the order rotated each round. Each child takes --warmup batches, then
times a window of --batches batches (crossing >= 3 epoch boundaries at the defaults: an
epoch is 40 batches of 256) between two ``torch.cuda.synchronize()``; images/s = images in
the window / its seconds. Batch-arrival gaps (no synchronize per batch) show the swings;
``epoch_start_gap_ms`` is the median gap before an epoch's first batch. packer's variants
drop each epoch's last partial batch (``drop_last=True``), as DALI's reader and the resident
batch have none: a new batch shape costs an eager model a one-time set-up (cuDNN plans) that
is no part of the input pipeline. Outputs stay on the GPU; nothing consumes them (the
pipelines alone). Each run also records ``cpu_in_window``: the CPU seconds the window took
of each of its threads (by name: decode threads, the DataLoader's pin thread), of its loader
workers together, and its page faults and context switches.

  dali            fn.readers.file(random_shuffle) -> decoders.image_random_crop(mixed) ->
                  resize 224 -> crop_mirror_normalize(fp16, CHW, coin-flip mirror);
                  batch 256, num_threads = os.cpu_count(), pipe.run(): DALI's defaults
  dali_hw99       the same with hw_decoder_load=0.99
  packer          GPUDecoder(make_gpu_loader(root, 256), size=224, train=True): all defaults
  packer_pinned3  the same, make_gpu_loader(pin_memory=True), GPUOptions(decode_threads=3)
  packer_plain2   the same, make_gpu_loader(pin_memory=False), GPUOptions(decode_threads=2)
  packer_<knobs>  (only with --only) packer with settings joined by "_": w<N> loader workers,
                  t<N> decode threads, plain (unpinned), pinned, s<N> the interpreter's
                  switch interval in microseconds (sys.setswitchinterval), c<N> the decode threads' pacing
                  (calm batches before one rests, packer.gpu.pipeline.CALM), nvic / nvichw:
                  nvImageCodec decodes (GPUOptions(decoder=), its defaults / its hardware
                  and CUDA backends only; needs nvidia-nvimgcodec-cu13), norel: the workers'
                  shared blocks freed where dropped (PACKER_SHM_RELEASE=0), noring: no
                  batch ring, each batch a shared block of its own copied by the pin thread
                  (PACKER_BATCH_RING=0), spawn / forkserver: the loader's workers started
                  that way (multiprocessing_context); e.g. packer_w8_t1
  packer_cpu      make_loader(PackedDataset(root, decode=DecodeRandomResizedCrop(224)), 256,
                  shuffle=True) + CUDAPrefetcher (normalize on the GPU)
  synthetic       (with --train or --detection) one resident batch: the model alone, the
                  baseline of --train
  resident        (with --detection) every batch of one epoch through the CPU path, kept on
                  the GPU and replayed in turn: the model alone on the dataset's own batches
                  (a detection step's host work depends on each batch's boxes, so one batch
                  is a loose baseline), the baseline of --detection
  workers<N>      packer_cpu with N workers, N = cores - 1 and cores (only with --only):
                  which should default_num_workers() be

--detection: --images COCO-style photo scenes with pasted objects at known boxes (default
2,000), packed with ``Coco``, and an SSDlite320 training step (bf16 autocast, SGD, batch 32,
320 px, torchvision's detection targets) on every batch: ``resident`` (the epoch's batches held
on the GPU), ``synthetic`` (one resident batch), ``packer_cpu`` (``DecodeLetterbox`` in the workers + ``CUDAPrefetcher``), ``packer``
(``GPUDecoder(letterbox=True)``, its defaults) and ``packer_t1`` by default; knobs as above.

Prints one table (median, min-max, each round, ratio to dali per round and of the medians);
writes results.json and results.md to --out (default $OUT, else ./gpu-steady-out). The DALI
variants run where ``nvidia.dali`` imports and CUDA works, else are listed as skipped (then
the ratios are to the first variant that ran). A run of the defaults takes ~4 minutes on 16
cores and an H100 (data made once under --root).

    python3 benchmarks/bench_gpu_steady.py --images 10000 --rounds 3 --out "$OUT"
    python3 benchmarks/bench_gpu_steady.py --train --out "$OUT"   # fed ResNet-18 vs synthetic
    python3 benchmarks/bench_gpu_steady.py --train --model resnet50 --only synthetic,packer,packer_cpu
    python3 benchmarks/bench_gpu_steady.py --only workers15,workers16 --out "$OUT"
    python3 benchmarks/bench_gpu_steady.py --train --graph --profile 10 --only synthetic,packer_t1
    python3 benchmarks/bench_gpu_steady.py --detection --rounds 3 --out "$OUT"   # SSDlite320
    python3 benchmarks/bench_gpu_steady.py --dry-run   # tiny, CPU, PIL for nvJPEG, no DALI
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

VARIANTS = ("dali", "dali_hw99", "packer", "packer_pinned3", "packer_plain2", "packer_cpu")
DETECTION = ("resident", "synthetic", "packer_cpu", "packer", "packer_t1")
DETECTORS = {"ssdlite": "SSDlite320", "fasterrcnn": "fasterrcnn_mobilenet_v3_large_320_fpn"}
MEAN, STD = [0.485 * 255, 0.456 * 255, 0.406 * 255], [0.229 * 255, 0.224 * 255, 0.225 * 255]


# -- the children: one variant, one window ----------------------------------------------------

def dali_batches(a, hw_load=None):
    """DALI's RN50 training pipeline (its defaults but ``hw_load``), batches forever."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def
    def rn50():
        jpegs, labels = fn.readers.file(file_root=a.src, random_shuffle=True, name="Reader")
        more = {} if hw_load is None else {"hw_decoder_load": hw_load}
        images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB, **more)
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW",
                                          crop=(224, 224), mean=MEAN, std=STD,
                                          mirror=fn.random.coin_flip())
        return images, labels.gpu()

    pipe = rn50(batch_size=a.batch, num_threads=os.cpu_count(), device_id=0)
    pipe.build()
    if not a.train:
        while True:
            images, labels = pipe.run()
            yield images, None
    from nvidia.dali.plugin.pytorch import DALIGenericIterator  # torch tensors, to train on
    it = DALIGenericIterator(pipe, ["images", "labels"], reader_name="Reader", auto_reset=True)
    while True:
        for (b,) in it:
            yield b["images"], b["labels"].view(-1).long()


def synthetic_batches(a):
    """One resident batch, forever: the model's speed with no input pipeline. Made at once,
    before a --graph step is captured (PyTorch's recipe: resident tensors first)."""
    import torch
    x = torch.randn(a.batch, 3, a.size, a.size, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, a.classes, (a.batch,), device="cuda")
    batch = x.contiguous(memory_format=torch.channels_last), y
    return (batch for _ in itertools.count())


def train_step(a):
    """An eager training step of --model (bf16 autocast, channels_last, SGD) on each batch;
    with --graph the same step captured once as one CUDA graph (PyTorch's whole-network
    recipe: static input tensors the batch is copied into, then one replay per step)."""
    import torch
    import torchvision
    model = getattr(torchvision.models, a.model)(num_classes=a.classes).cuda()
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not a.graph):
            loss = loss_fn(model(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad(set_to_none=not a.graph)
        loss.backward()
        opt.step()
    if not a.graph:
        return step
    from benchlib.gpu_common import capture_step
    x = torch.randn(a.batch, 3, a.size, a.size, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, a.classes, (a.batch,), device="cuda")
    return capture_step(step, x.contiguous(memory_format=torch.channels_last), y)


def loader_batches(source, counter):
    """``source`` pass after pass (each pass an epoch; the loader moves on by itself)."""
    while True:
        for x, y in source:
            yield x, y
        counter["epochs"] += 1


def packer_source(a, name: str):
    """The variant's iterable, and what to record from it afterwards."""
    import torch
    from packer.gpu import GPUDecoder
    from packer.loading.loader import make_loader
    from packer.loading.prefetch import CUDAPrefetcher
    from packer.reading.dataset import PackedDataset
    from packer.transforms.decode import DecodeRandomResizedCrop
    cuda = not a.dry_run
    if name.startswith("packer_cpu") or name.startswith("workers"):
        workers = int(name[7:]) if name.startswith("workers") else None
        ds = PackedDataset(a.packed, decode=DecodeRandomResizedCrop(a.size))
        loader = make_loader(ds, a.batch, shuffle=True, num_workers=workers, drop_last=True)
        return CUDAPrefetcher(loader, device=None if cuda else "cpu"), loader
    loader, options = gpu_settings(a, name, drop_last=True)
    g = GPUDecoder(loader, size=a.size, train=True, options=options,
                   **({} if cuda else {"device": torch.device("cpu")}))
    return g, loader


def detection_source(a, name: str, counter):
    """(endless model batches, the GPUDecoder or None, the loader, the --model step) for a
    --detection variant; synthetic's batch is the CPU path's first, resident's batches its
    first epoch (copied: the prefetcher may reuse its buffers)."""
    import torch
    from benchlib.detection import detection_step, model_batch
    from packer.gpu import GPUDecoder, reserve_cuda_queues
    from packer.loading.loader import make_loader
    from packer.loading.prefetch import CUDAPrefetcher
    from packer.reading.dataset import PackedDataset
    from packer.transforms.decode import DecodeLetterbox
    reserve_cuda_queues()  # every variant alike, before CUDA starts
    dev = torch.device("cpu") if a.dry_run else torch.device("cuda", torch.cuda.current_device())
    ds = PackedDataset(a.packed, decode=DecodeLetterbox(a.size))
    step = detection_step(dev, 1 + max(c["id"] for c in ds.categories), a.model)
    if name in ("synthetic", "resident", "packer_cpu"):
        loader = make_loader(ds, a.batch, shuffle=True, drop_last=True)
        g = CUDAPrefetcher(loader, mean=None, std=None, device=dev)
        if name == "synthetic":
            batch = model_batch(*next(iter(g)))
            return (batch for _ in itertools.count()), None, loader, step
        if name == "resident":
            held = []
            for x, y in g:
                images, targets = model_batch(x.clone(), y)
                held.append((images, [{k: v.clone() for k, v in t.items()} for t in targets]))
            return (b for b in itertools.cycle(held)), None, loader, step
        return (model_batch(*b) for b in loader_batches(g, counter)), None, loader, step
    loader, options = gpu_settings(a, name, drop_last=True)
    g = GPUDecoder(loader, size=a.size, letterbox=True, mean=None, std=None,
                   dtype=torch.float32, device=dev, options=options)
    return (model_batch(*b) for b in loader_batches(g, counter)), g, loader, step


def gpu_settings(a, name: str, **loader_options):
    """(make_gpu_loader, GPUOptions) of a packer variant's knobs; in a dry run PIL decodes."""
    from packer.gpu import GPUOptions, make_gpu_loader
    knobs = packer_knobs(name)
    if "c" in knobs:  # the decode threads' pacing: calm batches before one rests
        import packer.gpu.pipeline
        packer.gpu.pipeline.CALM = knobs["c"]
    if "s" in knobs:  # the interpreter's switch interval, in microseconds
        sys.setswitchinterval(knobs["s"] / 1e6)
    if "w" in knobs:
        loader_options["num_workers"] = knobs["w"]
    if "norel" in knobs:
        os.environ["PACKER_SHM_RELEASE"] = "0"
    if "noring" in knobs:
        os.environ["PACKER_BATCH_RING"] = "0"
    for method in ("spawn", "forkserver"):
        if method in knobs:
            loader_options["multiprocessing_context"] = method
    if "plain" in knobs or "pinned" in knobs:
        loader_options["pin_memory"] = "pinned" in knobs and not a.dry_run
    opts = {"decode_threads": knobs["t"]} if "t" in knobs else {}
    if a.dry_run:  # PIL stands in for nvJPEG, the CPU reference for the kernel
        from benchlib.gpu_common import pil_decoder
        opts["decoder"] = pil_decoder
    elif "nvic" in knobs or "nvichw" in knobs:
        import torch
        from benchlib.gpu_common import NvImageCodecDecoder
        opts["decoder"] = NvImageCodecDecoder(torch.device("cuda", torch.cuda.current_device()),
                                              hw_only="nvichw" in knobs)
    return make_gpu_loader(a.packed, a.batch, **loader_options), GPUOptions(**opts)


def packer_knobs(name: str) -> dict:
    """``packer_w8_t3_plain`` -> {"w": 8, "t": 3, "plain": 0} (the knobs: module docstring);
    the two named variants as they were: pinned3 = pinned + t3, plain2 = plain + t2."""
    knobs = {}
    for tok in name.split("_")[1:]:
        if tok in ("nvic", "nvichw", "norel", "noring", "spawn", "forkserver"):  # flags
            knobs[tok] = 0
            continue
        m = re.fullmatch(r"(w|t|s|c|plain|pinned)(\d*)", tok)
        if m is None or (m[1] in "wtsc" and not m[2]):
            raise SystemExit(f"unknown setting {tok!r} in variant {name!r}")
        if m[1] in ("plain", "pinned"):
            knobs[m[1]] = 0
            if m[2]:
                knobs["t"] = int(m[2])
        else:
            knobs[m[1]] = int(m[2])
    return knobs


def child(a) -> dict:
    """One variant in this process: warm-up, then the timed window."""
    t_start = time.perf_counter()
    import torch
    if a.dry_run:
        torch.set_num_threads(1)  # 2 OpenMP threads per process on 2 busy cores crawl
    counter, extra, g, step = {"epochs": 0}, {}, None, None
    if a.detection:
        it, g, loader, step = detection_source(a, a.variant, counter)
        extra.update(num_workers=loader.num_workers, pin_memory=bool(loader.pin_memory))
    elif a.variant.startswith("dali"):
        import nvidia.dali
        extra["dali"] = nvidia.dali.__version__
        it = dali_batches(a, 0.99 if a.variant == "dali_hw99" else None)
    elif a.variant == "synthetic":
        it = synthetic_batches(a)
    else:
        g, loader = packer_source(a, a.variant)
        extra.update(num_workers=loader.num_workers, pin_memory=bool(loader.pin_memory))
        it = loader_batches(g, counter)
    cuda = torch.cuda.is_available() and not a.dry_run
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if step is None:
        step = train_step(a) if a.train else (lambda x, y: None)

    threads, starts = [], []  # decode threads at work per batch; epochs' first batches
    stats = getattr(g, "stats", None)  # GPUDecoder's

    def take() -> int:
        e = counter["epochs"]
        x, y = next(it)
        step(x, y)
        starts.append(counter["epochs"] != e)
        if stats is not None:
            threads.append(stats.threads)
        return x.shape[0] if isinstance(x, torch.Tensor) else a.batch  # DALI's TensorList
    try:
        take()
        t_first = time.perf_counter()
        for _ in range(a.warmup - 1):
            take()
        sync()  # the window: between two synchronizes, batch arrivals timed without
        cpu0 = cpu_times()
        e0, t0, n, arrivals = counter["epochs"], time.perf_counter(), 0, []
        del starts[:], threads[:]
        for _ in range(a.batches):
            n += take()
            arrivals.append(time.perf_counter())
        sync()
        t1 = time.perf_counter()
        cpu1 = cpu_times()
        extra["cpu_in_window"] = {k: round(v - cpu0.get(k, 0), 2) for k, v in cpu1.items()}
        if a.profile:
            extra["device_ms_per_batch"] = device_time(take, sync, a.profile, cuda)
    finally:
        it.close()
    gaps = [1e3 * (b - a_) for a_, b in zip([t0] + arrivals, arrivals)]
    q = statistics.quantiles(gaps, n=10) if len(gaps) > 1 else gaps * 9
    seen = (a.warmup + a.batches) * a.batch
    boundaries = counter["epochs"] - e0 if g is not None or a.variant == "packer_cpu" else \
        seen // a.images - (a.warmup * a.batch) // a.images  # DALI's reader wraps by itself
    if stats is not None:
        extra["ms_per_batch"] = {k: round(1e3 * v / max(1, stats.batches), 2)
                                 for k, v in stats.seconds.items()}
        extra["decoded"] = {"gpu": stats.gpu, "cpu": stats.cpu, "retried": stats.retried}
        extra["backend"] = g.backend
        if threads:
            extra["decode_threads_mean"] = statistics.mean(threads)
    firsts = [d for d, s in zip(gaps, starts) if s]
    if firsts:  # the wait for an epoch's first batch (the pipelines restart there)
        extra["epoch_start_gap_ms"] = statistics.median(firsts)
    return {"variant": a.variant, "rate": n / (t1 - t0), "images": n, "seconds": t1 - t0,
            "batches": a.batches, "epoch_boundaries": boundaries,
            "gap_ms": {"p10": q[0], "p50": statistics.median(gaps), "p90": q[8], "max": max(gaps)},
            "startup_s": t_first - t_start, "warmup_s": t0 - t_first, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), **extra}


def cpu_times() -> dict:
    """CPU seconds so far of this process's threads (by name) and of its child processes
    (the loader's workers, summed), with its minor page faults and context switches: where
    the host time goes when a window is slow (Linux /proc; empty elsewhere)."""
    import threading
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                f_ = f.read().rsplit(")", 1)[1].split()
            key = names.get(tid, "other threads")
            out[key] = out.get(key, 0.0) + (int(f_[11]) + int(f_[12])) / tick
        me = str(os.getpid())
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    f_ = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if f_[1] == me:
                out["workers"] = out.get("workers", 0.0) + (int(f_[11]) + int(f_[12])) / tick
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        out.update(minflt=r.ru_minflt, nvcsw=r.ru_nvcsw, nivcsw=r.ru_nivcsw)
    except (OSError, ValueError, IndexError):
        pass
    return out


def device_time(take, sync, batches: int, cuda: bool, most: int = 16) -> dict:
    """``batches`` more batches under torch's profiler: the device time per batch of the
    kernels and copies that took the most (CUDA; the operators' own CPU time without a GPU),
    and their sum over all of them (``all``; streams that overlap add up): where a fed
    step's GPU time goes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(batches):
            take()
        sync()
    totals: dict = {}
    for e in prof.events():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if us and (not cuda or e.device_type.name == "CUDA"):
            name = e.name[:70]
            totals[name] = totals.get(name, 0.0) + us
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:most]
    return {"all": round(sum(totals.values()) / 1e3 / batches, 3),
            **{k: round(v / 1e3 / batches, 3) for k, v in top}}


# -- the parent: data, rounds, table ----------------------------------------------------------

def make_data(a) -> dict:
    """The JPEG tree (DALI's file_root) and its packed copy, made once per size under --root."""
    from packer.writing.builder import build
    root = Path(a.root) / f"{'det-' if a.detection else ''}{a.images}{'-dry' if a.dry_run else ''}"
    src, packed, done = root / "src", root / "packed", root / "src.done"
    if a.detection:
        from packer.demo.scenes import make_detection_folder
        from packer.sources import Coco
        if not done.exists():
            make_detection_folder(src, a.images, seed=0)
            done.write_text("")
        if not (packed / "manifest.json").exists():
            build(Coco(src / "images", src / "annotations.json"), packed, workers=a.cpus,
                  progress=False)
    elif not done.exists():
        t0 = time.perf_counter()
        if a.dry_run:  # tiny photos, serially: the test's few seconds
            import torch
            torch.set_num_threads(1)
            from packer.demo import load_photos, make_image, make_image_folder
            make_image_folder(src, images=0, classes=a.classes)
            photos = load_photos()
            for i in range(a.images):
                data = make_image(random.Random(i), photos, (64, 48))
                (src / f"class_{i % a.classes:02d}" / f"img_{i:05d}.jpg").write_bytes(data)
        else:
            from benchlib.gpu_decode import make_folder
            make_folder(SimpleNamespace(log=print), src, a.images, a.classes, a.cpus)
        done.write_text("")
        print(f"made {a.images} JPEGs in {time.perf_counter() - t0:.1f} s", flush=True)
    if not (packed / "manifest.json").exists():  # (detection scenes were built above)
        print(build(src, packed, workers=a.cpus, progress=False).summary(), flush=True)
    m = json.loads((packed / "manifest.json").read_text())
    a.src, a.packed = str(src), str(packed)
    return {"images": m["count"], "bytes_per_image": m["bytes"] / m["count"],
            "src": a.src, "packed": a.packed}


def dali_missing(a):
    """Why the DALI variants cannot run here, or None."""
    if a.dry_run:
        return "dry run (CPU)"
    try:
        found = importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:
        found = False
    if not found:
        return "nvidia.dali is not importable"
    import torch
    return None if torch.cuda.is_available() else "no CUDA device"


def run_child(a, name: str) -> dict:
    cmd = [sys.executable, __file__, "--variant", name, "--src", a.src, "--packed", a.packed]
    for k in ("images", "classes", "batch", "warmup", "batches", "size", "model", "profile"):
        cmd += [f"--{k}", str(getattr(a, k))]
    cmd += (["--dry-run"] if a.dry_run else []) + (["--train"] if a.train else [])
    cmd += ["--graph"] if a.graph else []
    cmd += ["--detection"] if a.detection else []
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.child_timeout)
    except subprocess.TimeoutExpired as e:
        return {"variant": name, "error": f"timed out after {a.child_timeout} s",
                "tail": str(e.stderr or "")[-2000:]}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"variant": name, "error": f"exit {p.returncode}", "tail": p.stderr[-3000:]}
    res = json.loads(lines[-1])
    res["process_s"] = time.perf_counter() - t0
    return res


def summarize(runs: dict) -> tuple:
    """Per variant: median, min, max, spread, and ratios to the baseline (dali if it ran)."""
    ok = {v: [r.get("rate") for r in rs] for v, rs in runs.items()}
    base = next((v for v in ("resident", "synthetic", "dali") if any(ok.get(v, []))),
                next((v for v in ok if any(ok[v])), None))
    summary = {}
    for v, rates in ok.items():
        good = [r for r in rates if r]
        if not good:
            continue
        med = statistics.median(good)
        s = {"median": med, "min": min(good), "max": max(good), "rounds": rates,
             "spread_pct": 100 * (max(good) - min(good)) / 2 / med,
             "gap_p50_ms": statistics.median(r["gap_ms"]["p50"] for r in runs[v] if "gap_ms" in r),
             "gap_p90_ms": statistics.median(r["gap_ms"]["p90"] for r in runs[v] if "gap_ms" in r)}
        b = ok.get(base, [])
        s["ratio_rounds"] = [x / y if x and y else None for x, y in zip(rates, b)]
        s["ratio_median"] = med / statistics.median([y for y in b if y])
        summary[v] = s
    return base, summary


def table(base: str, summary: dict) -> str:
    f = lambda x: f"{x:,.0f}" if x else "-"  # noqa: E731
    r = lambda x: f"{x:.2f}" if x else "-"  # noqa: E731
    lines = [f"| variant | median img/s | min-max | ± % | rounds | x {base} per round | "
             f"x {base} (medians) | gap p50/p90 ms |", "|---|---:|---|---:|---|---|---:|---|"]
    for v, s in summary.items():
        lines.append(f"| {v} | {f(s['median'])} | {f(s['min'])}-{f(s['max'])} | "
                     f"{s['spread_pct']:.1f} | {' / '.join(f(x) for x in s['rounds'])} | "
                     f"{' / '.join(r(x) for x in s['ratio_rounds'])} | {r(s['ratio_median'])} | "
                     f"{s['gap_p50_ms']:.1f} / {s['gap_p90_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def parent(a) -> int:
    t_all = time.perf_counter()
    wanted = a.only.split(",") if a.only else list(DETECTION if a.detection else VARIANTS)
    if a.train and not a.only:
        wanted = ["synthetic"] + wanted
    unknown = [v for v in wanted if v not in VARIANTS + ("synthetic", "resident") and not
               (v.startswith("workers") and v[7:].isdigit()) and not v.startswith("packer_")
               or a.detection and (v.startswith("dali") or v.startswith("workers"))
               or v == "resident" and not a.detection]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {VARIANTS}, workers<N>, "
                         f"packer_<knobs>")
    for v in wanted:
        if v.startswith("packer_") and v != "packer_cpu":
            packer_knobs(v)  # a typo stops here, not in every child
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"args": vars(a).copy(), "data": make_data(a), "cores": a.cpus,
               "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    why = dali_missing(a)
    results["skipped"] = {v: why for v in wanted if v.startswith("dali") and why}
    names = [v for v in wanted if v not in results["skipped"]]
    runs = {v: [] for v in names}
    results["order"], results["runs"] = [], runs
    for k in range(a.rounds):
        order = names[k % len(names):] + names[:k % len(names)]  # rotated: no fixed position
        results["order"].append(order)
        for v in order:
            res = run_child(a, v)
            runs[v].append(res)
            print(f"round {k + 1} {v}: " + (f"{res['rate']:,.0f} img/s, gaps {res['gap_ms']}"
                  if "rate" in res else res["error"] + "\n" + res["tail"]), flush=True)
            if "device_ms_per_batch" in res:
                print(f"  device ms per batch: {res['device_ms_per_batch']}", flush=True)
            base, results["summary"] = summarize(runs)
            results["baseline"], results["wall_s"] = base, time.perf_counter() - t_all
            (out / "results.json").write_text(json.dumps(results, indent=1))
    first = next((r for rs in runs.values() for r in rs if "gpu" in r), {})
    d = results["data"]
    what = (f"{DETECTORS[a.model]} step on detection scenes" if a.detection else
            f"JPEGs, {a.model} step{' (one CUDA graph)' if a.graph else ''}" if a.train else "JPEGs")
    md = (f"{first.get('gpu', '?')}, {a.cpus} cores, torch {first.get('torch', '?')}; {d['images']} "
          f"{what}, {d['bytes_per_image'] / 1024:.1f} KiB each; batch {a.batch}, {a.warmup} warm-up "
          f"+ {a.batches} timed batches per process, {a.rounds} rounds; "
          f"{time.perf_counter() - t_all:.0f} s in all\n\n")
    md += table(results["baseline"], results["summary"])
    md += "".join(f"\n{v}: skipped ({why})" for v, why in results["skipped"].items())
    (out / "results.md").write_text(md + "\n")
    print("\n" + md, flush=True)
    return 0 if all("rate" in r for rs in runs.values() for r in rs) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, help="default 10,000 (--detection: 2,000)")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch", type=int, help="default 256 (--detection: 32)")
    p.add_argument("--size", type=int, help="output side (packer's variants): default 224 "
                   "(--detection: 320)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20, help="batches before the window")
    p.add_argument("--batches", type=int, default=250, help="batches in the timed window")
    p.add_argument("--only", default="", help="comma list of variants (default: " +
                   ",".join(VARIANTS) + "); also workers<N>: the CPU path with N workers")
    p.add_argument("--root", default="/tmp/packer-gpu-steady", help="where the data is made")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-steady-out")
    p.add_argument("--cpus", type=int, default=None, help="processes making the data")
    p.add_argument("--child-timeout", type=int, default=150, help="seconds per variant run")
    p.add_argument("--dry-run", action="store_true", help="tiny and on the CPU, PIL for nvJPEG")
    p.add_argument("--model", choices=("resnet18", "resnet50", "ssdlite", "fasterrcnn"),
                   help="--train's model (default resnet18) or --detection's (default ssdlite: "
                   "SSDlite320-MobileNetV3; fasterrcnn: fasterrcnn_mobilenet_v3_large_320_fpn)")
    p.add_argument("--graph", action="store_true", help="with --train: the step captured as "
                   "one CUDA graph (no per-kernel launches from Python)")
    p.add_argument("--train", action="store_true", help="a --model eager step (bf16, "
                   "channels_last) on every batch, and a 'synthetic' variant (one resident "
                   "batch) as the baseline: how much of the model's speed each pipeline keeps")
    p.add_argument("--detection", action="store_true", help="an SSDlite320 training step on "
                   "COCO-style scenes fed by each path (see above)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="after the window, N "
                   "more batches under torch's profiler: device ms per batch by kernel "
                   "(results.json, device_ms_per_batch)")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # child mode
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--packed", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for k, usual, det in (("images", 10_000, 2_000), ("batch", 256, 32), ("size", 224, 320),
                          ("model", "resnet18", "ssdlite")):
        if getattr(a, k) is None:
            setattr(a, k, det if a.detection else usual)
    if a.variant:
        print(json.dumps(child(a)), flush=True)
        import atexit
        atexit._run_exitfuncs()  # the loaders' workers stop; then no teardown (seconds of torch)
        os._exit(0)
    if a.dry_run and a.train:
        raise SystemExit("--train needs a GPU; the dry run has none")
    if a.graph and not a.train or (a.model in ("ssdlite", "fasterrcnn")) != a.detection:
        raise SystemExit("--graph goes with --train; ssdlite and fasterrcnn with --detection, "
                         "resnet18 and resnet50 with --train")
    if a.dry_run and a.detection:  # SSDlite on 2 cores: a few steps
        a.images, a.batch, a.warmup, a.batches, a.size, a.rounds = 8, 2, 2, 12, 64, 1
    elif a.dry_run:
        a.images, a.classes, a.batch, a.warmup, a.batches, a.size = 160, 4, 16, 3, 36, 32
        a.rounds = min(a.rounds, 2)
    from packer._util.system import usable_cores
    a.cpus = a.cpus or usable_cores()
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
