#!/usr/bin/env python3
"""The wait at every epoch boundary: a plain DataLoader, epoch by epoch, against
make_loader(ds, B), whose workers run on into the next epoch.

A fixed wait per batch stands in for the training step (set a little longer than the loader
needs per batch, so a perfect loader is never waited on), or with --cuda MODEL a real
training step on the GPU fed through CUDAPrefetcher, against the same step on a resident
batch; several epochs run with set_epoch,
and the table shows the fraction of the ideal speed kept, the wait for each epoch's first
batch and the median wait for the others. The measurement is ``benchlib.figures.bench_epochs``.

    python benchmarks/bench_epochs.py                  # makes 1,000 photo JPEGs and packs them
    python benchmarks/bench_epochs.py --data DST --rounds 7
    python benchmarks/bench_epochs.py --cuda resnet50 --images 10000 --batch-size 256 --rounds 3
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchlib.figures import packed_photos
from benchlib.figures import bench_epochs, epochs_table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, help="a packed dataset (default: make --images and pack)")
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=None, help="default: the usable cores")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cuda", metavar="MODEL", default="",
                    help="train MODEL (e.g. resnet50) on the GPU as the step (default workers: "
                         "make_loader's)")
    args = ap.parse_args(argv)
    with packed_photos(args.data, args.images) as data:
        res = bench_epochs(data, batch_size=args.batch_size, workers=args.workers,
                           epochs=args.epochs, rounds=args.rounds,
                           cuda_model=args.cuda)
    print("\n" + epochs_table(res))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
