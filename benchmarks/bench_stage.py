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
``io.max``, else none (said in the output); see ``packer.bench.coldread``. Needs root for the
throttle and for dropping the whole page cache. The measurement is ``benchlib.stage``.

    sudo python benchmarks/bench_stage.py                 # makes 2,000 photo JPEGs in --workdir
    sudo python benchmarks/bench_stage.py --src DIR --records 500 --no-throttle
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from benchlib.stage import StageOptions, bench_stage, stage_report
from packer.errors import PackerError


def main(argv=None) -> int:
    d = StageOptions()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="image folder (default: make --images photo JPEGs in --workdir)")
    ap.add_argument("--workdir", type=Path, default=d.workdir,
                    help="on the disk to measure (not a tmpfs), kept and reused between runs "
                         "[default: a fresh private folder under /var/tmp, removed after]")
    ap.add_argument("--images", type=int, default=d.images)
    ap.add_argument("--records", type=int, default=d.records, help="records read per variant (0: all)")
    ap.add_argument("--shm", type=Path, default=d.shm, help="where to stage (a tmpfs)")
    ap.add_argument("--no-throttle", action="store_true", help="cold cache only, full disk speed")
    ap.add_argument("--iops", type=int, default=d.iops)
    ap.add_argument("--bps", type=int, default=d.bps)
    ap.add_argument("--seed", type=int, default=d.seed)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("warning: not root: no throttle is possible, and only the files read are "
              "evicted from the page cache (posix_fadvise), not the whole cache", file=sys.stderr)
    opts = StageOptions(workdir=args.workdir, images=args.images, records=args.records,
                        shm=args.shm, throttle=not args.no_throttle, iops=args.iops,
                        bps=args.bps, seed=args.seed)
    try:
        result = bench_stage(args.src, opts)
    except PackerError as e:
        raise SystemExit(str(e)) from None
    print("\n" + stage_report(result))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
