#!/usr/bin/env python3
"""Random reads from shards staged in RAM vs shards on disk vs the image folder, cold cache.

Each variant reads the same records (the same random order) in a fresh process after
``sync; echo 3 > /proc/sys/vm/drop_caches``, so disk reads are real reads, not page-cache
hits; only bytes are read (no decoding), which is the part staging changes:

    folder       open() + read() of each image file of the ImageFolder tree
    shards/disk  ShardReader(DST).read(i), the packed dataset on disk
    shards/RAM   ShardReader(/dev/shm/...).read(i), after `packer stage` (also timed)

A fast local SSD hides most of the difference, so by default the reading processes also run
under a block-I/O throttle like a modest network or cloud disk (400 read IOPS, 100 MiB/s):
cgroup v1 ``blkio.throttle.read_{iops,bps}_device`` where mounted, else cgroup v2
``io.max``, else none (said in the output). Needs root for dropping caches and the throttle.

    sudo python scripts/bench_stage.py                 # makes 2,000 photo JPEGs in --workdir
    sudo python scripts/bench_stage.py --src DIR --records 500 --no-throttle
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional, Tuple

CGROUP_V1 = Path("/sys/fs/cgroup/blkio")


# -- the reading child -----------------------------------------------------------------------

def child(spec: dict) -> dict:
    """Runs in a fresh process: join the throttled cgroup, then time the reads."""
    if spec.get("cgroup_procs"):
        Path(spec["cgroup_procs"]).write_text(str(os.getpid()))
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


def run_child(spec: dict) -> dict:
    drop_caches()
    out = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(spec),
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{spec['variant']} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- cold cache and throttle -----------------------------------------------------------------

def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def whole_disk(path: Path) -> Tuple[Optional[str], str]:
    """MAJ:MIN of the disk holding ``path`` (the whole disk, not a partition), and its name."""
    st = os.stat(path)
    majmin = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / majmin
    if not sys_dev.exists():  # overlayfs, tmpfs, NFS...: no block device to throttle
        return None, f"device {majmin} (not a block device)"
    real = sys_dev.resolve()
    if (real / "partition").exists():
        real = real.parent
        majmin = (real / "dev").read_text().strip()
    return majmin, f"/dev/{real.name} ({majmin})"


class IoGroup:
    """A cgroup for the reading processes: limits their reads from one disk (``limit``) and
    counts them. ``procs`` is the file a process writes its pid to, to join; None if no
    cgroup could be made (``why`` says why)."""

    def __init__(self, majmin: str, iops: int, bps: int, limit: bool):
        self.majmin = majmin
        self.path: Optional[Path] = None
        self.procs: Optional[str] = None
        self.counter: Optional[str] = None  # file with this group's completed reads
        self.how, self.why = "none", ""
        name = f"packer-bench-{uuid.uuid4().hex[:8]}"
        if CGROUP_V1.is_dir() and (CGROUP_V1 / "blkio.throttle.read_iops_device").exists():
            cg = CGROUP_V1 / name
            try:
                cg.mkdir()
                if limit:
                    (cg / "blkio.throttle.read_iops_device").write_text(f"{majmin} {iops}\n")
                    (cg / "blkio.throttle.read_bps_device").write_text(f"{majmin} {bps}\n")
            except OSError as e:
                self._rmdir(cg)
                self.why = f"cgroup v1 blkio present but not usable ({e})"
            else:
                self.path, self.procs = cg, str(cg / "cgroup.procs")
                self.counter = f"v1:{cg / 'blkio.throttle.io_serviced'}"
                self.how = (f"cgroup v1 blkio.throttle: {majmin} {iops} read IOPS, {bps} read B/s"
                            if limit else "no throttle (--no-throttle)")
                return
        else:
            self.why = "no cgroup v1 blkio controller mounted"
        v2 = _cgroup2_root()
        if v2 is not None and "io" in (v2 / "cgroup.controllers").read_text().split():
            cg = v2 / name
            try:
                if "io" not in (v2 / "cgroup.subtree_control").read_text().split():
                    (v2 / "cgroup.subtree_control").write_text("+io\n")
                cg.mkdir()
                if limit:
                    (cg / "io.max").write_text(f"{majmin} riops={iops} rbps={bps}\n")
            except OSError as e:
                self._rmdir(cg)
                self.why += f"; cgroup v2 io.max not usable ({e})"
            else:
                self.path, self.procs = cg, str(cg / "cgroup.procs")
                self.counter = f"v2:{cg / 'io.stat'}"
                self.how = (f"cgroup v2 io.max: {majmin} riops={iops} rbps={bps}"
                            if limit else "no throttle (--no-throttle)")
                return
        else:
            self.why += "; no cgroup v2 with the io controller"

    @staticmethod
    def _rmdir(cg: Path) -> None:
        try:
            cg.rmdir()
        except OSError:
            pass

    def close(self) -> None:
        if self.path is not None:
            self._rmdir(self.path)


def read_count(counter: Optional[str], majmin: Optional[str]) -> Optional[int]:
    """Reads from ``majmin`` completed so far: by the cgroup (``v1:``/``v2:`` files) or, for
    ``disk:`` (no cgroup), by the whole disk, other processes included."""
    if not counter or not majmin:
        return None
    kind, _, path = counter.partition(":")
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split()
        if kind == "v1" and len(f) == 3 and f[0] == majmin and f[1] == "Read":
            return int(f[2])
        if kind == "v2" and f and f[0] == majmin:
            return int(dict(x.split("=", 1) for x in f[1:] if "=" in x).get("rios", 0))
    if kind == "disk":
        return int(text.split()[0])
    return 0 if kind in ("v1", "v2") else None


def _cgroup2_root() -> Optional[Path]:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 3 and fields[2] == "cgroup2":
                return Path(fields[1])
    return None


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
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # spec on stdin
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(sys.stdin.read()))))
        return 0

    from packer.build import build
    from packer.demo import make_image_folder
    from packer.format import read_manifest
    from packer.source import scan_folder
    from packer.stage import fs_type, unstage

    root = os.geteuid() == 0
    if not root:
        print("warning: not root: caches cannot be dropped and no throttle is possible; the "
              "disk numbers below are page-cache (warm) numbers", file=sys.stderr)
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

    disk, disk_name = whole_disk(packed)
    src_disk, _ = whole_disk(src)
    group = None
    note = "no throttle (--no-throttle)" if args.no_throttle else "no throttle"
    counter = None
    if not root:
        note += " (not root)"
    elif disk is None:
        note = f"no throttle: {packed} is on {disk_name}"
    else:
        group = IoGroup(disk, args.iops, args.bps, limit=not args.no_throttle)
        if group.procs:
            note, counter = group.how, group.counter
        else:
            note += f": {group.why}"
        if group.procs and not args.no_throttle and src_disk != disk:
            note += f" (warning: {src} is on another device, {src_disk}, not throttled)"
    procs = group.procs if group else None
    if counter is None and disk is not None:
        counter = f"disk:/sys/dev/block/{disk}/stat"
    io = {"order": order, "counter": counter, "majmin": disk, "cgroup_procs": procs}
    target = args.shm / f"packer-bench-{uuid.uuid4().hex[:8]}"
    results = {}
    try:
        results["stage"] = run_child({"variant": "stage", "path": str(packed), "target": str(target),
                                      "cgroup_procs": procs})
        results["folder"] = run_child(dict(io, variant="folder", files=files))
        results["shards/disk"] = run_child(dict(io, variant="disk", path=str(packed)))
        results["shards/RAM"] = run_child(dict(io, variant="shm", path=str(target)))
    finally:
        if target.exists():
            unstage(target)
        if group is not None:
            group.close()

    mb = sum(f["bytes"] for f in man["shards"]) / 1e6
    print(f"\n{n} images ({mb:.0f} MB packed, {len(man['shards'])} shard(s)), {len(order)} read "
          f"per variant in random order, cold page cache: {'yes' if root else 'NO (not root)'}")
    print(f"disk: {disk_name} ({fs_type(packed)}), RAM: {args.shm} ({fs_type(args.shm)}); {note}")
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
