#!/usr/bin/env python3
"""What taking in a GPU-path batch from a DataLoader worker costs the receiving thread: in a
slot of the loader's batch ring (the default), or as a shared block of its own freed by
packer's release thread (PACKER_BATCH_RING=0) or where it is dropped (and
PACKER_SHM_RELEASE=0); and freeing one block of shared memory against copying it.

Makes --images photo-like JPEGs (~500x375, from packer's shipped photos), packs them, then in
--rounds rounds, each variant in a fresh process (order alternating): ``make_gpu_loader(root,
--batch, num_workers=--workers, pin_memory=False)`` for --epochs passes after one warm-up
pass, each batch dropped at once; reports the main thread's CPU time per batch (it receives,
maps and drops each batch: the DataLoader's pin thread does the same on a GPU machine).
Then, in this process: a block of --block-mib of shared memory, written, copied into a
buffer (as pinning does) and freed, the two timed (median of 40).

    python3 benchmarks/bench_shm_release.py --images 1536 --rounds 3
    python3 benchmarks/bench_shm_release.py --images 1536 --rounds 3 --context forkserver
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(root: str, batch: int, workers: int, epochs: int, context=None) -> dict:
    from packer.gpu import make_gpu_loader
    loader = make_gpu_loader(root, batch, num_workers=workers, pin_memory=False, drop_last=True,
                             multiprocessing_context=context)
    for b in loader:  # warm-up: workers started, first blocks mapped
        del b
    n, c0, t0 = 0, time.thread_time(), time.perf_counter()
    for _ in range(epochs):
        for b in loader:
            n += 1
            del b
    return {"batches": n, "cpu_ms": 1e3 * (time.thread_time() - c0) / n,
            "wall_ms": 1e3 * (time.perf_counter() - t0) / n}


def free_vs_copy(mib: int, repeats: int = 40) -> dict:
    import torch
    from packer.loading.torchapi import shared_empty
    n = mib << 20
    dst = torch.ones(n, dtype=torch.uint8)
    copy, free = [], []
    for _ in range(repeats):
        block = shared_empty((n,))
        block.fill_(7)
        t0 = time.perf_counter()
        dst.copy_(block)
        t1 = time.perf_counter()
        del block
        t2 = time.perf_counter()
        copy.append(t1 - t0)
        free.append(t2 - t1)
    return {"mib": mib, "copy_ms": 1e3 * statistics.median(copy),
            "free_ms": 1e3 * statistics.median(free)}


def make_data(a) -> Path:
    from packer import build
    from packer.demo import make_image_folder
    root = Path(a.root)
    packed = root / f"packed-{a.images}"
    if not (packed / "manifest.json").exists():
        make_image_folder(root / f"src-{a.images}", images=a.images, classes=4, seed=1)
        build(root / f"src-{a.images}", packed, progress=False)
    return packed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=1536)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block-mib", type=int, default=17, help="block size for free vs copy")
    p.add_argument("--context", choices=["fork", "spawn", "forkserver"],
                   help="how the workers start (default: make_loader's choice)")
    p.add_argument("--root", default="/tmp/packer-shm-release")
    p.add_argument("--out", default=os.environ.get("OUT") or "shm-release-out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.batch, a.workers, a.epochs, a.context)))
        return 0
    packed = str(make_data(a))
    runs: dict = {"ring": [], "release": [], "norel": []}
    envs = {"ring": {}, "release": {"PACKER_BATCH_RING": "0"},
            "norel": {"PACKER_BATCH_RING": "0", "PACKER_SHM_RELEASE": "0"}}
    for r in range(a.rounds):
        names = list(runs)
        for name in names[r % 3:] + names[:r % 3]:  # the order rotated each round
            env = {**os.environ, "PACKER_BATCH_RING": "1", "PACKER_SHM_RELEASE": "1", **envs[name]}
            cmd = [sys.executable, __file__, "--child", packed, "--batch", str(a.batch),
                   "--workers", str(a.workers), "--epochs", str(a.epochs)]
            cmd += ["--context", a.context] if a.context else []
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {k: statistics.median(x["cpu_ms"] for x in v) for k, v in runs.items()}
    blocks = free_vs_copy(a.block_mib)
    lines = ["| batch arrives | receiving thread CPU ms a batch (rounds) | median |", "|---|---|---:|"]
    for k, label in (("norel", "own block, freed by the thread that drops it"),
                     ("release", "own block, freed by packer's release thread"),
                     ("ring", "in a slot of the batch ring")):
        rounds = " / ".join(f"{x['cpu_ms']:.2f}" for x in runs[k])
        lines.append(f"| {label} | {rounds} | {summary[k]:.2f} |")
    lines.append(f"\none {blocks['mib']} MiB shared block: copy {blocks['copy_ms']:.2f} ms, "
                 f"free {blocks['free_ms']:.2f} ms (medians of 40)")
    text = "\n".join(lines)
    print(text)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(
        {"args": vars(a), "runs": runs, "median_cpu_ms": summary, "block": blocks}, indent=1))
    (out_dir / "results.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
