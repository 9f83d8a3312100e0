"""What the GPU-decode benchmark's modules share (``benchlib.gpu``): its options
(:class:`GPUBenchArgs`), its run state (:class:`GPUBench`: results, table rows, output folder)
and the timing helpers every section uses.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import statistics
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from packer.transforms.decode import image_to_tensor, open_image
from packer.gpu import GPUDecoder, GPUOptions, make_gpu_loader

__all__ = ["GPUBench", "GPUBenchArgs", "JpgSampler", "NvImageCodecDecoder", "SECTIONS", "capture_step", "decoder_passes",
           "encoded_views", "endless", "epochs_rate", "fed_rate", "gpu_time", "median_rate",
           "new_decoder", "pil_decoder", "preload", "synthetic_batch", "sync"]

# The sections --only and --skip name ("transcoded" is a --skip name too: the max512 and
# short256 sets' decode, augment and pipeline rows).
SECTIONS = ("cpu", "parallel", "pipeline", "variants", "probe", "contention", "resnet",
            "progressive", "agreement", "beside", "diag")


@dataclass
class GPUBenchArgs:
    """The benchmark's options; ``benchmarks/bench_gpu_decode.py`` has one flag per field."""
    images: int = 8192
    classes: int = 100
    batch: int = 256
    cpus: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    loader_workers: Optional[int] = None  # workers feeding the GPU path; None: cores - 4
    epochs: int = 3      # passes per pipeline measurement
    repeats: int = 5
    preload: int = 8     # batches kept in memory for the "only" runs
    steps: int = 30
    warmup: int = 10
    root: str = "/tmp/packer-gpu-bench"
    out: str = "."
    sets: str = "stored,max512,short256"  # packed sets to measure (stored is always made)
    skip: str = ""       # comma list of SECTIONS (and "transcoded") not to run
    dry_run: bool = False  # tiny and on the CPU, PIL for nvJPEG
    only: str = ""       # comma list of SECTIONS to run, skipping the others

    def resolved(self) -> "GPUBenchArgs":
        """A copy with ``loader_workers`` filled in, and the tiny sizes of a dry run."""
        a = dataclasses.replace(self)
        if a.loader_workers is None:
            a.loader_workers = max(2, a.cpus - 4)
        if a.dry_run:
            a.images, a.classes, a.batch, a.epochs, a.repeats, a.preload = 96, 4, 16, 2, 2, 2
            a.cpus, a.loader_workers, a.steps, a.warmup = 2, 1, 2, 1
        return a

    def skipped(self) -> Set[str]:
        skip = set(filter(None, self.skip.split(",")))
        if self.only:
            skip |= set(SECTIONS) - set(self.only.split(","))
        if self.dry_run:
            skip.add("resnet")
        return skip


class GPUBench:
    """One run's state: the options, the device and decoders, ``results`` (results.json),
    ``rows`` (the results.md table) and ``out``, the folder both are written to."""

    def __init__(self, args: GPUBenchArgs):
        self.a = args
        self.skip = args.skipped()
        self.out = Path(args.out)
        self.results: dict = {}
        self.rows: List[Tuple[str, str, float, str]] = []
        self.dev = torch.device("cpu")
        self.decoders: Dict[str, Callable] = {}
        self.pil = ""  # PIL's summary line (packer doctor)

    @staticmethod
    def log(*a) -> None:
        print(*a, flush=True)

    @contextmanager
    def section(self, name: str):
        """One failing measurement must not cost the others (device time is scarce)."""
        t0 = time.perf_counter()
        self.log(f"\n== {name}")
        try:
            yield
        except Exception:
            self.log(f"!! {name} failed:\n{traceback.format_exc()}")
            self.results.setdefault("errors", []).append({"section": name,
                                                          "error": traceback.format_exc()})
        self.log(f"   ({time.perf_counter() - t0:.1f} s)")
        self.write_results()

    def write_results(self) -> str:
        """After every section: a run cut short by a time limit still leaves its rows."""
        lines = ["| step | what | images/s | note |", "|---|---|---:|---|"]
        lines += [f"| {s} | {w} | {r:,.0f} | {n} |" for s, w, r, n in self.rows]
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.md").write_text("\n".join(lines) + "\n")
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        return "\n".join(lines)

    def row(self, step: str, what: str, ips: float, note: str = "") -> None:
        self.rows.append((step, what, ips, note))
        self.log(f"   {step:<6} {what:<58} {ips:>10,.0f} img/s  {note}")


# -- timing ------------------------------------------------------------------------------------

def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def capture_step(step, sx: torch.Tensor, sy: torch.Tensor):
    """``step(sx, sy)`` captured once as one CUDA graph (PyTorch's whole-network recipe:
    warm-up on a side stream, then capture): ``replay(x, y)`` copies a batch into the static
    inputs and launches the whole step at once."""
    cur = torch.cuda.current_stream(sx.device)
    side = torch.cuda.Stream(sx.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for _ in range(3):
            step(sx, sy)
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(sx, sy)

    def replay(x: torch.Tensor, y: torch.Tensor) -> None:
        sx.copy_(x, non_blocking=True)
        sy.copy_(y, non_blocking=True)
        graph.replay()
    return replay


def median_rate(fn, images: int, repeats: int, dev: torch.device):
    """fn() processes ``images`` images; median images/s over ``repeats`` timed calls."""
    rates = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        rates.append(images / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def epoch_rate(iterable, dev: torch.device, skip: int = 2) -> float:
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


def epochs_rate(make_iter, dev: torch.device, epochs: int):
    """Median images/s over ``epochs`` passes of ``make_iter(epoch)`` (the first left out)."""
    rates = [epoch_rate(make_iter(e), dev) for e in range(epochs)]
    return statistics.median(rates[1:] if len(rates) > 1 else rates), rates


def decoder_passes(g: GPUDecoder):
    """``epoch -> g`` after ``g.set_epoch(epoch)``: for :func:`epochs_rate`."""
    def it(e):
        g.set_epoch(e)
        return g
    return it


def gpu_time(fn, dev: torch.device) -> float:
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


def fed_rate(b: GPUBench, step, source: Iterator):
    """images/s of ``step`` fed from the endless iterator ``source``, after a warm-up."""
    a = b.a
    for _ in range(a.warmup):
        step(*next(source))

    def fed():
        for _ in range(a.steps):
            step(*next(source))
    rate, rates = median_rate(fed, a.steps * a.batch, 3, b.dev)
    source.close()
    return rate, rates


# -- batches and decoders ----------------------------------------------------------------------

def preload(loader, n: int) -> list:
    """The first ``n`` batches of ``loader``, kept in memory."""
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n:
            break
    return batches


def encoded_views(batch) -> List[torch.Tensor]:
    """An ``EncodedBatch``'s JPEG byte views (the images the workers did not decode)."""
    return [v for v in batch.images() if v.dim() == 1]


def endless(g: GPUDecoder):
    """A GPUDecoder's batches over epoch after epoch."""
    e = 0
    while True:
        g.set_epoch(e)
        yield from g
        e += 1


def synthetic_batch(b: GPUBench):
    """A random bf16 channels_last batch and labels on the device: the step's own speed."""
    x = torch.randn(b.a.batch, 3, 224, 224, device=b.dev).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    return x, torch.randint(0, 1000, (b.a.batch,), device=b.dev)


def new_decoder(b: GPUBench, source, kw: dict, **more) -> GPUDecoder:
    """A GPUDecoder (seed 0) on ``source``: a loader, or a packed set's path for a fresh
    ``make_gpu_loader`` (kw["loader"]: its keyword arguments). Keys of ``kw`` and ``more``
    that are GPUOptions fields go to its ``options``, the others to GPUDecoder."""
    kw = {**kw, **more}
    loader_kw = kw.pop("loader", {})
    if isinstance(source, (str, os.PathLike)):
        source = make_gpu_loader(source, b.a.batch, **{"num_workers": b.a.loader_workers,
                                                       "drop_last": True, **loader_kw})
    fields = {f.name for f in dataclasses.fields(GPUOptions)}
    opts = GPUOptions(**{k: v for k, v in kw.items() if k in fields})
    rest = {k: v for k, v in kw.items() if k not in fields}
    return GPUDecoder(source, **{"device": b.dev, "seed": 0, **rest}, options=opts)


def pil_decoder(datas: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """PIL in nvJPEG's place (dry runs): JPEG byte tensors to (3, h, w) uint8 on ``device``."""
    return [image_to_tensor(open_image(ctypes.string_at(d.data_ptr(), d.numel()))).to(device)
            for d in datas]


class NvImageCodecDecoder:
    """nvImageCodec's batched decode (``nvidia-nvimgcodec-cu13``) as a ``GPUOptions(decoder=)``
    callable: JPEG byte tensors to planar (3, h, w) uint8 images on ``device``, ready on the
    caller's current stream. One ``nvimgcodec.Decoder`` per calling thread. ``hw_only``:
    the hardware engine then CUDA decoding (no CPU backend); else nvImageCodec's defaults.
    Raises ImportError where the package is missing; RuntimeError for an image it refuses."""

    def __init__(self, device: torch.device, hw_only: bool = False):
        from nvidia import nvimgcodec
        self.n, self.device, self.hw_only = nvimgcodec, device, hw_only
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                              color_spec=nvimgcodec.ColorSpec.SRGB,
                                              sample_format=nvimgcodec.SampleFormat.P_RGB)
        self.local = threading.local()
        self.name = "nvimgcodec-hw" if hw_only else "nvimgcodec"

    def decoder(self):
        d = getattr(self.local, "decoder", None)
        if d is None:
            n = self.n
            backends = [n.Backend(n.BackendKind.HW_GPU_ONLY), n.Backend(n.BackendKind.GPU_ONLY)] \
                if self.hw_only else None
            d = self.local.decoder = n.Decoder(device_id=self.device.index or 0, backends=backends)
        return d

    def __call__(self, datas: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
        streams = [self.n.CodeStream(d.numpy()) for d in datas]
        stream = torch.cuda.current_stream(device).cuda_stream
        images = self.decoder().decode(streams, params=self.params, cuda_stream=stream)
        if any(im is None for im in images):
            raise RuntimeError("nvImageCodec could not decode an image of the batch")
        return [torch.as_tensor(im, device=device) for im in images]


class JpgSampler:
    """NVML's JPG (nvJPG hardware engine) and NVDEC utilization, sampled in a thread."""

    def __init__(self, dev: torch.device):
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

    def summary(self) -> dict:
        def mx(k):
            v = [s[k] for s in self.samples if s[k] is not None]
            return (max(v), round(statistics.mean(v), 1)) if v else None
        return {"samples": len(self.samples), "jpg_max_mean": mx(0), "nvdec_max_mean": mx(1),
                "sm_max_mean": mx(2), "error": self.err}
