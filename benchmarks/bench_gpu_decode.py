#!/usr/bin/env python3
"""Benchmark packer's GPU decode path against the CPU path, in one run (GPU machine).

Makes ImageNet-like JPEGs, packs them as stored and transcoded, then measures images/s
to 224x224 for: the CPU path (Pillow in DataLoader workers on all cores), nvJPEG decode
alone, the batched augment alone, the whole GPUDecoder pipeline (inline, one thread, two
threads; train and eval), the same on transcoded data, whether the hardware JPEG engine
works (NVML's JPG utilization), ResNet-18 steps fed by the GPU path vs synthetic batches,
and pixel agreement with PIL. Prints a table; writes results.json and results.md to --out.
The measurements live in benchlib.gpu; this script is its command line.

    python3 benchmarks/bench_gpu_decode.py --images 8192 --out "$OUT"
    python3 benchmarks/bench_gpu_decode.py --dry-run       # tiny, CPU, PIL stands in for nvJPEG
"""
from __future__ import annotations

import argparse
import os
import sys

from benchlib.gpu import SECTIONS, GPUBenchArgs, run


def main(argv=None) -> int:
    d = GPUBenchArgs()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=d.images)
    p.add_argument("--classes", type=int, default=d.classes)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--cpus", type=int, default=d.cpus)
    p.add_argument("--loader-workers", type=int, default=d.loader_workers,
                   help="workers feeding the GPU path (default: cores - 4)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="passes per pipeline measurement")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--preload", type=int, default=d.preload,
                   help="batches kept in memory for 'only' runs")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--root", default=d.root)
    p.add_argument("--out", default=os.environ.get("OUT", d.out))
    p.add_argument("--sets", default=d.sets, help="packed sets to measure (stored is always made)")
    p.add_argument("--skip", default=d.skip,
                   help="comma list of: transcoded, " + ", ".join(SECTIONS))
    p.add_argument("--dry-run", action="store_true", help="tiny and on the CPU, PIL for nvJPEG")
    p.add_argument("--only", default=d.only, help="comma list of sections to run (as --skip "
                   "names), skipping the others: " + ", ".join(SECTIONS))
    return run(GPUBenchArgs(**vars(p.parse_args(argv))))


if __name__ == "__main__":
    sys.exit(main())
