"""Probes of the GPU decode path (``benchlib.gpu``; GPU machine): what nvJPEG launches
per batch, whether libnvjpeg loads directly, nvidia-smi's utilization columns, nvJPEG's own
YUV planes, and :func:`profile_augment` (``benchmarks/profile_gpu_augment.py``).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import time
from pathlib import Path
from typing import List, Optional

import torch

from packer.gpu import GPUDecoder, GPUOptions, make_gpu_loader, reserve_cuda_queues
from packer.gpu.nvjpeg import NvjpegDecoder
from benchlib.gpu_common import GPUBench, encoded_views, preload, sync

__all__ = ["YuvDecoder", "dmon", "kernel_profile", "nvjpeg_probe", "profile_augment"]


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with nvJPEG status {status}")


class YuvDecoder:
    """NvjpegDecoder asking for the engine's own planes (NVJPEG_OUTPUT_YUV: Y, Cb, Cr at their
    subsampled sizes) instead of planar RGB: a probe of whether the colour conversion and
    chroma upsampling, not the decode, is the GPU work that waits behind training. Takes an
    NvjpegDecoder of its own (its batch setup is changed to YUV output)."""

    def __init__(self, nv: NvjpegDecoder):
        self.nv, self.n = nv, 0
        vp, ip = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
        # The header read keeps the GIL (PyDLL), as NvjpegDecoder's own does.
        self.info = ctypes.PyDLL(nv.lib._name).nvjpegGetImageInfo
        self.info.argtypes = [vp, vp, ctypes.c_size_t, ip, ip, ip, ip]
        self.image_p = nv.lib.nvjpegDecodeBatched.argtypes[4]  # nvjpegImage_t *

    def _planes(self, d: torch.Tensor):
        c, sub = ctypes.c_int(), ctypes.c_int()
        w, h = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
        _ok(self.info(self.nv.handle, d.data_ptr(), d.numel(), ctypes.byref(c), ctypes.byref(sub),
                      w, h), "nvjpegGetImageInfo")
        return [(max(1, h[k]), max(1, w[k])) for k in range(3)]

    def __call__(self, datas: List[torch.Tensor], dev: torch.device) -> torch.Tensor:
        nv, lib, n = self.nv, self.nv.lib, len(datas)
        planes = [self._planes(d) for d in datas]
        out = torch.empty(sum(hh * ww for p in planes for hh, ww in p), dtype=torch.uint8, device=dev)
        rows, off = [], out.data_ptr()
        for p in planes:  # nvjpegImage_t: 4 channel pointers, 4 pitches
            starts = [off, off + p[0][0] * p[0][1], off + p[0][0] * p[0][1] + p[1][0] * p[1][1]]
            rows.append(starts + [0] + [ww for _, ww in p] + [0])
            off += sum(hh * ww for hh, ww in p)
        table = torch.tensor(rows, dtype=torch.int64)
        ptrs = torch.tensor([d.data_ptr() for d in datas], dtype=torch.int64)
        lens = torch.tensor([d.numel() for d in datas], dtype=torch.int64)
        nv.stream.wait_stream(torch.cuda.current_stream(dev))
        if self.n != n:
            _ok(lib.nvjpegDecodeBatchedInitialize(nv.handle, nv.state, n, 1, 1), "init")
            self.n = n
        _ok(lib.nvjpegDecodeBatched(
            nv.handle, nv.state, ctypes.cast(ptrs.data_ptr(), ctypes.POINTER(ctypes.c_void_p)),
            ctypes.cast(lens.data_ptr(), ctypes.POINTER(ctypes.c_size_t)),
            ctypes.cast(table.data_ptr(), self.image_p), ctypes.c_void_p(nv.stream.cuda_stream)),
            "decode")
        nv.stream.synchronize()
        return out


def kernel_profile(b: GPUBench, loader) -> None:
    """torch.profiler (CUPTI) over one batch of 256: the kernels, copies and CUDA calls each
    decoder makes. Per-image kernels would each wait behind a training kernel."""
    from torch.profiler import ProfilerActivity, profile
    dev = b.dev
    views = encoded_views(preload(loader, 1)[0])
    decs = dict(b.decoders)
    try:
        decs["nvjpeg-yuv"] = YuvDecoder(NvjpegDecoder(dev))
    except Exception as e:
        b.log(f"   YUV decoder unavailable: {e!r}")
    for dname, decoder in decs.items():
        decoder(views, dev)
        sync(dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decoder(views, dev)
            sync(dev)
        events = [{"name": e.key[:80], "count": e.count,
                   "device_us": round(getattr(e, "device_time_total", 0.0)
                                      or getattr(e, "cuda_time_total", 0.0), 1),
                   "cpu_us": round(e.cpu_time_total, 1)} for e in prof.key_averages()]
        events.sort(key=lambda e: -e["count"])
        b.results[f"profile_{dname}"] = events[:40]
        b.log(f"   {dname}: {len(views)} images")
        for e in events[:25]:
            b.log(f"      {e['count']:>6} x {e['name']:<80} device {e['device_us']:>10} us  "
                  f"cpu {e['cpu_us']:>10} us")


def nvjpeg_probe(b: GPUBench) -> None:
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
    b.results["libnvjpeg"] = found
    b.log(f"   libnvjpeg: {found}")
    rng = getattr(torch.cuda.Stream, "priority_range", None)
    lo, hi = rng() if rng else (None, None)
    b.log(f"   CUDA stream priority range (least, greatest): {lo, hi}")


def dmon(b: GPUBench, seconds: int, out: Path) -> Optional[subprocess.Popen]:
    """nvidia-smi dmon's utilization columns (sm mem enc dec jpg ofa on recent drivers)."""
    try:
        with open(out, "w") as f:
            return subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-c", str(seconds)],
                                    stdout=f, stderr=subprocess.STDOUT)
    except OSError as e:
        b.log(f"   nvidia-smi dmon unavailable: {e}")
        return None


def profile_augment(data, batches: int = 8, batch_size: int = 256, workers: int = 8) -> int:
    """Where the GPU augment's time goes (GPU machine): torch.profiler over the batched crop
    + resize of decoded stored-size batches of the packed set ``data``: host and device time
    per op. Prints its tables; returns 0."""
    from torch.profiler import ProfilerActivity, profile
    reserve_cuda_queues()  # before any CUDA work
    loader = make_gpu_loader(data, batch_size, num_workers=workers, drop_last=True)
    g = GPUDecoder(loader, seed=0, options=GPUOptions(overlap=0))
    items = [g.decode_batch(x) for x in preload(loader, batches)]
    for _ in range(2):
        for item in items:
            g.augment_batch(item, 0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for item in items:
        g.augment_batch(item, 0)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    print(f"augment: host {1e3 * host / len(items):.2f} ms/batch, "
          f"with GPU {1e3 * total / len(items):.2f} ms/batch")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for item in items:
            g.augment_batch(item, 0)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    return 0
