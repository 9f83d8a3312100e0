#!/usr/bin/env python3
"""Random vs block order read throughput from a cold page cache, and time to resume at 90%.

    python scripts/bench_order.py                      # builds a 2000-image dataset in a temp dir
    python scripts/bench_order.py --data /path/to/packed --records 20000

The cache is dropped before each timed pass with ``posix_fadvise(DONTNEED)`` on every shard
(evicts this dataset's clean pages; no root needed), or with ``--drop-all-caches`` as root
(``echo 3 > /proc/sys/vm/drop_caches``). The resident fraction after dropping is printed:
if it is not ~0%, the numbers are warm-cache numbers. For a disk slower than this one, run
on that disk (or throttle it, e.g. cgroup-v1 ``blkio.throttle.read_bps_device``).
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packer.reader import ShardReader  # noqa: E402
from packer.sampler import PackedSampler, global_order  # noqa: E402


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


def resident(paths) -> float:
    """Fraction of the files' pages in the page cache (mincore on a private, untouched map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = cached = 0
    for p in paths:
        size = os.path.getsize(p)
        with open(p, "rb") as f:
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        n = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * n)()
        anchor = ctypes.c_char.from_buffer(m)
        ok = libc.mincore(ctypes.addressof(anchor), size, vec) == 0
        del anchor
        m.close()
        if not ok:
            return float("nan")
        total, cached = total + n, cached + sum(v & 1 for v in vec)
    return cached / max(total, 1)


def drop_cache(paths, everything: bool = False) -> str:
    if everything and os.geteuid() == 0:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass  # root in a container: /proc/sys is read-only; fall back to this dataset only
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def read_pass(root: Path, order, records: int) -> float:
    reader = ShardReader(root)
    t = time.perf_counter()
    nbytes = 0
    for i in order[:records].tolist():
        nbytes += len(reader.read(i))
    dt = time.perf_counter() - t
    reader.close()
    return records / dt, nbytes / dt / 1e6


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
    args = ap.parse_args()

    tmp = None
    if args.data is None:
        tmp = Path(tempfile.mkdtemp(prefix="packer-bench-"))
        t = time.perf_counter()
        args.data = make_dataset(tmp, args.images)
        print(f"built {args.images}-image dataset in {time.perf_counter() - t:.1f} s: {args.data}")
    try:
        reader = ShardReader(args.data)
        n, shards = len(reader), [str(p) for p in reader.paths]
        size = sum(os.path.getsize(p) for p in shards)
        records = min(args.records or n, n)
        print(f"{n} records, {size / 1e6:.0f} MB in {len(shards)} shard(s); reading {records} per order")
        block = {"block_size": args.block_size, "window": args.window}
        orders = {"random": global_order(n, seed=0),
                  f"block {args.block_size}x{args.window}": global_order(n, seed=0, order="block", **block),
                  f"block {args.block_size}x1": global_order(n, seed=0, order="block",
                                                            block_size=args.block_size, window=1),
                  "sequential": global_order(n, shuffle=False)}
        rates = {name: [] for name in orders}
        for rep in range(args.repeat):  # interleaved, so drift on a shared machine hits all alike
            for name, order in orders.items():
                how = drop_cache(shards, args.drop_all_caches)
                cold = resident(shards)
                rate, mbs = read_pass(args.data, order, records)
                rates[name].append(rate)
                print(f"{name:>16}: {rate:8.0f} records/s {mbs:7.1f} MB/s "
                      f"(cache dropped by {how}: {cold:.0%} resident before)")
        best = {name: max(r) for name, r in rates.items()}
        print("best of", args.repeat, ":", ", ".join(f"{k} {v:.0f}/s" for k, v in best.items()))
        for name in list(orders)[1:]:
            print(f"{name} / random = {best[name] / best['random']:.2f}x")

        from torch.utils.data import DataLoader
        from packer.dataset import PackedDataset
        dataset = PackedDataset(args.data)
        state = {"seed": 0, "epoch": 0, "consumed": int(0.9 * n), "size": n}
        drop_cache(shards, args.drop_all_caches)
        t = time.perf_counter()
        sampler = PackedSampler(dataset, seed=0)
        sampler.load_state_dict(state)
        batch = next(iter(DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                     collate_fn=list)))
        dt = time.perf_counter() - t
        print(f"resume at 90% of the epoch: load_state_dict + first batch of {len(batch)} in "
              f"{dt * 1e3:.0f} ms ({len(sampler)} samples left, none read or skipped)")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
