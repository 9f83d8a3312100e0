#!/usr/bin/env python3
"""The host CPU a detection batch of the GPU path costs, by thread (GPU machine). A
detection step is bound by its process's host work, so every millisecond the feeding
threads hold the interpreter is one the step waits for.

Makes --images detection scenes (packer's photos, objects pasted at known boxes), packs
them with ``Coco``, then for ``GPUDecoder(letterbox=True)`` at --size, batch --batch:
1. the decode thread's work, run in this thread: ``decode_batch`` and ``augment_batch``
   (CPU ms a batch by ``time.thread_time``; nvJPEG's own host work included);
2. the consumer: the CPU ms a batch its thread spends taking batches, nothing else running;
3. marking one batch's tensors as used on another stream: ``record_uses`` (once per
   storage, no tv_tensors dispatch) against ``record_stream`` on each tensor.

    python3 benchmarks/profile_gpu_detection.py --images 1000 --size 320
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch


def cpu_ms(fn, repeat: int) -> float:
    """CPU ms of this thread per call of ``fn``, the GPU idle before and its wait after left
    out (a synchronize spins)."""
    torch.cuda.synchronize()
    t0 = time.thread_time()
    for _ in range(repeat):
        fn()
    spent = time.thread_time() - t0
    torch.cuda.synchronize()
    return spent / repeat * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--size", type=int, default=320)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--root", default="/tmp/packer-gpu-detection")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from packer.demo.scenes import make_detection_folder
    from packer.gpu import GPUDecoder, make_gpu_loader
    from packer.loading.prefetch import iter_tensors, record_uses
    from packer.sources import Coco
    from packer.writing.builder import build
    src, packed = Path(a.root) / f"src-{a.images}", Path(a.root) / f"packed-{a.images}"
    if not (packed / "manifest.json").exists():
        make_detection_folder(src, a.images, seed=0)
        build(Coco(src / "images", src / "annotations.json"), packed, progress=False)
    loader = make_gpu_loader(str(packed), a.batch, shuffle=True, drop_last=True)
    g = GPUDecoder(loader, size=a.size, letterbox=True, mean=None, std=None,
                   dtype=torch.float32, device="cuda")
    batches = [b for b, _ in zip(loader, range(len(loader)))]
    items = iter(batches * 1000)
    print(f"decode_batch: {cpu_ms(lambda: g.decode_batch(next(items)), len(batches)):.2f} ms")
    item = g.decode_batch(batches[0])
    print(f"augment_batch: {cpu_ms(lambda: g.augment_batch(item, 0), len(batches)):.2f} ms")

    def endless():
        while True:
            yield from g
    out = endless()
    held = collections.deque((next(out) for _ in range(20)), maxlen=3)  # warm; the last few kept
    print(f"consumer (GPUDecoder alone): {cpu_ms(lambda: held.append(next(out)), 60):.2f} ms")
    out.close()  # the decode threads stop: nothing else runs below
    batch, side = held[-1], torch.cuda.Stream()

    def each():
        for t in iter_tensors(batch):
            t.record_stream(side)
    print(f"record_uses: {cpu_ms(lambda: record_uses(batch, side), 50):.3f} ms; record_stream "
          f"on each of its {sum(1 for _ in iter_tensors(batch))} tensors: {cpu_ms(each, 50):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
