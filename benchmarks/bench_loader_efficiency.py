#!/usr/bin/env python3
"""Loader efficiency: make_loader's images/s over (workers x one core's images/s for the same
per-sample work: read, unpack, decode + crop), median of interleaved rounds. The
measurement is ``benchlib.figures.bench_efficiency``.

    python benchmarks/bench_loader_efficiency.py                 # makes 2,000 photo JPEGs, packs them
    python benchmarks/bench_loader_efficiency.py --data DST --workers 15 --rounds 7
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from packer.loading.loader import default_num_workers
from benchlib.figures import bench_efficiency, efficiency_table, packed_photos


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, help="a packed dataset (default: make --images and pack)")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=default_num_workers())
    ap.add_argument("--samples", type=int, default=1024, help="samples per loader run")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    with packed_photos(args.data, args.images) as data:
        res = bench_efficiency(data, workers=args.workers, batch_size=args.batch_size,
                               samples=args.samples, rounds=args.rounds)
    print("\n" + efficiency_table(res, args.workers))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
