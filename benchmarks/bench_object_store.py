#!/usr/bin/env python3
"""`packer stage s3://...` against a plain parallel download of the same objects, same run.

A local S3-compatible server (moto, in its own process on 127.0.0.1) holds a packed dataset
of about --mb MiB. Each round, in alternating order:

    plain   every object of the dataset fetched as ranged GETs of --part-size, --parallel at
            a time over all objects at once, written to --target with pwrite: no hashing, no
            checks (the most a client gets from this store here)
    packer  packer.stage(URL, --target) with the same part size and parallelism: every byte
            hashed against the manifest, each file renamed into place, manifest last

and prints MiB/s of each and packer's ratio to plain (the goal: >= 0.8). Nothing leaves
loopback. Needs the cloud and test extras (fsspec, s3fs, moto[server]).

    python benchmarks/bench_object_store.py                    # ~256 MiB, 3 rounds
    python benchmarks/bench_object_store.py --mb 1024 --rounds 5 --target /dev/shm/bench-s3
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib.objectstore import print_medians, s3_server


def make_dataset(workdir: Path, mb: int, shard_mb: int) -> Path:
    """A real dataset of ~``mb`` MiB: 200 demo photos, packed over and over (kept in workdir)."""
    from packer import write
    from packer.demo import make_image_folder
    dst = workdir / f"dataset-{mb}M-{shard_mb}M"
    if (dst / "manifest.json").exists():
        return dst
    photos = sorted(make_image_folder(workdir / "photos", images=200, classes=10, workers=2).rglob("*.jpg"))
    blobs = [p.read_bytes() for p in photos]
    n = int(mb * 2**20 / (sum(map(len, blobs)) / len(blobs)))
    samples = ({"image": blobs[i % len(blobs)], "label": i % 10} for i in range(n))
    write(dst, samples, classes=[str(c) for c in range(10)], shard_size=shard_mb << 20,
          progress=False, total=n)
    return dst


def plain_download(fs, keys, sizes, target: Path, part: int, parallel: int) -> float:
    """Seconds to fetch every object (ranged GETs, all objects at once) into ``target``."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    fds = {k: os.open(target / k.rsplit("/", 1)[1], os.O_WRONLY | os.O_CREAT, 0o644) for k in keys}
    jobs = [(k, o, min(sizes[k], o + part)) for k in keys for o in range(0, sizes[k], part)]

    def get(job):
        k, a, b = job
        data = fs.cat_file(k, start=a, end=b)
        assert len(data) == b - a
        os.pwrite(fds[k], data, a)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(get, jobs))
    for fd in fds.values():
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="dataset size, MiB")
    ap.add_argument("--shard-mb", type=int, default=128)
    ap.add_argument("--part-mb", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/packer-bench-s3"))
    ap.add_argument("--target", type=Path, default=Path("/dev/shm/packer-bench-s3"))
    args = ap.parse_args(argv)
    import fsspec
    from packer import stage
    from packer.format.manifest import read_manifest, side_tables
    from packer.storage import upload_dataset

    src = make_dataset(args.workdir, args.mb, args.shard_mb)
    with s3_server() as creds:
        fs = fsspec.filesystem("s3", **creds)
        opts = dict(creds, packer_part_size=args.part_mb << 20, packer_parallel=args.parallel)
        upload_dataset(src, "s3://bench/ds", opts)
        man = read_manifest(src)
        names = [s["path"] for s in man["shards"]] + [e["path"] for _, e, _ in side_tables(man)]
        keys = [f"bench/ds/{n}" for n in names]
        sizes = {k: fs.info(k)["size"] for k in keys}
        total = sum(sizes.values())
        rows = {"plain": [], "packer": []}
        for r in range(args.rounds):
            for name in (("plain", "packer") if r % 2 == 0 else ("packer", "plain")):
                if name == "plain":
                    secs = plain_download(fs, keys, sizes, args.target, args.part_mb << 20, args.parallel)
                else:
                    shutil.rmtree(args.target, ignore_errors=True)
                    t0 = time.perf_counter()
                    stage("s3://bench/ds", args.target, progress=False, storage_options=opts)
                    secs = time.perf_counter() - t0
                rows[name].append(total / secs / 2**20)
                print(f"round {r} {name:8s} {rows[name][-1]:8.1f} MiB/s", flush=True)
        shutil.rmtree(args.target, ignore_errors=True)
    print(f"\n{total / 2**20:.0f} MiB in {len(keys)} objects ({len(man['shards'])} shards), "
          f"{args.part_mb} MiB parts, {args.parallel} at a time, {os.cpu_count()} cores")
    print_medians(rows, "MiB/s", "plain")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
