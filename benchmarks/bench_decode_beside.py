#!/usr/bin/env python3
"""What nvJPEG's batched decode alone costs a training step beside it, by output format:
planar RGB (packer's; nvJPEG turns its hardware engine's output into RGB with a kernel on
the SMs), YUV planes (the engine's planes copied out by 2-D copies; the conversion would
move into packer's crop kernel) and interleaved RGB. No crop kernel, no loader: the upper
bound a fed step can keep.

Makes --images photo-like JPEGs (~500x375, from packer's shipped photos) in memory, then:
1. each format decoding batches of --batch alone (wall ms a batch, one thread);
2. an eager ResNet-18 step (bf16 autocast, channels_last, SGD) on one resident batch, alone
   and while 1-3 threads decode with each format, one decoded batch taken per step (queue
   of 3), --steps steps after 10, --rounds rounds. Needs CUDA, torchvision and libnvjpeg.

    python3 benchmarks/bench_decode_beside.py --rounds 3
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import threading
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # as make_gpu_loader sets it
import torch  # noqa: E402

FORMATS = {"rgb": 3, "yuv": 1, "rgbi": 5}  # nvjpegOutputFormat_t


class Image(ctypes.Structure):  # nvjpegImage_t
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


class Decoder:
    """One nvJPEG handle (hardware backend), state and stream: batches of a flat buffer."""

    def __init__(self, jpegs):
        from packer.gpu.nvjpeg import load_nvjpeg
        self.lib = lib = load_nvjpeg()
        self.handle, self.state, self.ready = ctypes.c_void_p(), ctypes.c_void_p(), None
        for status in (lib.nvjpegCreateEx(3, None, None, 0, ctypes.byref(self.handle)),
                       lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state))):
            if status:
                raise SystemExit(f"nvJPEG hardware backend unavailable (status {status})")
        self.stream = torch.cuda.Stream()
        self.flat = torch.frombuffer(bytearray(b"".join(jpegs)), dtype=torch.uint8).pin_memory()
        self.offsets = torch.tensor([0] + [len(j) for j in jpegs]).cumsum(0)

    def info(self, ptr: int, n: int):
        w, h, sub, comps = (ctypes.c_int * 4)(), (ctypes.c_int * 4)(), ctypes.c_int(), ctypes.c_int()
        self.lib.nvjpegGetImageInfo(self.handle, ctypes.c_void_p(ptr), ctypes.c_size_t(n),
                                    ctypes.byref(comps), ctypes.byref(sub), w, h)
        return h[0], w[0], h[1], w[1]

    def decode(self, fmt: int, lo: int, hi: int) -> torch.Tensor:
        ptrs = self.offsets[lo:hi] + self.flat.data_ptr()
        lens = (self.offsets[lo + 1:hi + 1] - self.offsets[lo:hi]).contiguous()
        h, w, ch, cw = torch.tensor([self.info(p, k) for p, k in
                                     zip(ptrs.tolist(), lens.tolist())]).unbind(1)
        if fmt == 1:  # Y, then U and V at their subsampled size
            planes, pitch = [h * w, ch * cw, ch * cw], [w, cw, cw]
        elif fmt == 5:  # one interleaved plane
            planes, pitch = [3 * h * w, 0 * h, 0 * h], [3 * w, 0 * w, 0 * w]
        else:
            planes, pitch = [h * w] * 3, [w, w, w]
        size = planes[0] + planes[1] + planes[2]
        ends = torch.cumsum(size, 0)
        out = torch.empty(int(ends[-1]), dtype=torch.uint8, device="cuda")
        c0, zero = out.data_ptr() + ends - size, torch.zeros_like(ends)
        table = torch.stack([c0, c0 + planes[0], c0 + planes[0] + planes[1], zero, *pitch, zero],
                            1).contiguous()
        self.stream.wait_stream(torch.cuda.current_stream())
        if self.ready != (hi - lo, fmt):
            self.lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, hi - lo, 1, fmt)
            self.ready = (hi - lo, fmt)
        vp = ctypes.POINTER(ctypes.c_void_p)
        status = self.lib.nvjpegDecodeBatched(
            self.handle, self.state, ctypes.cast(ptrs.data_ptr(), vp),
            ctypes.cast(lens.data_ptr(), ctypes.POINTER(ctypes.c_size_t)),
            ctypes.cast(table.data_ptr(), ctypes.POINTER(Image)), ctypes.c_void_p(self.stream.cuda_stream))
        if status:
            raise SystemExit(f"nvjpegDecodeBatched failed with status {status}")
        self.stream.synchronize()
        return out


PHOTOS: list = []


def one_jpeg(seed: int) -> bytes:
    from packer.demo import make_image
    return make_image(random.Random(seed), PHOTOS)


def make_jpegs(n: int):
    from packer.demo import load_photos
    PHOTOS[:] = load_photos()
    with mp.get_context("fork").Pool() as pool:  # before CUDA starts; the photos inherited
        return pool.map(one_jpeg, range(n))


def resnet18_step(batch: int):
    import torchvision
    model = torchvision.models.resnet18().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def fed_rate(step, decoders, fmt, threads: int, batch: int, n: int, steps: int) -> float:
    """Images a second of ``step`` while ``threads`` decoders feed one batch a step."""
    q, stop = queue.Queue(maxsize=3), threading.Event()
    per = n // batch

    def work(k: int):
        i = k
        while not stop.is_set():
            lo = (i % per) * batch
            q.put(decoders[k].decode(fmt, lo, lo + batch))
            i += threads
    pool = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    for s in range(10 + steps):
        if s == 10:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        if threads:
            q.get()
        step()
    torch.cuda.synchronize()
    rate = steps * batch / (time.perf_counter() - t0)
    stop.set()
    while any(t.is_alive() for t in pool):
        try:
            q.get(timeout=0.1)
        except queue.Empty:
            pass
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or "decode-beside-out")
    a = p.parse_args()
    jpegs = make_jpegs(a.images)
    decoders = [Decoder(jpegs) for _ in range(3)]
    results = {"alone_ms": {}, "fed": {}}
    for name, fmt in FORMATS.items():  # decode alone, one thread
        d = decoders[0]
        for lo in range(0, a.images - a.batch + 1, a.batch):
            d.decode(fmt, lo, lo + a.batch)
        t0, nb = time.perf_counter(), 0
        for _ in range(4):
            for lo in range(0, a.images - a.batch + 1, a.batch):
                d.decode(fmt, lo, lo + a.batch)
                nb += 1
        results["alone_ms"][name] = 1000 * (time.perf_counter() - t0) / nb
        print(f"{name} alone: {results['alone_ms'][name]:.2f} ms a batch", flush=True)
    step = resnet18_step(a.batch)
    for _ in range(20):
        step()
    variants = [("synthetic", 0, 0)] + [(f"{f}_t{t}", FORMATS[f], t) for t in (1, 2, 3)
                                         for f in ("rgb", "yuv")]
    for r in range(a.rounds):
        for name, fmt, threads in variants:
            rate = fed_rate(step, decoders, fmt, threads, a.batch, a.images, a.steps)
            results["fed"].setdefault(name, []).append(rate)
            print(f"round {r} {name}: {rate:,.0f} img/s", flush=True)
    base = statistics.median(results["fed"]["synthetic"])
    print("\n| variant | median img/s | x synthetic per round | x synthetic (medians) |\n|---|---:|---|---:|")
    for name, rates in results["fed"].items():
        per = " / ".join(f"{v / base:.3f}" for v in rates)
        print(f"| {name} | {statistics.median(rates):,.0f} | {per} | {statistics.median(rates) / base:.3f} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
