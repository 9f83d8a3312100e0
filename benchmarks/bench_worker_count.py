#!/usr/bin/env python3
"""Which loader worker count feeds a DDP run best: scripts/train_example.py under torchrun with
each --workers value in turn, a fresh run per value, the order rotated each round.

Every run trains --epochs epochs of --data (a packed ImageFolder) on --ranks processes and
prints train_example's ``RESULT images_per_s=...`` (global images/s over each epoch's steps
after its start-up steps). ``default`` runs without --workers: ``default_num_workers()``
(with several ranks on a host: its cores / ranks, less one per rank). One table out: median, each
round, and the ratio to ``default`` per round and of the medians.

    python3 benchmarks/bench_worker_count.py --make 20000 --data /tmp/wc --ranks 2 \\
        --workers default,15 --rounds 3 --epochs 4    # 2 GPUs, 32 cores: 16 vs 15 per rank
    python3 benchmarks/bench_worker_count.py --data /tmp/wc --ranks 2 --cpu --workers 1,2 \\
        --make 64 --rounds 1 --epochs 1 --extra "--model tiny --image-size 32 --batch-size 8"
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent / "scripts" / "train_example.py"


def make_data(n: int, data: Path) -> None:
    """n photo JPEGs (n // 16 classes, 2 to 100), packed into ``data``."""
    from packer import build
    from packer.demo import make_image_folder
    src = data.with_name(data.name + "-src")
    make_image_folder(src, images=n, classes=min(100, max(2, n // 16)), workers=os.cpu_count())
    build(src, data, progress=False)


def run(a, workers: str) -> float:
    """One torchrun of train_example; its global images/s."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={a.ranks}", str(TRAIN), "--data", a.data, "--epochs", str(a.epochs),
           "--amp", "none" if a.cpu else "bf16", *shlex.split(a.extra)]
    cmd += ["--cpu"] if a.cpu else ["--channels-last"]
    cmd += [] if workers == "default" else ["--workers", workers]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    m = re.search(r"RESULT images_per_s=([\d.]+)", p.stdout)
    if p.returncode or m is None:
        raise SystemExit(f"workers={workers}: exit {p.returncode}\n{(p.stdout + p.stderr)[-3000:]}")
    return float(m[1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="packed dataset (made with --make if missing)")
    p.add_argument("--make", type=int, default=20_000, help="images to make when --data is missing")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--workers", default="default,15", help="comma list: counts per rank, or default")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (a dry run of the benchmark)")
    p.add_argument("--extra", default="--model resnet50", help="more train_example options")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--json", help="write the rates here")
    a = p.parse_args(argv)
    if not Path(a.data, "manifest.json").exists():
        make_data(a.make, Path(a.data))
    names = a.workers.split(",")
    rates = {w: [] for w in names}
    for k in range(a.rounds):
        for w in names[k % len(names):] + names[:k % len(names)]:
            rates[w].append(run(a, w))
            print(f"round {k + 1} workers={w}: {rates[w][-1]:,.0f} images/s", flush=True)
    base = rates[names[0]]
    print(f"\n{a.ranks} ranks, {os.cpu_count()} cores, {a.epochs} epochs of {a.data}; "
          f"ratios to workers={names[0]}\n\n| workers per rank | median images/s | rounds | "
          f"x per round | x (medians) |\n|---|---:|---|---|---:|")
    for w, r in rates.items():
        print(f"| {w} | {statistics.median(r):,.0f} | {' / '.join(f'{x:,.0f}' for x in r)} | "
              f"{' / '.join(f'{x / y:.3f}' for x, y in zip(r, base))} | "
              f"{statistics.median(r) / statistics.median(base):.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rates": rates}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
