#!/usr/bin/env python3
"""Random vs block order read throughput from a cold page cache, and time to resume at 90%.

    python benchmarks/bench_order.py                      # builds a 2000-image dataset in a temp dir
    sudo python benchmarks/bench_order.py --data /path/to/packed --records 20000

The cache is dropped before each timed pass with ``posix_fadvise(DONTNEED)`` on every shard
(evicts this dataset's clean pages; no root needed), or with ``--drop-all-caches`` as root
(``echo 3 > /proc/sys/vm/drop_caches``). The resident fraction after dropping is printed:
if it is not ~0%, the numbers are warm-cache numbers.

A fast local SSD hides what the order does to a slow disk, so as root each timed pass runs
in a fresh process under a block-I/O throttle like a modest network or cloud disk (400 read
IOPS, 100 MiB/s; ``--iops``, ``--bps``): ``benchlib.slowdisk.SlowDisk``, a cgroup v1 blkio
(else v2 io.max) throttle on the disk holding the data. ``--no-throttle`` reads at the
disk's own speed; without root or a cgroup the output says the throttle is off, and why.

The measurement is ``benchlib.order``.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchlib.order import OrderOptions, bench_order, order_report
from packer.errors import PackerError


def main(argv=None) -> int:
    d = OrderOptions()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="packed dataset (default: build one in a temp dir)")
    ap.add_argument("--images", type=int, default=d.images, help="images in the built dataset")
    ap.add_argument("--records", type=int, default=d.records, help="records read per order (default: all)")
    ap.add_argument("--block-size", type=int, default=d.block_size,
                    help="records per block (PackedSampler's default, 256, suits >100k records)")
    ap.add_argument("--window", type=int, default=d.window, help="blocks mixed together (default there: 16)")
    ap.add_argument("--repeat", type=int, default=d.repeat, help="passes per order (best is reported)")
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--drop-all-caches", action="store_true",
                    help="as root, drop the whole page cache (echo 3 > /proc/sys/vm/drop_caches) "
                         "instead of only this dataset's pages; disturbs everything else running")
    ap.add_argument("--throttle", action=argparse.BooleanOptionalAction, default=None,
                    help="read each timed pass in a child process under a block-I/O throttle "
                         "(default: on when root and a cgroup throttle is available)")
    ap.add_argument("--iops", type=int, default=d.iops, help="throttle: read IOPS (default: 400)")
    ap.add_argument("--bps", type=int, default=d.bps,
                    help="throttle: read bytes/s (default: 100 MiB/s)")
    args = ap.parse_args(argv)
    opts = OrderOptions(images=args.images, records=args.records, block_size=args.block_size,
                        window=args.window, repeat=args.repeat, batch_size=args.batch_size,
                        drop_all_caches=args.drop_all_caches, throttle=args.throttle,
                        iops=args.iops, bps=args.bps)
    try:
        result = bench_order(args.data, opts)
    except PackerError as e:
        raise SystemExit(str(e)) from None
    print("\n" + order_report(result))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
