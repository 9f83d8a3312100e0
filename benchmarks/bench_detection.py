#!/usr/bin/env python3
"""Detection input: the packed loader against a COCO folder loader, build cost of the
annotations, and (with CUDA and torchvision) a detection model fed by each path.

Makes --images photo scenes with COCO boxes in a temporary folder (under --root), builds
them once with --coco, and runs the sections asked for (all but --slow-disk by default)
in --rounds interleaved rounds; prints a markdown table of medians and ratios against the
baseline of each section, measured in the same run:

  --cpu        DataLoader images/s, warm page cache: packed vs torchvision's CocoDetection
               (CocoFolderDataset without torchvision/pycocotools), both letterboxing to
               --size with boxes moved, same workers and batch
  --slow-disk  the same from a cold cache under a block-I/O throttle (400 IOPS, 100 MiB/s;
               root and a cgroup needed, data on a block device: --root), packed in block
               order, the folder in random order
  --build      build images/s with --coco vs a --list of the same images (label 0)
  --gpu        an SSDlite320 training step fed by the CPU path and by GPUDecoder, as a
               fraction of the step on a resident batch; GPUDecoder's rate alone

    python benchmarks/bench_detection.py                       # cpu, build, gpu (if CUDA)
    python benchmarks/bench_detection.py --cpu --images 2000 --rounds 5 --json det.json
    sudo python benchmarks/bench_detection.py --slow-disk --root /mnt/disk/tmp

The measurement is ``benchlib.detection``.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from benchlib.detection import DetectionBenchOptions, bench_detection, detection_table, write_json


def main(argv=None) -> int:
    d = DetectionBenchOptions()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("cpu", "slow-disk", "build", "gpu"):
        ap.add_argument(f"--{name}", action="store_true", help=f"run the {name} section")
    ap.add_argument("--images", type=int, default=d.images, help="scenes to make")
    ap.add_argument("--workers", type=int, default=d.workers, help="loader and build workers")
    ap.add_argument("--rounds", type=int, default=d.rounds, help="interleaved rounds")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="CPU loaders' batch")
    ap.add_argument("--size", type=int, default=d.size, help="CPU loaders' letterbox size")
    ap.add_argument("--gpu-batch", type=int, default=d.gpu_batch)
    ap.add_argument("--gpu-size", type=int, default=d.gpu_size, help="SSDlite's input")
    ap.add_argument("--steps", type=int, default=d.steps, help="gpu: timed steps per round")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="gpu: untimed steps first")
    ap.add_argument("--decode-threads", type=int, help="gpu: GPUDecoder's decode threads "
                    "(default: GPUOptions' default)")
    ap.add_argument("--root", help="data folder; --slow-disk throttles its disk")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    chosen = [s for s in ("cpu", "slow-disk", "build", "gpu") if getattr(args, s.replace("-", "_"))]
    opts = DetectionBenchOptions(images=args.images, workers=args.workers, rounds=args.rounds,
                                 batch_size=args.batch_size, size=args.size,
                                 gpu_batch=args.gpu_batch, gpu_size=args.gpu_size,
                                 steps=args.steps, warmup=args.warmup, root=args.root,
                                 decode_threads=args.decode_threads)
    out = bench_detection(chosen or ["cpu", "build", "gpu"], opts)
    print("\n" + detection_table(out))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    if args.json:
        write_json(out, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
