#!/usr/bin/env python3
"""Does BatchPool earn its keep? make_loader's images/s with its default collate (batches in
the workers' reused BatchPool slots) against the same loader with a fresh shared block per
batch (``collate_fn=functools.partial(collate_uint8)``, torch's way).

Each round starts both variants at once, each in a fresh process with its own workers, and
times the batches each one's training loop receives in the same wall-clock window (after a
warm-up): whatever else the machine runs slows both alike, and so the ratio holds even on a
busy machine; costs that a process's own CPU time does not show (page faults served outside
a virtual machine's view) count too. The loop copies each batch into one preallocated buffer,
as the pin-memory thread does. Ratio = pool / fresh of the round; the median of the rounds.

    python benchmarks/bench_batchpool.py --data DST --batch-sizes 64,128,256 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time


def one(data: str, variant: str, batch_size: int, workers: int, start: float, end: float):
    """images/s in the window [start, end) (``time.time()``): the images of the batches that
    arrived in it after its first, over the time from the first to the last."""
    import functools
    import torch
    from packer import DecodeRandomResizedCrop, PackedDataset, make_loader
    from packer.loading import collate_uint8
    ds = PackedDataset(data, decode=DecodeRandomResizedCrop(224))
    kw = {"collate_fn": functools.partial(collate_uint8)} if variant == "fresh" else {}
    loader = make_loader(ds, batch_size, num_workers=workers, pin_memory=False, **kw)
    buf = torch.empty(batch_size, 3, 224, 224, dtype=torch.uint8).contiguous(
        memory_format=torch.channels_last)
    arrivals = []  # (time, images) in the window
    while time.time() < end:
        for x, _ in loader:
            buf[:len(x)].copy_(x)  # what the pin-memory thread does with each batch
            now = time.time()
            if now >= end:
                break
            if now >= start:
                arrivals.append((now, len(x)))
    if len(arrivals) < 3:
        raise SystemExit(f"{len(arrivals)} batches in the window: give more --seconds or --warm-up")
    return sum(n for _, n in arrivals[1:]) / (arrivals[-1][0] - arrivals[0][0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a packed dataset")
    ap.add_argument("--batch-sizes", default="64,128,256")
    ap.add_argument("--workers", type=int, default=2, help="per variant")
    ap.add_argument("--warm-up", type=float, default=25.0, help="seconds before the window")
    ap.add_argument("--seconds", type=float, default=45.0, help="the window")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", nargs=4, metavar=("VARIANT", "BATCH", "START", "END"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        v, b, start, end = args.one
        print(json.dumps(one(args.data, v, int(b), args.workers, float(start), float(end))))
        return 0
    rows = []
    for b in map(int, args.batch_sizes.split(",")):
        ratios = []
        for r in range(args.rounds):
            start = time.time() + args.warm_up
            window = [str(start), str(start + args.seconds)]
            procs = {v: subprocess.Popen([sys.executable, __file__, "--data", args.data,
                                          "--workers", str(args.workers), "--one", v, str(b),
                                          *window], stdout=subprocess.PIPE, text=True)
                     for v in ("pool", "fresh")}
            rate = {v: json.loads(p.communicate()[0].strip().splitlines()[-1])
                    for v, p in procs.items()}
            ratios.append(rate["pool"] / rate["fresh"])
            print(f"batch {b} round {r + 1}: pool {rate['pool']:.1f}/s, fresh {rate['fresh']:.1f}/s, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        rows.append(f"| {b} | {statistics.median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")
    print("\n| batch | pool / fresh, images/s (median) | spread |\n|---:|---:|---|\n" + "\n".join(rows))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
