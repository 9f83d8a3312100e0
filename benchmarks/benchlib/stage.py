"""What ``benchmarks/bench_stage.py`` measures: random reads from shards staged in RAM vs
shards on disk vs the image folder, each from a cold page cache, and the staging itself.

``bench_stage`` runs each variant in a fresh process (``child``, through
``coldread.SlowDisk.run``: in the throttled cgroup when there is one) after evicting the
files it reads from the page cache; only bytes are read (no decoding), which is the part
staging changes. ``stage_report`` prints the result.

Heavy imports (the builder, torch) are made where they are used: every variant starts a
fresh process that imports this module to run ``child``.
"""
from __future__ import annotations

import os
import platform
import random
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from packer._util.system import fs_type
from packer.errors import PackerError
from packer.format.manifest import read_manifest
from packer.bench.coldread import drop_page_cache
from benchlib.slowdisk import SlowDisk, read_count, whole_disk

__all__ = ["StageOptions", "bench_stage", "child", "prepare", "run_child", "stage_report"]

Log = Callable[[str], None]
READERS = ("folder", "shards/disk", "shards/RAM")


@dataclass(frozen=True)
class StageOptions:
    """What ``bench_stage`` reads and how (``benchmarks/bench_stage.py``'s options)."""
    workdir: Optional[Path] = None  # on the disk to measure, kept for reuse (None: a fresh
    #                                 private folder under /var/tmp, removed after the run)
    images: int = 2000            # images made when no source folder is given
    records: int = 0              # records read per variant (0: all)
    shm: Path = Path("/dev/shm")  # where to stage (a tmpfs)
    throttle: bool = True         # False: cold cache only, full disk speed
    iops: int = 400
    bps: int = 100 << 20
    seed: int = 0
    drop_all: bool = True         # as root, drop the whole page cache (else only the files read)
    workers: Optional[int] = None  # for making the folder and building (None: all cores)
    progress: bool = True


# -- the reading child -----------------------------------------------------------------------

def child(spec: dict) -> dict:
    """Runs in a fresh process, in the throttled cgroup (``SlowDisk.run``): time the reads."""
    if spec["variant"] == "stage":
        from packer.staging import stage
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
        from packer.reading.reader import ShardReader
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


def run_child(disk: SlowDisk, spec: dict, evict: List[str], everything: bool = True) -> dict:
    """``child(spec)`` in a fresh process in ``disk``'s cgroup, after evicting ``evict``
    (everything, as root, unless ``everything`` is False) from the page cache."""
    how = drop_page_cache(evict, everything=everything)
    return dict(disk.run(child, spec), cache=how)


# -- the run ---------------------------------------------------------------------------------

def prepare(src: Optional[Path], opts: StageOptions) -> Tuple[Path, Path, List[str]]:
    """(source folder, packed dataset, the folder's image files in record order), made in
    ``opts.workdir`` where missing and kept there for the next run. Raises ``PackerError``
    for a workdir in RAM or a dataset that does not match its folder."""
    from packer.writing.builder import build
    from packer.demo import make_image_folder
    from packer.sources.folder import scan_folder
    opts.workdir.mkdir(parents=True, exist_ok=True)
    if fs_type(opts.workdir) in ("tmpfs", "ramfs"):
        raise PackerError(f"--workdir {opts.workdir} is in RAM ({fs_type(opts.workdir)}); "
                          f"pick a folder on disk")
    if src is None:
        src = opts.workdir / f"folder-{opts.images}"
        if not (src / ".complete").exists():
            shutil.rmtree(src, ignore_errors=True)
            workers = (os.cpu_count() or 1) if opts.workers is None else opts.workers
            make_image_folder(src, images=opts.images, classes=10, workers=workers,
                              progress=opts.progress)
            (src / ".complete").write_text("")
    packed = opts.workdir / f"packed-{Path(src).resolve().name}"
    if not (packed / "manifest.json").exists():
        build(src, packed, workers=opts.workers, progress=opts.progress)
    files = [str(Path(src, rel)) for rel, _ in scan_folder(src).entries]
    count = read_manifest(packed)["count"]
    if count != len(files):
        raise PackerError(f"{packed} holds {count} records for {len(files)} files (skipped "
                          f"images?); remove it to rebuild")
    return Path(src), packed, files


def bench_stage(src: Optional[os.PathLike], opts: StageOptions = StageOptions()) -> dict:
    """Stage, then read the same random records from the folder, the shards on disk and the
    staged shards, each in a fresh process from a cold page cache (see the module).

    Returns ``results`` (variant -> ``seconds``, ``bytes``, ``records``, ``disk_reads``,
    ``cache``; ``stage`` too), ``images``, ``read`` (records per variant), ``packed_mb``,
    ``shards``, ``disk``, ``ram`` (where staged, with its filesystem), ``throttle`` (what
    is in force) and ``cgroup_counter`` (whether disk reads were counted per cgroup).
    """
    if opts.workdir is None:  # never a fixed name: the script runs as root (sudo)
        with tempfile.TemporaryDirectory(prefix="packer-bench-stage-", dir="/var/tmp") as work:
            return bench_stage(src, replace(opts, workdir=Path(work)))
    src, packed, files = prepare(None if src is None else Path(src), opts)
    order = list(range(len(files)))
    random.Random(opts.seed).shuffle(order)
    if opts.records:
        order = order[:opts.records]
    disk = SlowDisk(packed, opts.iops, opts.bps, limit=opts.throttle)
    note = disk.how if opts.throttle else "no throttle (--no-throttle)"
    src_disk, _ = whole_disk(src)
    if disk.throttled and src_disk != disk.majmin:
        note += f" (warning: {src} is on another device, {src_disk}, not throttled)"
    with disk:
        results = _read_variants(disk, packed, files, order, opts)
    man = read_manifest(packed)
    return {"results": results, "images": len(files), "read": len(order),
            "packed_mb": sum(f["bytes"] for f in man["shards"]) / 1e6, "shards": len(man["shards"]),
            "disk": f"{disk.disk} ({fs_type(packed)})", "ram": f"{opts.shm} ({fs_type(opts.shm)})",
            "throttle": note,
            "cgroup_counter": bool(disk.counter) and not disk.counter.startswith("disk:")}


def _read_variants(disk: SlowDisk, packed: Path, files: List[str], order: List[int],
                   opts: StageOptions) -> Dict[str, dict]:
    io = {"order": order, "counter": disk.counter, "majmin": disk.majmin}
    target = opts.shm / f"packer-bench-{uuid.uuid4().hex[:8]}"
    shards = [str(p) for p in packed.rglob("*") if p.is_file()]
    results = {}
    try:
        results["stage"] = run_child(disk, {"variant": "stage", "path": str(packed),
                                            "target": str(target)}, shards, opts.drop_all)
        results["folder"] = run_child(disk, dict(io, variant="folder", files=files), files,
                                      opts.drop_all)
        results["shards/disk"] = run_child(disk, dict(io, variant="disk", path=str(packed)),
                                           shards, opts.drop_all)
        results["shards/RAM"] = run_child(disk, dict(io, variant="shm", path=str(target)),
                                          [str(p) for p in target.rglob("*") if p.is_file()],
                                          opts.drop_all)
    finally:
        if target.exists():
            from packer.staging import unstage
            unstage(target)
    return results


def stage_report(res: dict) -> str:
    """``bench_stage``'s result: what was read where, the table per variant, staging's cost."""
    results = res["results"]
    lines = [f"{res['images']} images ({res['packed_mb']:.0f} MB packed, {res['shards']} shard(s)), "
             f"{res['read']} read per variant in random order, page cache: "
             f"{results['shards/disk']['cache']}",
             f"disk: {res['disk']}, RAM: {res['ram']}; {res['throttle']}",
             f"machine: {platform.node()}, Linux {platform.release()}, {os.cpu_count()} CPUs, "
             f"python {platform.python_version()}",
             "\n| variant | records | seconds | records/s | MB/s | vs folder | disk reads/record |",
             "|---|---|---|---|---|---|---|"]
    base = results["folder"]["records"] / results["folder"]["seconds"]
    for name in READERS:
        r = results[name]
        rate = r["records"] / r["seconds"]
        ios = "?" if r["disk_reads"] is None else f"{r['disk_reads'] / r['records']:.1f}"
        lines.append(f"| {name} | {r['records']} | {r['seconds']:.2f} | {rate:,.0f} | "
                     f"{r['bytes'] / 1e6 / r['seconds']:,.1f} | {rate / base:.1f}x | {ios} |")
    s = results["stage"]
    lines.append(f"\nstaging (one-off, same disk conditions): {s['bytes'] / 1e6:.0f} MB in "
                 f"{s['seconds']:.2f} s ({s['bytes'] / 1e6 / s['seconds']:.0f} MB/s, copy + "
                 f"sha256 check)")
    lines.append("disk reads/record: read requests completed for the reading process (its "
                 "cgroup's counter)" if res["cgroup_counter"] else
                 "disk reads/record: read requests the whole disk completed meanwhile (no "
                 "cgroup: other processes' reads included)")
    return "\n".join(lines)
