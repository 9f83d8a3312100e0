#!/usr/bin/env python3
"""Benchmark packer's GPU decode path against the CPU path, in one run (GPU machine).

Makes ImageNet-like JPEGs, packs them as stored and transcoded, then measures images/s
to 224x224 for: the CPU path (Pillow in DataLoader workers on all cores), nvJPEG decode
alone, the batched augment alone, the whole GPUDecoder pipeline (inline, one thread, two
threads; train and eval), the same on transcoded data, whether the hardware JPEG engine
works (NVML's JPG utilization), ResNet-18 steps fed by the GPU path vs synthetic batches,
and pixel agreement with PIL. Prints a table; writes results.json and results.md to --out.

    python3 scripts/bench_gpu_decode.py --images 8192 --out "$OUT"
    python3 scripts/bench_gpu_decode.py --dry-run       # tiny, CPU, PIL stands in for nvJPEG
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packer.build import build  # noqa: E402
from packer.dataset import PackedDataset  # noqa: E402
from packer.demo import make_image_folder  # noqa: E402
from packer.gpu_decode import (GPUDecoder, center_crop_boxes, make_gpu_loader,  # noqa: E402
                               random_resized_crop_boxes, resample_crops)
from packer.imaging import (DecodeCenterCrop, DecodeRandomResizedCrop, Transcode,  # noqa: E402
                            pil_summary)
from packer.loader import make_loader  # noqa: E402

RESULTS: dict = {}
ROWS: list = []
OUT = Path(".")


def log(*a):
    print(*a, flush=True)


@contextmanager
def section(name):
    """One failing measurement must not cost the others (device time is scarce)."""
    t0 = time.perf_counter()
    log(f"\n== {name}")
    try:
        yield
    except Exception:
        log(f"!! {name} failed:\n{traceback.format_exc()}")
        RESULTS.setdefault("errors", []).append({"section": name, "error": traceback.format_exc()})
    log(f"   ({time.perf_counter() - t0:.1f} s)")
    write_results()


def write_results():
    """After every section: a run cut short by a time limit still leaves its rows."""
    lines = ["| step | what | images/s | note |", "|---|---|---:|---|"]
    lines += [f"| {s} | {w} | {r:,.0f} | {n} |" for s, w, r, n in ROWS]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    (OUT / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    return "\n".join(lines)


def row(step, what, ips, note=""):
    ROWS.append((step, what, ips, note))
    log(f"   {step:<6} {what:<58} {ips:>10,.0f} img/s  {note}")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_rate(fn, images, repeats, dev):
    """fn() processes ``images`` images; median images/s over ``repeats`` timed calls."""
    rates = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        rates.append(images / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def epoch_rate(iterable, dev, skip=2):
    """images/s over one pass, timed from the end of batch ``skip`` (pipelines filled)."""
    n, t0 = 0, None
    for k, (x, y) in enumerate(iterable):
        if k == skip - 1:
            sync(dev)
            t0 = time.perf_counter()
        elif k >= skip:
            n += len(y)
    sync(dev)
    return n / (time.perf_counter() - t0)


def epochs_rate(make_iter, dev, epochs):
    rates = [epoch_rate(make_iter(e), dev) for e in range(epochs)]
    return statistics.median(rates[1:] if len(rates) > 1 else rates), rates


def pil_decoder(datas, device):
    from PIL import Image
    out = []
    for d in datas:
        im = Image.open(io.BytesIO(ctypes.string_at(d.data_ptr(), d.numel()))).convert("RGB")
        t = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(im.height, im.width, 3)
        out.append(t.permute(2, 0, 1).to(device))
    return out


class JpgSampler:
    """NVML's JPG (nvJPG hardware engine) and NVDEC utilization, sampled in a thread."""

    def __init__(self, dev):
        self.samples, self.err, self._stop = [], None, threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
        except Exception as e:
            self.nv, self.err = None, repr(e)

    def __enter__(self):
        if self.nv is not None:
            self.t = threading.Thread(target=self._run, daemon=True)
            self.t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                jpg = self.nv.nvmlDeviceGetJpgUtilization(self.h)[0]
            except Exception as e:
                jpg, self.err = None, repr(e)
            try:
                dec = self.nv.nvmlDeviceGetDecoderUtilization(self.h)[0]
                sm = self.nv.nvmlDeviceGetUtilizationRates(self.h).gpu
            except Exception:
                dec = sm = None
            self.samples.append((jpg, dec, sm))
            time.sleep(0.05)

    def __exit__(self, *exc):
        self._stop.set()
        if self.nv is not None:
            self.t.join()

    def summary(self):
        def mx(k):
            v = [s[k] for s in self.samples if s[k] is not None]
            return (max(v), round(statistics.mean(v), 1)) if v else None
        return {"samples": len(self.samples), "jpg_max_mean": mx(0), "nvdec_max_mean": mx(1),
                "sm_max_mean": mx(2), "error": self.err}


# -- sections -------------------------------------------------------------------------------

def _one_thread():
    torch.set_num_threads(1)  # 16 processes x 16 OpenMP threads each would thrash


def _make(job):
    from packer.demo import _make_one
    _make_one(job)


def make_folder(root: Path, images: int, classes: int, cpus: int, seed: int = 0):
    """``make_image_folder``'s files (same names and bytes), made by a fork pool of
    single-threaded processes, with progress: the demo's spawn pool leaves torch's thread
    pool at one thread per core in every process."""
    import multiprocessing as mp
    make_image_folder(root, images=0, classes=classes)  # the class folders
    jobs = [(str(root / f"class_{i % classes:02d}" / f"img_{i:05d}.jpg"), seed, i)
            for i in range(images)]
    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(cpus, initializer=_one_thread) as pool:
        for k, _ in enumerate(pool.imap_unordered(_make, jobs, chunksize=32), 1):
            if k % 2048 == 0:
                log(f"   {k} images, {k / (time.perf_counter() - t0):.0f}/s")


def make_data(a):
    root = Path(a.root)
    src = root / "src"
    sets = {"stored": root / "stored", "max512": root / "max512", "short256": root / "short256"}
    if not (src / ".done").exists():
        t0 = time.perf_counter()
        make_folder(src, a.images, a.classes, a.cpus)
        (src / ".done").write_text("")
        log(f"   made {a.images} JPEGs in {time.perf_counter() - t0:.1f} s")
    opts = {"stored": None, "max512": Transcode(max_side=512, quality=90),
            "short256": Transcode(short_side=256, quality=90)}
    for name, dst in sets.items():
        if (dst / "manifest.json").exists():
            continue
        r = build(src, dst, workers=a.cpus, progress=False, transcode=opts[name])
        log(f"   {name}: {r.summary()}")
    info = {}
    for name, dst in sets.items():
        m = json.loads((dst / "manifest.json").read_text())
        info[name] = {"bytes_per_image": m["bytes"] / m["count"], "count": m["count"]}
    RESULTS["data"] = info
    log(f"   {info}")
    return sets


def cpu_path(a, path, dev):
    for train in (True, False):
        dec = DecodeRandomResizedCrop(224) if train else DecodeCenterCrop(224)
        loader = make_loader(PackedDataset(path, decode=dec), a.batch, num_workers=a.cpus,
                             drop_last=True, pin_memory=False)
        rate, rates = epochs_rate(lambda e, ld=loader: ld, torch.device("cpu"), a.epochs)
        mode = "train (RandomResizedCrop+flip)" if train else "eval (resize+center crop)"
        RESULTS[f"cpu_{'train' if train else 'eval'}"] = rates
        row("1", f"CPU path, Pillow in {a.cpus} workers, {mode}", rate, pil_summary().split(",")[0])
        del loader  # its workers end before the next loader's start


def preload(loader, n):
    batches = []
    for b in loader:
        batches.append(b)
        if len(batches) == n:
            break
    return batches


def decode_only(a, name, loader, dev, decoders):
    batches = preload(loader, a.preload)
    views = [[v for v in b.images() if v.dim() == 1] for b in batches]
    images = sum(len(v) for v in views)
    for dname, decoder in decoders.items():
        run = lambda: [decoder(v, dev) for v in views]  # noqa: E731
        run()
        with JpgSampler(dev) as js:
            rate, rates = median_rate(run, images, a.repeats, dev)
        RESULTS[f"decode_only_{name}_{dname}"] = {"rates": rates, "nvml": js.summary()}
        row("2" if name == "stored" else "4", f"decode only ({dname}), batches in memory [{name}]",
            rate, f"JPG engine util max/mean {js.summary()['jpg_max_mean']}")
    return batches


def decode_parallel(a, name, batches, dev, threads=(1, 2, 3)):
    """NvjpegDecoder instances (one handle each) decoding in-memory batches from several
    threads at once: does a second handle overlap one batch's host work with another's?"""
    from packer.nvjpeg import NvjpegDecoder
    views = [[v for v in b.images() if v.dim() == 1] for b in batches]
    per = sum(len(v) for v in views)
    for n in threads:
        decs = [NvjpegDecoder.shared(dev, k) for k in range(n)]

        def work(d):
            with torch.cuda.stream(torch.cuda.Stream(dev)):
                for v in views:
                    d(v, dev)

        def run():
            ts = [threading.Thread(target=work, args=(d,)) for d in decs]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        run()
        with JpgSampler(dev) as js:
            rate, rates = median_rate(run, per * n, a.repeats, dev)
        RESULTS[f"decode_parallel_{name}_{n}"] = {"rates": rates, "nvml": js.summary()}
        row("2c", f"decode only, {n} NvjpegDecoder thread(s) at once [{name}]", rate,
            f"JPG engine util max/mean {js.summary()['jpg_max_mean']}")


def pipeline_variants(a, name, path, dev, variants, train=True):
    """GPUDecoder with other settings (``decode_threads``, backend), each on a fresh loader
    (no worker state shared between rows)."""
    for label, kw in variants:
        kw = dict(kw)
        gc.collect()  # nothing of the last row left to be collected in a forked worker
        loader = make_gpu_loader(path, a.batch, **{"num_workers": a.loader_workers, "drop_last": True,
                                                   **kw.pop("loader", {})})
        g = GPUDecoder(loader, train=train, device=dev, seed=0, **kw)

        def it(e):
            g.set_epoch(e)
            return g
        with JpgSampler(dev) as js:
            rate, rates = epochs_rate(it, dev, a.epochs)
        RESULTS[f"variant_{name}_{'train' if train else 'eval'}_{label}"] = {
            "rates": rates, "stats": g.stats.as_dict(), "nvml": js.summary(), "kwargs": repr(kw)}
        per = {k: f"{1e3 * v / g.stats.batches:.1f}" for k, v in g.stats.seconds.items()}
        row("7", f"GPUDecoder {'train' if train else 'eval'}, {label} [{name}]", rate,
            f"{g.backend}; ms/batch {per}; JPG util {js.summary()['jpg_max_mean']}")


def augment_only(a, name, batches, dev, decoder):
    """The batched crop+resize+flip+normalize alone on decoded batches in memory, per method
    (and, for the fused kernel, per tile shape): images/s, and the GPU time it takes from
    the GPU per batch (kernel time summed by the profiler: what a training step beside it
    loses)."""
    from packer.gpu_resample import CONFIG, ImageTable, triton_available
    decoded = [decoder([v for v in b.images() if v.dim() == 1], dev) for b in batches[:4]]
    sizes = [torch.tensor([tuple(im.shape[-2:]) for im in d]) for d in decoded]
    tables = [ImageTable.from_images(d) for d in decoded]
    scale = torch.ones(1, 3, 1, 1, device=dev)
    shift = scale * 0
    methods = [("matmul", None)]
    if dev.type == "cuda" and triton_available():
        methods += [("triton", cfg) for cfg in ({"rows": 8, "num_warps": 4}, {"rows": 4, "num_warps": 4},
                                                  {"rows": 8, "num_warps": 2}, {"rows": 16, "num_warps": 4})]
    default = dict(CONFIG)
    for train in (True, False):
        for method, cfg in methods:
            if cfg:
                CONFIG.update(cfg)
            g = torch.Generator().manual_seed(0)

            def run():
                for imgs, tab, sz in zip(decoded, tables, sizes):
                    boxes = random_resized_crop_boxes(sz, generator=g) if train else \
                        center_crop_boxes(sz, (224, 224))
                    flips = torch.rand(len(imgs), generator=g) < 0.5 if train else None
                    out = torch.empty(len(imgs), 3, 224, 224, dtype=torch.bfloat16, device=dev,
                                      memory_format=torch.channels_last)
                    resample_crops(tab if method == "triton" else imgs, boxes, (224, 224), flips,
                                   out=out, scale=scale, shift=shift, sizes=sz, method=method)
            run()
            rate, rates = median_rate(run, sum(len(d) for d in decoded), a.repeats, dev)
            gpu_ms = gpu_time(run, dev) / len(decoded)
            CONFIG.clear()
            CONFIG.update(default)
            label = method + (f" rows={cfg['rows']} warps={cfg['num_warps']}" if cfg else "")
            RESULTS[f"augment_only_{name}_{'train' if train else 'eval'}_{label}"] = {
                "rates": rates, "gpu_ms_per_batch": gpu_ms}
            row("3a", f"crop+resize+flip+normalize only, {label}, {'train' if train else 'eval'} [{name}]",
                rate, f"GPU time {gpu_ms:.2f} ms/batch")


def gpu_time(fn, dev) -> float:
    """Milliseconds of GPU work (kernels and copies, summed by the profiler) that fn() queues."""
    if dev.type != "cuda":
        return 0.0
    from torch.profiler import ProfilerActivity, profile
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(dev)
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return total / 1e3


def pipeline_gpu_time(a, name, batches, dev, methods=("triton", "matmul")):
    """GPU time per batch of the whole GPU stage (nvJPEG + augment), by resample method: the
    share of a training step's GPU that decoding beside it takes."""
    for method in methods:
        g = GPUDecoder([], device=dev, seed=0, resample=method, backend="nvjpeg", overlap=0)
        run = lambda: [g._augment(g._decode(b), 0) for b in batches[:4]]  # noqa: E731
        run()
        ms = gpu_time(run, dev) / 4
        RESULTS[f"gpu_time_{name}_{method}"] = ms
        row("3g", f"GPU time of decode+augment per batch of {a.batch}, {method} [{name}]",
            1e3 * a.batch / ms, f"{ms:.2f} ms/batch of GPU work (images/s if alone on the GPU)")


def pipeline(a, name, loader, dev, decoder, overlaps=(0, 1, 2), modes=(True, False), dname=""):
    pinned = getattr(loader, "pin_memory", False)
    for train in modes:
        for overlap in overlaps:
            g = GPUDecoder(loader, train=train, overlap=overlap, device=dev, decoder=decoder, seed=0)

            def it(e):
                g.set_epoch(e)
                return g
            with JpgSampler(dev) as js:
                rate, rates = epochs_rate(it, dev, a.epochs)
            key = f"pipeline_{name}_{'train' if train else 'eval'}_overlap{overlap}_pin{int(pinned)}_{dname}"
            RESULTS[key] = {"rates": rates, "stats": g.stats.as_dict(), "nvml": js.summary()}
            what = {0: "inline", 1: "1 thread", 2: "2 threads+streams"}[overlap]
            what += (", loader pinned" if pinned else "") + (f", {dname}" if dname else "")
            per = {k: f"{1e3 * v / g.stats.batches:.1f}" for k, v in g.stats.seconds.items()}
            row("3" if name == "stored" else "4",
                f"GPUDecoder {'train' if train else 'eval'}, {what} [{name}]", rate,
                f"ms/batch {per}; JPG util max/mean {js.summary()['jpg_max_mean']}")


def progressive_vs_baseline(a, path, dev, decoder):
    """torchvision decodes baseline JPEGs in one batched call (hardware engine where there is
    one) and others one by one, Huffman on the CPU: the gap shows which path ran."""
    from PIL import Image
    ds = PackedDataset(path)
    base, prog = [], []
    for i in range(min(a.batch, len(ds))):
        data = ds.load(i)["image"]
        im = Image.open(io.BytesIO(data))
        out = io.BytesIO()
        im.save(out, "JPEG", quality=90, progressive=True)
        base.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        prog.append(torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8))
    ds.reader.close()
    for name, batch in (("baseline", base), ("progressive", prog)):
        decoder(batch, dev)
        rate, rates = median_rate(lambda: decoder(batch, dev), len(batch), a.repeats, dev)
        RESULTS[f"torchvision_{name}"] = rates
        row("5", f"decode_jpeg batch of {len(batch)} {name} JPEGs (1 call)", rate)


class YuvDecoder:
    """NvjpegDecoder asking for the engine's own planes (NVJPEG_OUTPUT_YUV: Y, Cb, Cr at their
    subsampled sizes) instead of planar RGB: a probe of whether the colour conversion and
    chroma upsampling, not the decode, is the GPU work that waits behind training."""

    def __init__(self, nv):
        self.nv, self.n = nv, 0

    def __call__(self, datas, dev):
        nv, lib = self.nv, self.nv.lib
        n, planes = len(datas), []
        for d in datas:
            c, sub = ctypes.c_int(), ctypes.c_int()
            w, h = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
            nv._info(nv.handle, d.data_ptr(), d.numel(), ctypes.byref(c),
                                   ctypes.byref(sub), w, h)
            planes.append([(max(1, h[k]), max(1, w[k])) for k in range(3)])
        total = sum(hh * ww for p in planes for hh, ww in p)
        out = torch.empty(total, dtype=torch.uint8, device=dev)
        from packer.nvjpeg import _check, _Image
        images, off = (_Image * n)(), out.data_ptr()
        for i, p in enumerate(planes):
            for k, (hh, ww) in enumerate(p):
                images[i].channel[k], images[i].pitch[k] = off, ww
                off += hh * ww
        ptrs = (ctypes.c_void_p * n)(*[d.data_ptr() for d in datas])
        lens = (ctypes.c_size_t * n)(*[d.numel() for d in datas])
        nv.stream.wait_stream(torch.cuda.current_stream(dev))
        if self.n != n:
            _check(lib.nvjpegDecodeBatchedInitialize(nv.handle, nv.state, n, 1, 1), "init")
            self.n = n
        _check(lib.nvjpegDecodeBatched(nv.handle, nv.state, ptrs, lens, images,
                                       ctypes.c_void_p(nv.stream.cuda_stream)), "decode")
        nv.stream.synchronize()
        return out


def kernel_profile(a, loader, dev, decoders):
    """torch.profiler (CUPTI) over one batch of 256: the kernels, copies and CUDA calls each
    decoder makes. Per-image kernels would each wait behind a training kernel."""
    from packer.nvjpeg import NvjpegDecoder
    from torch.profiler import ProfilerActivity, profile
    views = [v for v in preload(loader, 1)[0].images() if v.dim() == 1]
    decs = dict(decoders)
    try:
        decs["nvjpeg-yuv"] = YuvDecoder(NvjpegDecoder(dev))
    except Exception as e:
        log(f"   YUV decoder unavailable: {e!r}")
    for dname, decoder in decs.items():
        decoder(views, dev)
        sync(dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decoder(views, dev)
            sync(dev)
        events = [{"name": e.key[:80], "count": e.count,
                   "device_us": round(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0), 1),
                   "cpu_us": round(e.cpu_time_total, 1)} for e in prof.key_averages()]
        events.sort(key=lambda e: -e["count"])
        RESULTS[f"profile_{dname}"] = events[:40]
        log(f"   {dname}: {len(views)} images")
        for e in events[:25]:
            log(f"      {e['count']:>6} x {e['name']:<80} device {e['device_us']:>10} us  cpu {e['cpu_us']:>10} us")


def contention(a, loader, dev, decoders):
    """Why decoding slows while a model trains: nvJPEG on in-memory batches in a thread,
    with the main thread idle, running large matmuls (GPU busy, Python idle), or training
    ResNet-18 (GPU and Python busy), also with a shorter GIL switch interval."""
    import torch.nn.functional as F
    import torchvision
    views = [[v for v in b.images() if v.dim() == 1] for b in preload(loader, a.preload)]
    per = sum(len(v) for v in views)
    model = torchvision.models.resnet18(num_classes=1000).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(a.batch, 3, 224, 224, device=dev).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device=dev)
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def train():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

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
    for (name, work), (dname, decoder) in ((x, d) for d in decoders.items() for x in loads.items()):
        for switch in (sys.getswitchinterval(),):
            old = sys.getswitchinterval()
            sys.setswitchinterval(switch)
            done, stop, steps = [], threading.Event(), [0]

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
            while time.perf_counter() - t0 < 3:
                work()
                steps[0] += 1
            sync(dev)
            busy = time.perf_counter() - t0
            stop.set()
            th.join()
            sys.setswitchinterval(old)
            rate = sum(done[:-1]) / done[-1]
            note = f"main: {steps[0] / busy:.1f} {name} steps/s; GIL switch {switch * 1e3:g} ms"
            RESULTS[f"contention_{dname}_{name}"] = {"decode_rate": rate, "main_steps_s": steps[0] / busy}
            row("2b", f"decode ({dname}) in a thread, main thread: {name}", rate, note)


def nvjpeg_probe():
    """Can libnvjpeg be called directly (ctypes), e.g. to decode on a high-priority stream?"""
    import ctypes.util
    import glob
    import site
    roots = site.getsitepackages() + [os.path.dirname(os.path.dirname(torch.__file__))]
    cands = sorted({p for r in roots for p in glob.glob(os.path.join(r, "**", "libnvjpeg*.so*"),
                                                           recursive=True)})
    cands += [c for c in (ctypes.util.find_library("nvjpeg"),) if c]
    found = {}
    for c in cands:
        try:
            lib = ctypes.CDLL(c)
            v = [ctypes.c_int(), ctypes.c_int(), ctypes.c_int()]
            for k in range(3):
                lib.nvjpegGetProperty(k, ctypes.byref(v[k]))
            found[c] = ".".join(str(x.value) for x in v)
        except OSError as e:
            found[c] = f"not loadable: {e}"
    RESULTS["libnvjpeg"] = found
    log(f"   libnvjpeg: {found}")
    rng = getattr(torch.cuda.Stream, "priority_range", None)
    lo, hi = rng() if rng else (None, None)
    log(f"   CUDA stream priority range (least, greatest): {lo, hi}")


def dmon(seconds, out):
    """nvidia-smi dmon's utilization columns (sm mem enc dec jpg ofa on recent drivers)."""
    try:
        return subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-c", str(seconds)],
                                stdout=open(out, "w"), stderr=subprocess.STDOUT)
    except OSError as e:
        log(f"   nvidia-smi dmon unavailable: {e}")
        return None


def resnet(a, dev, name, cpu_loader=None, variants=(), path=None):
    """ResNet-18 training steps fed by GPUDecoder (one fresh loader per row), against the
    same step on a batch already on the GPU; eager, and captured as one CUDA graph (the
    training thread then needs no CPU: what remains is the pipeline)."""
    step = eager_step(dev)
    x = torch.randn(a.batch, 3, 224, 224, device=dev).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device=dev)
    for _ in range(a.warmup):
        step(x, y)
    syn, syn_all = median_rate(lambda: [step(x, y) for _ in range(a.steps)], a.steps * a.batch, 3, dev)
    RESULTS[f"resnet18_{name}"] = {"synthetic": syn_all}
    row("6", "ResNet-18 step (bf16, channels_last, SGD) on a synthetic on-GPU batch", syn)
    graph = None
    for label, kw in variants:
        kw = dict(kw)
        graphed = kw.pop("graphed", False)
        if graphed and graph is None:  # the whole step as one CUDA graph
            graph = graphed_step(a, dev, x, y)
            graph_syn, _ = median_rate(lambda: [graph(x, y) for _ in range(a.steps)],
                                       a.steps * a.batch, 3, dev)
            row("6", "ResNet-18 step as one CUDA graph, synthetic on-GPU batch", graph_syn)
        run_step, base = (graph, graph_syn) if graphed else (step, syn)
        gc.collect()  # nothing of the last row left to be collected in a forked worker
        loader = make_gpu_loader(path, a.batch, **{"num_workers": a.loader_workers, "drop_last": True,
                                                   **kw.pop("loader", {})})
        g = GPUDecoder(loader, device=dev, seed=0, **kw)
        real, real_all = fed_rate(a, dev, run_step, endless(g))
        RESULTS[f"resnet18_{name}"][label] = {"rates": real_all, "ratio": real / base,
                                              "stats": g.stats.as_dict(), "backend": g.backend}
        log(f"   pipeline stats while training ({label}): {g.stats.as_dict()}")
        wait, throttle = (1e3 * g.stats.seconds.get(k, 0) / max(1, g.stats.batches)
                          for k in ("consumer", "throttle"))
        row("6", f"ResNet-18 fed by GPUDecoder, {label} [{name}]", real,
            f"{real / base:.1%} of synthetic{' (graphed)' if graphed else ''}; waited for batches "
            f"{wait:.1f}, for its own GPU work {throttle:.1f} ms/batch")
    if cpu_loader is not None:  # the CPU path into the same step, for comparison
        from packer.prefetch import CUDAPrefetcher
        pf = CUDAPrefetcher(cpu_loader, device=dev, dtype=torch.bfloat16)

        def cpu_batches():
            while True:
                yield from pf
        cpu, cpu_all = fed_rate(a, dev, step, cpu_batches())
        RESULTS[f"resnet18_{name}"]["cpu_path"] = {"rates": cpu_all, "ratio": cpu / syn}
        row("6", f"ResNet-18 step fed by the CPU path ({a.cpus} workers + CUDAPrefetcher) [{name}]",
            cpu, f"{cpu / syn:.1%} of synthetic")


def beside(a, path, dev):
    """What the GPU stage costs a training step that shares the GPU: the step (ResNet-18,
    captured as one CUDA graph, so the training thread needs no CPU) runs on synthetic
    batches while a thread runs one part of the GPU stage flat out; both rates are measured
    over the same seconds. The step's loss is the GPU time that part takes from it."""
    from packer.nvjpeg import NvjpegDecoder
    x = torch.randn(a.batch, 3, 224, 224, device=dev).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device=dev)
    step = graphed_step(a, dev, x, y)
    steps = 4 * a.steps

    def train_rate():  # synced every step: a loop that runs ahead fills the driver's launch
        for _ in range(5):  # queue and blocks the other threads' CUDA calls (GPUDecoder's
            step(x, y)      # max_ahead exists for that)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(x, y)
            sync(dev)
        return steps * a.batch / (time.perf_counter() - t0)
    alone = statistics.median(train_rate() for _ in range(3))
    row("8", "ResNet-18 step as one CUDA graph, synthetic batch, nothing beside it", alone)
    loader = make_gpu_loader(path, a.batch, num_workers=a.loader_workers, drop_last=True)
    batches = preload(loader, a.preload)
    nv = NvjpegDecoder.shared(dev, 7)
    yuv = YuvDecoder(NvjpegDecoder.shared(dev, 8))
    g = GPUDecoder([], device=dev, seed=0, backend="nvjpeg", overlap=0)
    decoded = [g._decode(b) for b in batches]

    def loop(fn, items, count):
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
    count = [0]
    parts = {
        "nvJPEG decode (RGB, decode_flat)": loop(lambda b: len(nv.decode_flat(b.data, b.offsets, dev)[1]),
                                                 batches, count),
        "nvJPEG decode (YUV planes)": loop(lambda b: (yuv([v for v in b.images()], dev), len(b.labels))[1],
                                           batches, count),
        "fused augment (triton)": loop(lambda it: len(g._augment(it, 0)[1]), decoded, count),
        "matmul augment": loop(lambda it: len(GPUDecoder._augment(_with(g, "matmul"), (it[0].views(), *it[1:]), 0)[1]),
                               decoded, count),
    }
    for label, kw, lkw in (("default settings", {}, {}), ("loader pinned", {}, {"pin_memory": True}),
                           ("resample matmul", {"resample": "matmul"}, {})):
        parts[f"whole GPUDecoder, {label}"] = pipeline_loop(a, path, dev, kw, lkw, count)

    def loader_only(stop):  # make_gpu_loader's DataLoader (unpinned) and nothing else
        ld = make_gpu_loader(path, a.batch, num_workers=a.loader_workers, drop_last=True)
        while not stop.is_set():
            for b in ld:
                count[0] += len(b.labels)
                if stop.is_set():
                    break
    parts["DataLoader alone (make_gpu_loader, unpinned)"] = loader_only
    for label, run in parts.items():
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
        RESULTS[f"beside_{label}"] = {"train": rate, "train_alone": alone, "side_rate": side}
        row("8", f"ResNet-18 graphed step beside: {label}", rate,
            f"{rate / alone:.1%} of alone; beside it {side:,.0f} images/s")


def eager_step(dev):
    """The ResNet-18 training step (bf16 autocast, channels_last, SGD), eager."""
    import torch.nn.functional as F
    import torchvision
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet18(num_classes=1000).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def fed_diagnostics(a, name, path, dev, variants, graphed=True):
    """The fed loop under settings that move one part each, with where each stage's time
    went; the step eager or captured as one CUDA graph (no training-side host work).
    Variants are (label, GPUDecoder kwargs, make_gpu_loader kwargs)."""
    x = torch.randn(a.batch, 3, 224, 224, device=dev).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device=dev)
    step = graphed_step(a, dev, x, y) if graphed else eager_step(dev)
    for _ in range(a.warmup):
        step(x, y)
    how = "as one CUDA graph" if graphed else "eager"
    base, _ = median_rate(lambda: [step(x, y) for _ in range(a.steps)], a.steps * a.batch, 3, dev)
    row("9", f"ResNet-18 step {how}, synthetic on-GPU batch", base)
    for label, kw, lkw in variants:
        gc.collect()  # nothing of the last row left to be collected in a forked worker
        g = GPUDecoder(make_gpu_loader(path, a.batch, **{"num_workers": a.loader_workers,
                                                         "drop_last": True, **lkw}),
                       device=dev, seed=0, **kw)
        torch.cuda.reset_peak_memory_stats(dev)
        real, real_all = fed_rate(a, dev, step, endless(g))
        peak = torch.cuda.max_memory_allocated(dev) / 2**30
        per = {k: round(1e3 * v / max(1, g.stats.batches), 1) for k, v in g.stats.seconds.items()}
        RESULTS.setdefault(f"fed_{name}_{how}_{label}", []).append(
            {"rates": real_all, "ratio": real / base, "ms_per_batch": per, "peak_gib": peak})
        row("9", f"ResNet-18 {how}, fed by GPUDecoder: {label} [{name}]", real,
            f"{real / base:.1%}; peak {peak:.1f} GiB; ms/batch {per}")


def endless(g):
    """A GPUDecoder's batches over epoch after epoch."""
    e = 0
    while True:
        g.set_epoch(e)
        yield from g
        e += 1


def _with(g, resample):
    h = __import__("copy").copy(g)
    h.resample = resample
    return h


def pipeline_loop(a, path, dev, kw, lkw, count):
    def run(stop):
        g = GPUDecoder(make_gpu_loader(path, a.batch, **{"num_workers": a.loader_workers,
                                                         "drop_last": True, **lkw}),
                       device=dev, seed=0, max_ahead=None, **kw)
        e = 0
        while not stop.is_set():
            g.set_epoch(e)
            for _, y in g:
                count[0] += len(y)
                if stop.is_set():
                    break
            e += 1
    return run


def fed_rate(a, dev, step, source):
    """images/s of ``step`` fed from the endless iterator ``source``, after a warm-up."""
    for _ in range(a.warmup):
        step(*next(source))

    def fed():
        for _ in range(a.steps):
            step(*next(source))
    rate, rates = median_rate(fed, a.steps * a.batch, 3, dev)
    source.close()
    return rate, rates


def graphed_step(a, dev, x, y):
    """A ResNet-18 training step (forward, backward, SGD) captured whole as one CUDA graph
    (PyTorch's whole-network capture recipe): the training thread then launches one graph per
    step instead of ~hundreds of kernels, leaving the GIL and the CPU to the decode threads."""
    import torch.nn.functional as F
    import torchvision
    model = torchvision.models.resnet18(num_classes=1000).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sx, sy = x.clone(), y.clone()

    def body():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = F.cross_entropy(model(sx), sy)
        loss.backward()
        opt.step()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(5):
            body()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()

    def step(xb, yb):
        sx.copy_(xb, non_blocking=True)
        sy.copy_(yb, non_blocking=True)
        graph.replay()
    return step


def agreement(a, path, dev, decoders):
    """nvJPEG pixels vs PIL's full decode; eval output vs the CPU decoders; labels."""
    from PIL import Image
    ds = PackedDataset(path)
    n = min(a.batch, len(ds))
    datas = [ds.load(i)["image"] for i in range(n)]
    refs = []
    for data in datas:
        im = Image.open(io.BytesIO(data)).convert("RGB")
        refs.append(torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(im.height, im.width, 3))
    dec = {}
    for dname, decoder in decoders.items():
        out = decoder([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas], dev)
        diffs = [(o.cpu().permute(1, 2, 0).int() - r.int()).abs() for o, r in zip(out, refs)]
        dec[dname] = {"max_abs": max(int(d.max()) for d in diffs), "images": n,
                      "mean_abs": statistics.mean(float(d.float().mean()) for d in diffs)}
    decoder = next(iter(decoders.values()))
    # Eval pipeline (uint8) vs DecodeCenterCrop (draft decode) and vs PIL full decode + same box.
    loader = make_gpu_loader(ds, 64, shuffle=False, num_workers=0)
    g = GPUDecoder(loader, train=False, dtype=torch.uint8, device=dev, decoder=decoder, overlap=0)
    labels, d_draft, d_full, k = [], [], [], 0
    ref_dec = DecodeCenterCrop(224)
    for x, y in g:
        labels += y.tolist()
        if k < n:
            for j in range(min(len(y), n - k)):
                data = ds.load(k + j)["image"]
                d_draft.append((x[j].cpu().int() - ref_dec(data).int()).abs())
                im = Image.open(io.BytesIO(data)).convert("RGB")
                box = ref_dec.box(*im.size)
                r = im.resize((224, 224), Image.BILINEAR, box=box, reducing_gap=None)
                rt = torch.frombuffer(bytearray(r.tobytes()), dtype=torch.uint8).view(224, 224, 3)
                d_full.append((x[j].cpu().int() - rt.permute(2, 0, 1).int()).abs())
            k += len(y)
    cat = lambda ds_: torch.stack(ds_)  # noqa: E731
    res = {"decoder_vs_pil_full_decode": dec,
           "eval_vs_pil_full_decode_same_resize": {"max_abs": int(cat(d_full).max()),
                                                   "mean_abs": float(cat(d_full).float().mean())},
           "eval_vs_DecodeCenterCrop_draft": {"max_abs": int(cat(d_draft).max()),
                                              "mean_abs": float(cat(d_draft).float().mean())},
           "labels_match": labels == ds.targets, "stats": g.stats.as_dict()}
    RESULTS["agreement"] = res
    log(f"   {json.dumps(res)}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--cpus", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--loader-workers", type=int, default=None,
                   help="workers feeding the GPU path (default: cores - 4)")
    p.add_argument("--epochs", type=int, default=3, help="passes per pipeline measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--preload", type=int, default=8, help="batches kept in memory for 'only' runs")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--root", default="/tmp/packer-gpu-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sets", default="stored,max512,short256",
                   help="packed sets to measure (stored is always made)")
    p.add_argument("--skip", default="",
                   help="comma list of: cpu,pipeline,transcoded,contention,resnet,agreement,beside,diag")
    p.add_argument("--dry-run", action="store_true", help="tiny and on the CPU, PIL for nvJPEG")
    p.add_argument("--only", default="", help="comma list of sections to run (as --skip names), "
                   "skipping the others: cpu,parallel,pipeline,variants,probe,contention,resnet,"
                   "progressive,agreement,beside,diag")
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if a.only:
        every = {"cpu", "parallel", "pipeline", "variants", "probe", "contention", "resnet",
                 "progressive", "agreement", "beside", "diag"}
        skip |= every - set(a.only.split(","))
    if a.loader_workers is None:
        a.loader_workers = max(2, a.cpus - 4)
    if a.dry_run:
        a.images, a.classes, a.batch, a.epochs, a.repeats, a.preload = 96, 4, 16, 2, 2, 2
        a.cpus, a.loader_workers, a.steps, a.warmup = 2, 1, 2, 1
        skip.add("resnet")
    global OUT
    out = OUT = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with section("data"):  # before CUDA starts: the pools fork
        sets = make_data(a)
    if a.dry_run:
        dev, decoders = torch.device("cpu"), {"pil": pil_decoder}
    else:
        from packer.nvjpeg import NvjpegDecoder, _nvjpeg
        dev = torch.device("cuda", torch.cuda.current_device())
        decoders = {"torchvision": _nvjpeg}  # GPUDecoder's default where installed
        try:
            if os.environ.get("PACKER_BENCH_NO_NVJPEG"):
                raise RuntimeError("PACKER_BENCH_NO_NVJPEG is set")
            nv = NvjpegDecoder(dev)
            decoders[f"nvjpeg-{nv.backend}"] = nv
        except Exception as e:
            log(f"   NvjpegDecoder unavailable: {e!r}")
    (dname, decoder), = list(decoders.items())[:1]
    log(f"   decoders: {list(decoders)}; GPUDecoder runs use {dname}")
    env = {"torch": torch.__version__, "pil": pil_summary(), "cpus": a.cpus, "args": vars(a),
           "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    try:
        import torchvision
        env["torchvision"] = torchvision.__version__
    except ImportError:
        env["torchvision"] = None
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
    RESULTS["env"] = env
    log(json.dumps(env))

    # Loaders first: their workers fork before this process opens any shard (py-lmdb refuses
    # to open a file a forked parent still has open).
    loaders = {n: make_gpu_loader(sets[n], a.batch, num_workers=a.loader_workers, drop_last=True)
               for n in sets}
    pinned = make_gpu_loader(sets["stored"], a.batch, num_workers=a.loader_workers,
                             drop_last=True, pin_memory=True)
    cpu_loaders = {n: make_loader(PackedDataset(sets[n], decode=DecodeRandomResizedCrop(224)),
                                  a.batch, num_workers=a.cpus, drop_last=True)
                   for n in ("stored", "short256")}
    if "cpu" not in skip:
        with section("1: CPU path"):
            cpu_path(a, sets["stored"], dev)
    for name in ("stored", "max512", "short256"):
        if name != "stored" and ("transcoded" in skip or name not in a.sets.split(",")):
            continue
        with section(f"2/4: decode only [{name}]"):
            mon = dmon(8, out / f"dmon_{name}.txt") if dev.type == "cuda" and name == "stored" else None
            batches = decode_only(a, name, loaders[name], dev, decoders)
            if mon is not None:
                mon.wait(timeout=20)
                RESULTS["dmon_stored"] = (out / "dmon_stored.txt").read_text()
                log(RESULTS["dmon_stored"])
        if dev.type == "cuda" and "parallel" not in skip:
            with section(f"2c: parallel decoders [{name}]"):
                decode_parallel(a, name, batches, dev)
        with section(f"3a: augment only [{name}]"):
            augment_only(a, name, batches, dev, decoder)
        if dev.type == "cuda":
            with section(f"3g: GPU time per batch [{name}]"):
                pipeline_gpu_time(a, name, batches, dev)
        del batches
        if "pipeline" not in skip:
            with section(f"3/4: pipeline [{name}]"):
                pipeline(a, name, loaders[name], dev, decoder,
                         overlaps=(0, 1, 2) if name == "stored" else (2,))
                if name == "stored":  # the pin thread's and the decoder's contributions
                    pipeline(a, name, pinned, dev, decoder, overlaps=(2,), modes=(True,))
                    for other, dec in list(decoders.items())[1:]:
                        pipeline(a, name, loaders[name], dev, dec, overlaps=(2,), dname=other)
    if "variants" not in skip:
        with section("7: decode threads [stored]"):
            variants = [(f"{dname}, 1 decode thread", {"decoder": decoder, "decode_threads": 1})]
            pinned = {"loader": {"pin_memory": True}}
            if dev.type == "cuda":
                variants += [(f"decode_threads={k}", {"decode_threads": k}) for k in (1, 3)]
                variants += [("augment thread", {"augment_thread": True}),
                             ("resample matmul (padded groups, augment thread)", {"resample": "matmul"}),
                             ("loader pinned, decode_threads=3", {**pinned, "decode_threads": 3}),
                             ("loader pinned", pinned),
                             ("default settings", {})]
            pipeline_variants(a, "stored", sets["stored"], dev, variants)
            pipeline_variants(a, "stored", sets["stored"], dev, variants[-2:], train=False)
            if dev.type == "cuda" and "short256" in sets:
                pipeline_variants(a, "short256", sets["short256"], dev, variants[-2:])
                pipeline_variants(a, "short256", sets["short256"], dev, variants[-1:], train=False)
    if "probe" not in skip and dev.type == "cuda":
        with section("probe: what nvJPEG launches per batch"):
            kernel_profile(a, loaders["stored"], dev, decoders)
    if "contention" not in skip and dev.type == "cuda":
        with section("2b: decode under load"):
            more = {}
            if os.environ.get("PACKER_BENCH_YUV"):  # the probe: planes instead of RGB
                more["nvjpeg-yuv"] = YuvDecoder(NvjpegDecoder(dev))
            contention(a, loaders["stored"], dev, {**decoders, **more})
    if "beside" not in skip and dev.type == "cuda":
        with section("8: what the GPU stage costs a training step beside it [stored]"):
            beside(a, sets["stored"], dev)
    if "diag" not in skip and dev.type == "cuda":
        how = [("default settings", {}, {}), ("loader pinned", {}, {"pin_memory": True}),
               ("augment thread", {"augment_thread": True}, {}), ("max_ahead=1", {"max_ahead": 1}, {})]
        for graphed in (True, False):
            with section(f"9: the fed loop, {'graphed' if graphed else 'eager'} [stored]"):
                fed_diagnostics(a, "stored", sets["stored"], dev, how * 2, graphed)
    if "resnet" not in skip:
        for name in ("stored", "short256"):
            with section(f"6: ResNet-18 [{name}]"):
                variants = [("default settings", {})]
                if dev.type == "cuda":
                    more = [("loader pinned", {"loader": {"pin_memory": True}}),
                            ("resample matmul", {"resample": "matmul"})] if name == "stored" else []
                    variants += more
                    variants += [(f"{label}, step as one CUDA graph", {**kw, "graphed": True})
                                 for label, kw in variants]
                resnet(a, dev, name, cpu_loaders.get(name), variants, sets[name])
    if dev.type == "cuda":
        with section("probe: libnvjpeg"):
            nvjpeg_probe()
    if "progressive" not in skip:
      with section("5: baseline vs progressive through torchvision"):
          progressive_vs_baseline(a, sets["stored"], dev, decoders.get("torchvision", decoder))
    if "agreement" not in skip:
        with section("correctness"):
            agreement(a, sets["stored"], dev, decoders)

    log("\n" + write_results())
    if "agreement" in RESULTS:
        log(json.dumps(RESULTS["agreement"]))


if __name__ == "__main__":
    main()
