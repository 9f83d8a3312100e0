#!/usr/bin/env python3
"""Where the GPU augment's time goes (GPU machine): torch.profiler over the batched crop +
resize of decoded stored-size batches, host and device time per op, and the padded sizes.

    python3 scripts/profile_gpu_augment.py --data /tmp/packer-gpu-bench/stored
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from packer.gpu_decode import GPUDecoder, make_gpu_loader  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--batches", type=int, default=8)
    a = p.parse_args()
    loader = make_gpu_loader(a.data, 256, num_workers=8, drop_last=True)
    g = GPUDecoder(loader, overlap=0, seed=0)
    batches = []
    for b in loader:
        batches.append(g._decode(b))
        if len(batches) == a.batches:
            break
    for item in batches:
        imgs = item[0]
        if hasattr(imgs, "groups"):
            print("groups", [tuple(t.shape) for t in imgs.groups])
    for _ in range(2):
        for item in batches:
            g._augment(item, 0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for item in batches:
        g._augment(item, 0)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    print(f"augment: host {1e3 * host / len(batches):.2f} ms/batch, with GPU {1e3 * total / len(batches):.2f} ms/batch")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for item in batches:
            g._augment(item, 0)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
