#!/usr/bin/env python3
"""Does BatchPool earn its keep? make_loader's images/s with its default collate (batches in
the workers' reused BatchPool slots) against the same loader with a fresh shared block per
batch (``collate_fn=functools.partial(collate_uint8)``), each variant in a fresh process,
the order alternating round by round; the consumer copies each batch into one preallocated
buffer, as the pin-memory thread does. Ratio = pool / fresh of the same round, of images/s
(wall clock) and of images per CPU second (workers and main process, from /proc: what the
same cores give when nothing else runs on them; the wall-clock rate swings with whatever
else the machine runs).

    python benchmarks/bench_batchpool.py --data DST --batch-sizes 64,128,256 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def cpu_seconds(pids) -> float:
    """user + system CPU seconds of this process and of ``pids`` so far."""
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def one(data: str, variant: str, batch_size: int, workers: int, batches: int):
    """(images/s, images per CPU second) after the first wave of batches."""
    import functools
    import multiprocessing
    import torch
    from packer import DecodeRandomResizedCrop, PackedDataset, PackedSampler, make_loader
    from packer.loading import collate_uint8
    ds = PackedDataset(data, decode=DecodeRandomResizedCrop(224))
    kw = {"collate_fn": functools.partial(collate_uint8)} if variant == "fresh" else {}
    sampler = PackedSampler(ds, seed=0)
    loader = make_loader(ds, batch_size, sampler=sampler, num_workers=workers,
                         pin_memory=False, **kw)
    buf = torch.empty(batch_size, 3, 224, 224, dtype=torch.uint8).contiguous(
        memory_format=torch.channels_last)
    got, epoch, images = 0, 0, 0
    while got < batches + workers:
        sampler.set_epoch(epoch)
        for x, _ in loader:
            buf[:len(x)].copy_(x)  # what the pin-memory thread does with each batch
            got += 1
            if got == workers:  # the first wave arrives together after start-up
                pids = [p.pid for p in multiprocessing.active_children()]
                t0, c0 = time.perf_counter(), cpu_seconds(pids)
            elif got > workers:
                images += len(x)
            if got == batches + workers:
                break
        epoch += 1
    return images / (time.perf_counter() - t0), images / (cpu_seconds(pids) - c0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch-sizes", default="64,128,256")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--images", type=int, default=2048, help="images timed per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        b = int(args.one[1])
        print(json.dumps(one(args.data, args.one[0], b, args.workers, args.images // b)))
        return 0
    rows = []
    for b in map(int, args.batch_sizes.split(",")):
        wall, cpu = [], []
        for r in range(args.rounds):
            rate = {}
            for v in (("pool", "fresh") if r % 2 == 0 else ("fresh", "pool")):
                out = subprocess.run([sys.executable, __file__, "--data", args.data, "--workers",
                                      str(args.workers), "--images", str(args.images),
                                      "--one", v, str(b)], capture_output=True, text=True,
                                     check=True)
                rate[v] = json.loads(out.stdout.strip().splitlines()[-1])
            wall.append(rate["pool"][0] / rate["fresh"][0])
            cpu.append(rate["pool"][1] / rate["fresh"][1])
            print(f"batch {b} round {r + 1}: pool {rate['pool'][0]:.1f}/s "
                  f"({rate['pool'][1]:.1f} per CPU s), fresh {rate['fresh'][0]:.1f}/s "
                  f"({rate['fresh'][1]:.1f} per CPU s); ratios {wall[-1]:.3f}, {cpu[-1]:.3f}",
                  flush=True)
        rows.append(f"| {b} | {statistics.median(wall):.3f} ({min(wall):.3f}-{max(wall):.3f}) "
                    f"| {statistics.median(cpu):.3f} ({min(cpu):.3f}-{max(cpu):.3f}) |")
    print("\n| batch | pool / fresh, images/s | pool / fresh, images per CPU second |\n"
          "|---:|---|---|\n" + "\n".join(rows))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
