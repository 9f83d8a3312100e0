#!/usr/bin/env python3
"""Build throughput vs the cost of decoding every image once on all cores.

Goal (issue 2): build images/s >= 0.8 x cores x one core's full-decode rate, measured in
the same run on the same files. Prints a table and the command that made it.

    python scripts/bench_build.py                    # makes 2,000 photo JPEGs in a temp dir
    python scripts/bench_build.py --src DIR --repeats 3
"""
from __future__ import annotations

import argparse
import io
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from packer.build import build, default_workers
from packer.demo import make_image_folder
from packer.imaging import Transcode, pil_summary
from packer.source import scan_folder


def decode_rate(blobs) -> float:
    t = time.perf_counter()
    for b in blobs:
        Image.open(io.BytesIO(b)).convert("RGB")
    return len(blobs) / (time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="image folder (default: generate --images photo JPEGs)")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-sample", type=int, default=400, help="files timed for the 1-core decode rate")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="packer-bench-build-"))
    src = args.src or make_image_folder(tmp / "src", images=args.images, classes=10,
                                        workers=args.workers, progress=True)
    entries = scan_folder(src).entries
    total_bytes = sum(os.path.getsize(Path(src, rel)) for rel, _ in entries)
    sample = [Path(src, rel).read_bytes() for rel, _ in entries[:: max(1, len(entries) // args.decode_sample)]]
    print(f"{len(entries)} images, {total_bytes / len(entries) / 1e3:.0f} KB mean, PIL: {pil_summary()}, "
          f"{args.workers} workers")

    rows = {"decode 1 core": [], "build (bytes unchanged)": [], "build --short-side 256 --quality 90": []}
    for r in range(args.repeats):  # interleaved, so drift hits every variant alike
        rows["decode 1 core"].append(decode_rate(sample))
        for v, (name, tc) in enumerate((("build (bytes unchanged)", None),
                                        ("build --short-side 256 --quality 90",
                                         Transcode(short_side=256, quality=90)))):
            dst = tmp / f"dst-{r}-{v}"
            res = build(src, dst, workers=args.workers, transcode=tc, progress=False)
            rows[name].append(len(entries) / res.seconds)
            shutil.rmtree(dst)
    one = statistics.median(rows["decode 1 core"])
    target = 0.8 * args.workers * one
    print(f"\n| variant | images/s (median of {args.repeats}) | spread | MB/s in | vs cores x 1-core decode |")
    print("|---|---|---|---|---|")
    for name, vals in rows.items():
        med = statistics.median(vals)
        spread = f"{min(vals):.0f}-{max(vals):.0f}"
        mbps = med * total_bytes / len(entries) / 1e6
        ratio = med / (args.workers * one)
        print(f"| {name} | {med:.0f} | {spread} | {mbps:.1f} | {ratio:.2f} |")
    print(f"\ngoal: build >= 0.8 x {args.workers} x {one:.0f} = {target:.0f} images/s")
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
