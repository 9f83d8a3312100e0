"""What ``benchmarks/bench_order.py`` measures: random vs block order read throughput from a
cold page cache, and the time to resume at 90% of an epoch.

``bench_order`` reads the same records of a packed dataset in four orders (random, block
order with and without a window, sequential), interleaved repeat after repeat, each pass
after dropping the page cache (``coldread.drop_page_cache``) and, when asked and possible,
in a fresh process under a block-I/O throttle (``coldread.SlowDisk``); then it times
``PackedSampler.load_state_dict`` + the first batch at 90%. ``order_report`` prints it.

torch (sampler, dataset) is imported where it is used: a throttled pass runs ``read_pass``
in a fresh process, which imports this module and should start fast.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from packer.errors import PackerError
from packer.reading.reader import ShardReader
from packer.bench.coldread import drop_page_cache
from benchlib.slowdisk import SlowDisk, resident, whole_disk

__all__ = ["OrderOptions", "bench_order", "make_dataset", "order_report", "orders", "read_pass",
           "time_resume"]

Log = Callable[[str], None]


@dataclass(frozen=True)
class OrderOptions:
    """What ``bench_order`` reads and how (``benchmarks/bench_order.py``'s options)."""
    images: int = 2000          # images in the dataset built when none is given
    records: int = 0            # records read per order (0: all)
    block_size: int = 32        # records per block (PackedSampler's default, 256, suits >100k)
    window: int = 4             # blocks mixed together (PackedSampler's default: 16)
    repeat: int = 2             # passes per order (the best is reported)
    batch_size: int = 64        # the first batch after resuming
    drop_all_caches: bool = False  # as root: drop the whole page cache, not only the dataset's
    throttle: Optional[bool] = None  # None: throttle when root and a cgroup allow it
    iops: int = 400
    bps: int = 100 << 20
    workers: int = 2            # build workers for the dataset made when none is given


def make_dataset(root: Path, images: int, workers: int = 2) -> Path:
    """A packed dataset of ``images`` realistic JPEGs (64 distinct ones, repeated: speed only)."""
    from packer.writing.builder import build
    from packer.demo import make_image_folder
    unique = make_image_folder(root / "unique", images=min(64, images), classes=8,
                               workers=max(1, workers))
    files = sorted(unique.rglob("*.jpg"))
    for i in range(images):
        dst = root / "src" / f"class_{i % 8:02d}" / f"img_{i:05d}.jpg"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(files[i % len(files)], dst)
    build(root / "src", root / "packed", workers=workers, progress=False)
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


def orders(n: int, records: int, block_size: int, window: int) -> Dict[str, List[int]]:
    """The first ``records`` of each order of ``n`` records (seed 0), by name."""
    from packer.reading.sampler import global_order
    out = {"random": global_order(n, seed=0),
           f"block {block_size}x{window}": global_order(n, seed=0, order="block",
                                                        block_size=block_size, window=window),
           f"block {block_size}x1": global_order(n, seed=0, order="block",
                                                 block_size=block_size, window=1),
           "sequential": global_order(n, shuffle=False)}
    return {name: order[:records].tolist() for name, order in out.items()}


def bench_order(data: Optional[os.PathLike], opts: OrderOptions = OrderOptions(),
                log: Log = print) -> dict:
    """Everything ``benchmarks/bench_order.py`` reports, for the packed dataset ``data`` (None:
    one of ``opts.images`` images built in a temporary folder, removed at the end).

    Returns ``records`` (in the dataset), ``read`` (per order), ``shards``, ``bytes``,
    ``disk``, ``throttle`` (what is in force), ``throttled``, ``repeat``, ``passes``
    (order name -> [(records/s, MB/s, resident fraction before)] per pass), ``best`` (the
    fastest pass of each order) and ``resume`` (see ``time_resume``). Raises
    ``PackerError`` when ``opts.throttle`` is True and no throttle can be set up.
    """
    tmp = None if data is not None else Path(tempfile.mkdtemp(prefix="packer-bench-"))
    disk = SlowDisk(data or tmp, opts.iops, opts.bps) if opts.throttle is not False else None
    try:
        if opts.throttle and not disk.throttled:
            raise PackerError(f"--throttle: {disk.how}")
        if data is None:
            t = time.perf_counter()
            data = make_dataset(tmp, opts.images, opts.workers)
            log(f"built {opts.images}-image dataset in {time.perf_counter() - t:.1f} s: {data}")
        return _measure(Path(data), disk, opts, log)
    finally:
        if disk is not None:
            disk.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _measure(data: Path, disk: Optional[SlowDisk], opts: OrderOptions, log: Log) -> dict:
    reader = ShardReader(data)
    n, shards = len(reader), [str(p) for p in reader.paths]
    reader.close()
    size = sum(os.path.getsize(p) for p in shards)
    records = min(opts.records or n, n)
    throttled = disk is not None and disk.throttled
    how = disk.how if disk is not None else "no throttle (--no-throttle)"
    log(f"{n} records, {size / 1e6:.0f} MB in {len(shards)} shard(s); reading {records} per order")
    log(f"disk: {whole_disk(data)[1]}; {how}")
    passes: Dict[str, List[Tuple[float, float, float]]] = {}
    todo = orders(n, records, opts.block_size, opts.window)
    for _ in range(opts.repeat):  # interleaved, so drift on a shared machine hits all alike
        for name, order in todo.items():
            cache = drop_page_cache(shards, everything=opts.drop_all_caches)
            cold = resident(shards)
            if throttled:  # a fresh process in the throttled cgroup
                rate, mbs = disk.run(read_pass, str(data), order)
            else:
                rate, mbs = read_pass(str(data), order)
            passes.setdefault(name, []).append((rate, mbs, cold))
            log(f"{name:>16}: {rate:8.0f} records/s {mbs:7.1f} MB/s "
                f"(page cache: {cache}, {cold:.0%} resident before)")
    return {"records": n, "read": records, "shards": len(shards), "bytes": size,
            "disk": whole_disk(data)[1], "throttle": how, "throttled": throttled,
            "repeat": opts.repeat, "passes": passes,
            "best": {name: max(p) for name, p in passes.items()},
            "resume": time_resume(data, shards, opts.batch_size, opts.drop_all_caches)}


def time_resume(data: Path, shards: List[str], batch_size: int, drop_all: bool) -> dict:
    """``PackedSampler.load_state_dict`` at 90% of the epoch and the first batch of a
    DataLoader over it, from a cold page cache: ``ms``, ``batch`` (its length) and ``left``
    (samples left in the epoch)."""
    from torch.utils.data import DataLoader

    from packer.reading.dataset import PackedDataset
    from packer.reading.sampler import PackedSampler
    dataset = PackedDataset(data)
    n = len(dataset)
    state = {"seed": 0, "epoch": 0, "consumed": int(0.9 * n), "size": n}
    drop_page_cache(shards, everything=drop_all)
    t = time.perf_counter()
    sampler = PackedSampler(dataset, seed=0)
    sampler.load_state_dict(state)
    batch = next(iter(DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                 collate_fn=list)))
    return {"ms": (time.perf_counter() - t) * 1e3, "batch": len(batch), "left": len(sampler)}


def order_report(result: dict) -> str:
    """``bench_order``'s result: the table of the best pass per order, and the resume time."""
    best, random = result["best"], result["best"]["random"][0]
    lines = [f"best of {result['repeat']} passes per order:\n",
             "| order | records/s | MB/s | vs random | resident before |", "|---|---|---|---|---|"]
    for name, (rate, mbs, cold) in best.items():
        lines.append(f"| {name} | {rate:,.0f} | {mbs:,.1f} | {rate / random:.2f}x | {cold:.0%} |")
    r = result["resume"]
    lines.append(f"\nresume at 90% of the epoch: load_state_dict + first batch of {r['batch']} in "
                 f"{r['ms']:.0f} ms ({r['left']} samples left, none read or skipped"
                 f"{'; not throttled' if result['throttled'] else ''})")
    return "\n".join(lines)
