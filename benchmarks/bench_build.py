#!/usr/bin/env python3
"""Build throughput vs the cost of decoding every image once on all cores.

Goal (issue 2): build images/s >= 0.8 x cores x one core's full-decode rate, measured in
the same run on the same files. Prints a table and the command that made it. The
measurement is ``benchlib.figures.bench_build``.

    python benchmarks/bench_build.py                    # makes 2,000 photo JPEGs in a temp dir
    python benchmarks/bench_build.py --src DIR --repeats 3
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchlib.figures import bench_build, build_table
from packer.loading.loader import default_num_workers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="image folder (default: generate --images photo JPEGs)")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=default_num_workers())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-sample", type=int, default=400, help="files timed for the 1-core decode rate")
    args = ap.parse_args(argv)
    result = bench_build(args.src, workers=args.workers, images=args.images, repeats=args.repeats,
                         decode_sample=args.decode_sample)
    print("\n" + build_table(result))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
