#!/usr/bin/env python3
"""Where the GPU augment's time goes (GPU machine): torch.profiler over the batched crop +
resize of decoded stored-size batches: host and device time per op.
The profile lives in benchlib.gpu (profile_augment); this script is its command line.

    python3 benchmarks/profile_gpu_augment.py --data /tmp/packer-gpu-bench/stored
"""
import argparse
import sys

from benchlib.gpu import profile_augment


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a packed set (bench_gpu_decode.py's root/stored)")
    p.add_argument("--batches", type=int, default=8)
    a = p.parse_args(argv)
    return profile_augment(a.data, batches=a.batches)


if __name__ == "__main__":
    sys.exit(main())
