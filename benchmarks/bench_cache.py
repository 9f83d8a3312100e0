#!/usr/bin/env python3
"""Training input read from object storage through the shard cache, against the same dataset
staged, in one run.

A local S3-compatible server (moto, its own process on 127.0.0.1) holds a packed ImageFolder
of realistic photo JPEGs (``--images``, shards of ``--shard-mb``). Each variant runs in a
fresh process, in an order rotated per round, and reads ``--epochs`` epochs through
``make_loader`` (``--workers`` workers, ``DecodeRandomResizedCrop(224)``, or raw bytes with
``--raw``); it reports images/s from the first batch to the last, epoch starts included:

    staged   packer.stage(URL, /dev/shm/...) first (not timed), then PackedDataset(local copy)
    cold     PackedDataset(URL, cache_dir=<empty>): every shard downloaded on first use
    warm     the same with a cache that already holds every shard
    quarter  cache_limit = 25 % of the shard bytes (at least two shards), empty at start, PackedSampler(order=
             "node"): a few shards at a time, the next ones prefetched, about one download
             of each shard per epoch
    quarter_random  the same cache with the random order: nearly every batch misses (bounded
             by --random-batches; shows why the order matters)

    python benchmarks/bench_cache.py                         # 2,000 images, 3 rounds
    python benchmarks/bench_cache.py --images 4000 --rounds 5 --raw
Needs the cloud and test extras (fsspec, s3fs, moto[server]).
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

VARIANTS = ("staged", "cold", "warm", "quarter", "quarter_random")


def variant(spec: dict) -> dict:
    """Run one variant in this (fresh) process: images/s and the cache's downloads."""
    import torch  # noqa: F401  (imported before timing)
    from packer import PackedDataset, PackedSampler, make_loader
    from packer.transforms import DecodeRandomResizedCrop

    name, opts = spec["name"], spec["options"]
    decode = None if spec["raw"] else DecodeRandomResizedCrop(224)
    if name == "staged":
        ds = PackedDataset(spec["staged"], decode=decode)
    else:
        limit = spec["quarter_bytes"] if name.startswith("quarter") else None
        ds = PackedDataset(spec["url"], decode=decode, cache_dir=spec["cache"][name],
                           cache_limit=limit, storage_options=opts)
    sampler = PackedSampler(ds, seed=0, order="node" if name == "quarter" else "random")
    collate = (lambda batch: batch) if spec["raw"] else None
    loader = make_loader(ds, spec["batch"], sampler=sampler, num_workers=spec["workers"],
                         pin_memory=False, collate_fn=collate)
    images, t0 = 0, None  # timed from the first batch: worker start-up left out
    limit_batches = spec["random_batches"] if name == "quarter_random" else None
    for epoch in range(spec["epochs"]):
        sampler.set_epoch(epoch)
        for k, batch in enumerate(loader):
            if t0 is None:
                t0 = time.perf_counter()
            else:
                images += len(batch) if spec["raw"] else len(batch[0])
            if limit_batches is not None and k + 1 >= limit_batches:
                break
    secs = time.perf_counter() - t0
    return {"name": name, "images": images, "seconds": secs, "rate": images / secs}


def run_rounds(args, src: Path, staged: Path, opts: dict, rows: dict, quarter: int) -> None:
    """Upload ``src``, stage it, then every variant per round in a rotated order."""
    from packer import stage
    from packer.storage import upload_dataset
    from benchlib.objectstore import run_variant

    url = "s3://bench/ds"
    upload_dataset(src, url, opts)
    shutil.rmtree(staged, ignore_errors=True)
    stage(url, staged, progress=False, storage_options=opts)
    caches = {v: str(args.workdir / f"cache-{v}") for v in VARIANTS}
    spec = {"url": url, "options": opts, "staged": str(staged), "cache": caches,
            "raw": args.raw, "workers": args.workers, "batch": args.batch,
            "epochs": args.epochs, "random_batches": args.random_batches,
            "quarter_bytes": quarter}
    for r in range(args.rounds):
        names = list(rows)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            for v in VARIANTS:
                if v != "warm":  # the warm cache is filled once, below, and kept
                    shutil.rmtree(caches[v], ignore_errors=True)
            if name == "warm" and not os.path.isdir(caches["warm"]):
                run_variant(__file__, dict(spec, name="cold", cache=dict(caches, cold=caches["warm"])))
            res = run_variant(__file__, dict(spec, name=name))
            rows[name].append(res["rate"])
            print(f"round {r} {name:15s} {res['rate']:8.1f} images/s "
                  f"({res['images']} in {res['seconds']:.1f} s)", flush=True)


def make_dataset(work: Path, images: int, shard_mb: int) -> Path:
    from packer import build
    from packer.demo.images import make_image_folder

    src, dst = work / "photos", work / "packed"
    if not (dst / "manifest.json").exists():
        shutil.rmtree(work, ignore_errors=True)
        make_image_folder(src, images=images, classes=10, workers=os.cpu_count() or 1)
        build(src, dst, shard_size=shard_mb << 20, progress=False)
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--shard-mb", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--random-batches", type=int, default=8)
    ap.add_argument("--raw", action="store_true", help="bytes only: no decode")
    ap.add_argument("--only", default=",".join(VARIANTS))
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "packer-bench-cache")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(variant(json.loads(args.variant))))
        return 0
    from benchlib.objectstore import print_medians, s3_server
    from packer.format.manifest import read_manifest

    src = make_dataset(args.workdir, args.images, args.shard_mb)
    man = read_manifest(src)
    shard_bytes = sum(s["bytes"] for s in man["shards"])
    largest = max(s["bytes"] for s in man["shards"])  # a reader pins two: the least a cache holds
    staged = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / "packer-bench-cache"
    rows = {v: [] for v in args.only.split(",")}
    try:
        with s3_server() as opts:
            run_rounds(args, src, staged, opts, rows, max(shard_bytes // 4, 2 * largest))
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    print(f"\n{len(man['shards'])} shards, {shard_bytes / 2**20:.0f} MiB, {args.images} images, "
          f"{args.workers} workers, {args.epochs} epochs, {'raw bytes' if args.raw else 'decoded'}, "
          f"{os.cpu_count()} cores")
    print_medians(rows, "images/s", "staged")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
