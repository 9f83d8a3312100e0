#!/usr/bin/env python3
"""`packer build s3://.../images DST` against the same build from a local folder and against
a plain parallel GET of the same objects, in one run.

A local S3-compatible server (moto, its own process on 127.0.0.1) holds an ImageFolder of
realistic photo JPEGs (``--images``). Each variant runs in a fresh process, in an order
rotated per round:

    local   packer.build(folder on disk, DST, workers=W): the disk baseline
    url     packer.build(ImageFolder(URL), DST, workers=W): listed once, 16 GETs in flight
            per worker, every image decoded and checked as in the local build
    plain   every object fetched (W x 16 GETs in flight), nothing else: what the store serves

and prints images/s and the url build's ratio to each. Nothing leaves loopback. Needs the
cloud and test extras (fsspec, s3fs, moto[server]).

    python benchmarks/bench_build_url.py                 # 2,000 images, 3 rounds
    python benchmarks/bench_build_url.py --images 4000 --rounds 5 --workers 4
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("local", "url", "plain")


def variant(spec: dict) -> dict:
    """One variant in this (fresh) process: seconds for the whole job."""
    import packer
    from packer.sources import ImageFolder

    name, dst, opts = spec["name"], Path(spec["dst"]), spec["options"]
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    if name == "plain":
        from concurrent.futures import ThreadPoolExecutor

        import fsspec
        fs = fsspec.filesystem("s3", **opts)
        keys = sorted(fs.find(spec["prefix"]))
        with ThreadPoolExecutor(16 * spec["workers"]) as pool:
            got = sum(len(b) for b in pool.map(fs.cat_file, keys))
        count = len(keys)
    else:
        source = spec["folder"] if name == "local" else ImageFolder(spec["url"],
                                                                     storage_options=opts)
        res = packer.build(source, dst, workers=spec["workers"], progress=False)
        count, got = res.manifest["count"], res.manifest["bytes"]
    return {"name": name, "images": count, "bytes": got, "seconds": time.perf_counter() - t0}



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workdir", type=Path,
                    default=Path(tempfile.gettempdir()) / "packer-bench-build-url")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(variant(json.loads(args.variant))))
        return 0
    import fsspec
    from benchlib.objectstore import print_medians, run_variant, s3_server
    from packer.demo.images import make_image_folder

    folder = args.workdir / "photos"
    if not folder.is_dir():
        make_image_folder(folder, images=args.images, classes=10, workers=os.cpu_count() or 1)
    rows = {v: [] for v in VARIANTS}
    with s3_server() as opts:
        fsspec.filesystem("s3", **opts).put(str(folder) + "/", "bench/photos/", recursive=True)
        spec = {"folder": str(folder), "url": "s3://bench/photos", "prefix": "bench/photos",
                "options": opts, "workers": args.workers, "dst": str(args.workdir / "dst")}
        for r in range(args.rounds):
            for name in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                res = run_variant(__file__, dict(spec, name=name))
                rows[name].append(res["images"] / res["seconds"])
                print(f"round {r} {name:6s} {rows[name][-1]:8.1f} images/s "
                      f"({res['images']} in {res['seconds']:.1f} s)", flush=True)
    shutil.rmtree(args.workdir / "dst", ignore_errors=True)
    print(f"\n{args.images} images, {args.workers} workers, {os.cpu_count()} cores")
    med = print_medians(rows, "images/s")
    print(f"  url / local {med['url'] / med['local']:.2f}   url / plain {med['url'] / med['plain']:.2f}")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
