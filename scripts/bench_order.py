#!/usr/bin/env python3
"""Random vs block order read throughput from a cold page cache, and time to resume at 90%.

    python scripts/bench_order.py                      # builds a 2000-image dataset in a temp dir
    sudo python scripts/bench_order.py --data /path/to/packed --records 20000

The cache is dropped before each timed pass with ``posix_fadvise(DONTNEED)`` on every shard
(evicts this dataset's clean pages; no root needed), or with ``--drop-all-caches`` as root
(``echo 3 > /proc/sys/vm/drop_caches``). The resident fraction after dropping is printed:
if it is not ~0%, the numbers are warm-cache numbers.

A fast local SSD hides what the order does to a slow disk, so as root each timed pass runs
in a fresh process under a block-I/O throttle like a modest network or cloud disk (400 read
IOPS, 100 MiB/s; ``--iops``, ``--bps``): ``packer.coldread.SlowDisk``, a cgroup v1 blkio
(else v2 io.max) throttle on the disk holding the data. ``--no-throttle`` reads at the
disk's own speed; without root or a cgroup the output says the throttle is off, and why.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packer.coldread import SlowDisk, drop_page_cache, resident, whole_disk  # noqa: E402
from packer.reader import ShardReader  # noqa: E402


def make_dataset(root: Path, images: int) -> Path:
    """A packed dataset of `images` realistic JPEGs (64 distinct ones, repeated: speed only)."""
    from packer.build import build
    from packer.demo import make_image_folder
    unique = make_image_folder(root / "unique", images=min(64, images), classes=8, workers=2)
    files = sorted(unique.rglob("*.jpg"))
    for i in range(images):
        dst = root / "src" / f"class_{i % 8:02d}" / f"img_{i:05d}.jpg"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(files[i % len(files)], dst)
    build(root / "src", root / "packed", workers=2, progress=False)
    return root / "packed"


def read_pass(root: str, order: List[int]) -> Tuple[float, float]:
    """Records/s and MB/s reading ``order`` from the packed dataset at ``root``."""
    reader = ShardReader(root)
    t = time.perf_counter()
    nbytes = 0
    for i in order:
        nbytes += len(reader.read(i))
    dt = time.perf_counter() - t
    reader.close()
    return len(order) / dt, nbytes / dt / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="packed dataset (default: build one in a temp dir)")
    ap.add_argument("--images", type=int, default=2000, help="images in the built dataset")
    ap.add_argument("--records", type=int, default=0, help="records read per order (default: all)")
    ap.add_argument("--block-size", type=int, default=32,
                    help="records per block (PackedSampler's default, 256, suits >100k records)")
    ap.add_argument("--window", type=int, default=4, help="blocks mixed together (default there: 16)")
    ap.add_argument("--repeat", type=int, default=2, help="passes per order (best is reported)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--drop-all-caches", action="store_true",
                    help="as root, drop the whole page cache (echo 3 > /proc/sys/vm/drop_caches) "
                         "instead of only this dataset's pages; disturbs everything else running")
    ap.add_argument("--throttle", action=argparse.BooleanOptionalAction, default=None,
                    help="read each timed pass in a child process under a block-I/O throttle "
                         "(default: on when root and a cgroup throttle is available)")
    ap.add_argument("--iops", type=int, default=400, help="throttle: read IOPS (default: 400)")
    ap.add_argument("--bps", type=int, default=100 << 20,
                    help="throttle: read bytes/s (default: 100 MiB/s)")
    args = ap.parse_args()

    from packer.sampler import PackedSampler, global_order
    tmp = None if args.data is not None else Path(tempfile.mkdtemp(prefix="packer-bench-"))
    disk = SlowDisk(args.data or tmp, args.iops, args.bps) if args.throttle is not False else None
    throttled = disk is not None and disk.throttled
    try:
        if args.throttle and not throttled:
            raise SystemExit(f"--throttle: {disk.how}")
        if args.data is None:
            t = time.perf_counter()
            args.data = make_dataset(tmp, args.images)
            print(f"built {args.images}-image dataset in {time.perf_counter() - t:.1f} s: {args.data}")
        reader = ShardReader(args.data)
        n, shards = len(reader), [str(p) for p in reader.paths]
        reader.close()
        size = sum(os.path.getsize(p) for p in shards)
        records = min(args.records or n, n)
        print(f"{n} records, {size / 1e6:.0f} MB in {len(shards)} shard(s); reading {records} per order")
        print(f"disk: {whole_disk(args.data)[1]}; "
              f"{disk.how if disk is not None else 'no throttle (--no-throttle)'}")
        block = {"block_size": args.block_size, "window": args.window}
        orders = {"random": global_order(n, seed=0),
                  f"block {args.block_size}x{args.window}": global_order(n, seed=0, order="block", **block),
                  f"block {args.block_size}x1": global_order(n, seed=0, order="block",
                                                            block_size=args.block_size, window=1),
                  "sequential": global_order(n, shuffle=False)}
        orders = {name: order[:records].tolist() for name, order in orders.items()}
        passes = {name: [] for name in orders}
        for rep in range(args.repeat):  # interleaved, so drift on a shared machine hits all alike
            for name, order in orders.items():
                how = drop_page_cache(shards, everything=args.drop_all_caches)
                cold = resident(shards)
                if throttled:  # a fresh process in the throttled cgroup
                    rate, mbs = disk.run(read_pass, str(args.data), order)
                else:
                    rate, mbs = read_pass(str(args.data), order)
                passes[name].append((rate, mbs, cold))
                print(f"{name:>16}: {rate:8.0f} records/s {mbs:7.1f} MB/s "
                      f"(page cache: {how}, {cold:.0%} resident before)")
        best = {name: max(p) for name, p in passes.items()}
        print(f"\nbest of {args.repeat} passes per order:\n")
        print("| order | records/s | MB/s | vs random | resident before |")
        print("|---|---|---|---|---|")
        for name, (rate, mbs, cold) in best.items():
            print(f"| {name} | {rate:,.0f} | {mbs:,.1f} | {rate / best['random'][0]:.2f}x | {cold:.0%} |")

        from torch.utils.data import DataLoader
        from packer.dataset import PackedDataset
        dataset = PackedDataset(args.data)
        state = {"seed": 0, "epoch": 0, "consumed": int(0.9 * n), "size": n}
        drop_page_cache(shards, everything=args.drop_all_caches)
        t = time.perf_counter()
        sampler = PackedSampler(dataset, seed=0)
        sampler.load_state_dict(state)
        batch = next(iter(DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                     collate_fn=list)))
        dt = time.perf_counter() - t
        print(f"\nresume at 90% of the epoch: load_state_dict + first batch of {len(batch)} in "
              f"{dt * 1e3:.0f} ms ({len(sampler)} samples left, none read or skipped{'; not throttled' if throttled else ''})")
        print("command: " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    finally:
        if disk is not None:
            disk.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
