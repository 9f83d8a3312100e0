#!/usr/bin/env python3
"""packer's loader against peer loaders (naive LMDB, WebDataset, LitData, FFCV) over the same
stored JPEG bytes and workers: steady-state images/s, interleaved rounds, packer's rate over
each peer's. All but FFCV apply packer's decode + RandomResizedCrop(224) + flip; FFCV runs
its own compiled RandomResizedCrop pipeline. Peers not installed are listed as skipped (FFCV
builds against OpenCV and libjpeg-turbo: apt-get install libopencv-dev libturbojpeg0-dev
pkg-config, then pip install --no-build-isolation ffcv). The measurement is
``benchlib.peers``.

    python benchmarks/bench_peers.py                      # makes 2,000 photo JPEGs, packs them
    python benchmarks/bench_peers.py --data DST --workers 15 --rounds 7
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from benchlib.figures import packed_photos
from benchlib.peers import bench_peers, peers_table
from packer.loading.loader import default_num_workers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, help="a packed dataset (default: make --images and pack)")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=default_num_workers())
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    with packed_photos(args.data, args.images) as data, \
            tempfile.TemporaryDirectory(prefix="packer-peers-") as tmp:
        res = bench_peers(data, Path(tmp), workers=args.workers, batch_size=args.batch_size,
                          rounds=args.rounds)
    print("\n" + peers_table(res))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
