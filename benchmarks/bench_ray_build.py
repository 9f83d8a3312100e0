#!/usr/bin/env python3
"""Build rate on Ray (``packer.build(..., engine="ray")``) against the local build, on
this machine's cores, in the same run.

Each build runs in a fresh process, the two variants alternating round by round. ``local``:
``build(workers=CORES)``. ``ray``: a local Ray cluster of CORES CPUs is started first
(timed on its own: on a real cluster it is already up), then the same build with
``engine="ray"``. Both read the same files (read once before the first round, so both see
a warm page cache) and must give the same shards (sha256 compared). Prints a table, the
per-round ratios and the command; ``--json FILE`` writes the numbers.

    python benchmarks/bench_ray_build.py                  # makes 2,000 photo JPEGs in a temp dir
    python benchmarks/bench_ray_build.py --src DIR --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(variant: str, src: Path, dst: Path, cores: int) -> dict:
    """One build in this (fresh) process: its images/s and, for Ray, the cluster's start."""
    import packer
    started = 0.0
    if variant == "ray":
        import ray
        t0 = time.perf_counter()
        ray.init(num_cpus=cores, include_dashboard=False, logging_level="WARNING")
        started = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = packer.build(src, dst, **({"engine": "ray"} if variant == "ray" else {"workers": cores}), progress=False)
    seconds = time.perf_counter() - t0
    m = res.manifest
    return {"variant": variant, "images": m["count"], "seconds": seconds,
            "images_per_s": m["count"] / seconds, "cluster_start_s": started,
            "shards": [s["sha256"] for s in m["shards"]]}


def run_child(variant: str, src: Path, dst: Path, cores: int) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--src", str(src), "--dst", str(dst),
           "--cores", str(cores)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm(src: Path) -> None:
    for p in src.rglob("*"):
        if p.is_file():
            p.read_bytes()


def bench(src: Path, tmp: Path, cores: int, rounds: int, log=print) -> dict:
    warm(src)
    runs = {"local": [], "ray": []}
    starts, ratios, shards = [], [], set()
    for r in range(rounds):
        order = ["local", "ray"] if r % 2 == 0 else ["ray", "local"]
        got = {}
        for variant in order:
            dst = tmp / f"{variant}-{r}"
            got[variant] = res = run_child(variant, src, dst, cores)
            shutil.rmtree(dst)
            runs[variant].append(res["images_per_s"])
            shards.add(tuple(res["shards"]))
            if variant == "ray":
                starts.append(res["cluster_start_s"])
            log(f"round {r + 1}/{rounds}: {variant}: {res['images_per_s']:,.0f} images/s "
                f"({res['images']} images, {len(res['shards'])} shards, {res['seconds']:.2f} s)")
        ratios.append(got["ray"]["images_per_s"] / got["local"]["images_per_s"])
    if len(shards) != 1:
        raise RuntimeError("the Ray build's shards differ from the local build's")
    return {"cores": cores, "rounds": rounds, "images": got["local"]["images"],
            "shards": len(next(iter(shards))), "images_per_s": runs,
            "median_images_per_s": {k: statistics.median(v) for k, v in runs.items()},
            "ratios": ratios, "median_ratio": statistics.median(ratios),
            "cluster_start_s": starts}


def table(res: dict) -> str:
    med = res["median_images_per_s"]
    lines = [f"{res['images']} images, {res['shards']} shards, {res['cores']} cores, "
             f"{res['rounds']} rounds (fresh process per build)",
             "| build | images/s (median) | rounds | vs local |", "|---|---|---|---|"]
    for k in ("local", "ray"):
        vals = ", ".join(f"{v:,.0f}" for v in res["images_per_s"][k])
        lines.append(f"| {k} | {med[k]:,.0f} | {vals} | "
                     f"{'baseline' if k == 'local' else format(res['median_ratio'], '.2f') + 'x'} |")
    lines.append(f"ray / local round by round: {', '.join(f'{x:.2f}' for x in res['ratios'])}; "
                 f"Ray's local cluster start (not in the rate): "
                 f"{statistics.median(res['cluster_start_s']):.1f} s (median)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, help="image folder (default: generate --images JPEGs)")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the numbers here")
    ap.add_argument("--child", choices=["local", "ray"], help=argparse.SUPPRESS)
    ap.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.src, args.dst, args.cores)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        src = args.src
        if src is None:
            from packer.demo import make_image_folder
            src = make_image_folder(Path(tmp) / "src", images=args.images, classes=10,
                                    workers=args.cores)
        res = bench(src, Path(tmp), args.cores, args.rounds)
    print("\n" + table(res))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
