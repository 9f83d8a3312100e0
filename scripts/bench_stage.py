#!/usr/bin/env python3
"""Random reads from shards staged in RAM vs shards on disk vs the image folder, cold cache.

Each variant reads the same records (the same random order) in a fresh process after
``sync; echo 3 > /proc/sys/vm/drop_caches`` (not root: ``posix_fadvise(DONTNEED)`` on the
files it reads), so disk reads are real reads, not page-cache hits; only bytes are read (no
decoding), which is the part staging changes:

    folder       open() + read() of each image file of the ImageFolder tree
    shards/disk  ShardReader(DST).read(i), the packed dataset on disk
    shards/RAM   ShardReader(/dev/shm/...).read(i), after `packer stage` (also timed)

A fast local SSD hides most of the difference, so by default the reading processes also run
under a block-I/O throttle like a modest network or cloud disk (400 read IOPS, 100 MiB/s):
cgroup v1 ``blkio.throttle.read_{iops,bps}_device`` where mounted, else cgroup v2
``io.max``, else none (said in the output); see ``packer.coldread``. Needs root for the
throttle and for dropping the whole page cache.

    sudo python scripts/bench_stage.py                 # makes 2,000 photo JPEGs in --workdir
    sudo python scripts/bench_stage.py --src DIR --records 500 --no-throttle
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import List

from packer.coldread import SlowDisk, drop_page_cache, read_count, whole_disk


# -- the reading child -----------------------------------------------------------------------

def child(spec: dict) -> dict:
    """Runs in a fresh process, in the throttled cgroup (``SlowDisk.run``): time the reads."""
    if spec["variant"] == "stage":
        from packer.stage import stage
        t = time.perf_counter()
        res = stage(spec["path"], spec["target"], progress=False, verify=True)
        return {"seconds": time.perf_counter() - t, "bytes": res.bytes_copied,
                "records": None}
    order = spec["order"]
    total = 0
    if spec["variant"] == "folder":
        files = spec["files"]
        reads0 = read_count(spec.get("counter"), spec.get("majmin"))
        t = time.perf_counter()
        for i in order:
            with open(files[i], "rb", buffering=0) as f:
                total += len(f.read())
        seconds = time.perf_counter() - t
    else:
        from packer.reader import ShardReader
        reader = ShardReader(spec["path"])  # reads the manifest: set-up, not timed
        reads0 = read_count(spec.get("counter"), spec.get("majmin"))
        t = time.perf_counter()
        for i in order:
            total += len(reader.read(i))
        seconds = time.perf_counter() - t
        reader.close()
    reads = read_count(spec.get("counter"), spec.get("majmin"))
    return {"seconds": seconds, "bytes": total, "records": len(order),
            "disk_reads": None if reads is None or reads0 is None else reads - reads0}


def run_child(disk: SlowDisk, spec: dict, evict: List[str]) -> dict:
    """``child(spec)`` in a fresh process in ``disk``'s cgroup, after evicting ``evict``
    (everything, as root) from the page cache."""
    how = drop_page_cache(evict)
    return dict(disk.run(child, spec), cache=how)


# -- main ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="image folder (default: make --images photo JPEGs in --workdir)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/packer-bench-stage"),
                    help="on the disk to measure (not a tmpfs); reused between runs")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--records", type=int, default=0, help="records read per variant (0: all)")
    ap.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="where to stage (a tmpfs)")
    ap.add_argument("--no-throttle", action="store_true", help="cold cache only, full disk speed")
    ap.add_argument("--iops", type=int, default=400)
    ap.add_argument("--bps", type=int, default=100 << 20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from packer.build import build
    from packer.demo import make_image_folder
    from packer.format import read_manifest
    from packer.source import scan_folder
    from packer.stage import fs_type, unstage

    root = os.geteuid() == 0
    if not root:
        print("warning: not root: no throttle is possible, and only the files read are "
              "evicted from the page cache (posix_fadvise), not the whole cache", file=sys.stderr)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if fs_type(args.workdir) in ("tmpfs", "ramfs"):
        raise SystemExit(f"--workdir {args.workdir} is in RAM ({fs_type(args.workdir)}); pick a folder on disk")
    src = args.src
    if src is None:
        src = args.workdir / f"folder-{args.images}"
        if not (src / ".complete").exists():
            shutil.rmtree(src, ignore_errors=True)
            make_image_folder(src, images=args.images, classes=10, workers=os.cpu_count() or 1,
                              progress=True)
            (src / ".complete").write_text("")
    packed = args.workdir / f"packed-{src.resolve().name}"
    if not (packed / "manifest.json").exists():
        build(src, packed, progress=True)
    man = read_manifest(packed)
    entries = scan_folder(src).entries
    files = [str(Path(src, rel)) for rel, _ in entries]
    n = len(files)
    if man["count"] != n:
        raise SystemExit(f"{packed} holds {man['count']} records for {n} files (skipped images?); "
                         f"remove it to rebuild")
    order = list(range(n))
    random.Random(args.seed).shuffle(order)
    if args.records:
        order = order[:args.records]

    disk = SlowDisk(packed, args.iops, args.bps, limit=not args.no_throttle)
    note = "no throttle (--no-throttle)" if args.no_throttle else disk.how
    src_disk, _ = whole_disk(src)
    if disk.throttled and src_disk != disk.majmin:
        note += f" (warning: {src} is on another device, {src_disk}, not throttled)"
    counter = disk.counter
    io = {"order": order, "counter": counter, "majmin": disk.majmin}
    target = args.shm / f"packer-bench-{uuid.uuid4().hex[:8]}"
    shards = [str(p) for p in packed.rglob("*") if p.is_file()]
    results = {}
    with disk:
        try:
            results["stage"] = run_child(disk, {"variant": "stage", "path": str(packed),
                                                "target": str(target)}, shards)
            results["folder"] = run_child(disk, dict(io, variant="folder", files=files), files)
            results["shards/disk"] = run_child(disk, dict(io, variant="disk", path=str(packed)), shards)
            results["shards/RAM"] = run_child(disk, dict(io, variant="shm", path=str(target)),
                                              [str(p) for p in target.rglob("*") if p.is_file()])
        finally:
            if target.exists():
                unstage(target)

    mb = sum(f["bytes"] for f in man["shards"]) / 1e6
    print(f"\n{n} images ({mb:.0f} MB packed, {len(man['shards'])} shard(s)), {len(order)} read "
          f"per variant in random order, page cache: {results['shards/disk']['cache']}")
    print(f"disk: {disk.disk} ({fs_type(packed)}), RAM: {args.shm} ({fs_type(args.shm)}); {note}")
    print(f"machine: {platform.node()}, Linux {platform.release()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    base = results["folder"]["records"] / results["folder"]["seconds"]
    print("\n| variant | records | seconds | records/s | MB/s | vs folder | disk reads/record |")
    print("|---|---|---|---|---|---|---|")
    for name in ("folder", "shards/disk", "shards/RAM"):
        r = results[name]
        rate = r["records"] / r["seconds"]
        ios = "?" if r["disk_reads"] is None else f"{r['disk_reads'] / r['records']:.1f}"
        print(f"| {name} | {r['records']} | {r['seconds']:.2f} | {rate:,.0f} | "
              f"{r['bytes'] / 1e6 / r['seconds']:,.1f} | {rate / base:.1f}x | {ios} |")
    s = results["stage"]
    print(f"\nstaging (one-off, same disk conditions): {s['bytes'] / 1e6:.0f} MB in {s['seconds']:.2f} s "
          f"({s['bytes'] / 1e6 / s['seconds']:.0f} MB/s, copy + sha256 + read-back check)")
    print("disk reads/record: read requests completed for the reading process (its cgroup's "
          "counter)" if counter and not counter.startswith("disk:") else
          "disk reads/record: read requests the whole disk completed meanwhile (no cgroup: "
          "other processes' reads included)")
    print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
