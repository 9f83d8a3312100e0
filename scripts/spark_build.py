#!/usr/bin/env python3
"""A packer build on Spark: each partition of (path, label) rows writes one part with
``packer.write`` (``mapPartitionsWithIndex``), then the driver merges the parts.

    spark-submit scripts/spark_build.py SRC OUT --parts 64
    PYSPARK_PYTHON=$(which python) python scripts/spark_build.py SRC OUT --parts 4 --master 'local[2]'

SRC is an ImageFolder (the driver lists it once, as ``packer build`` does); the partitions
are contiguous runs of its entries, so OUT/train holds the same records in the same order
as ``packer build SRC`` (its shards cut per part). Rows from your own table work the same:
replace ``rows`` with ``df.select("path", "label").rdd`` and ``classes`` with your names.
SRC and OUT must be on a filesystem every executor mounts. A retried task rewrites its part
(``overwrite=True``), and a re-run of the job its parts and OUT/train; keep
``spark.speculation`` off (two attempts of one task would write the same part: the second
is refused). docs/distributed.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def write_part(index, rows, root: str, out: str, classes):
    """In an executor: the partition's rows as one packer dataset, OUT/part-INDEX."""
    import packer
    samples = [{"image": f"{root}/{path}", "path": path, "label": label} for path, label in rows]
    if samples:  # an empty partition has no part
        part = Path(out) / f"part-{index:05d}"
        packer.write(part, samples, classes=classes, overwrite=True, progress=False)
        yield str(part)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--parts", type=_positive, default=8, help="Spark partitions, one part each")
    ap.add_argument("--master", help="e.g. local[4] (default: spark-submit's)")
    args = ap.parse_args(argv)
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise SystemExit("error: pyspark is not installed: pip install pyspark "
                         "(Spark needs Java too)") from None
    import packer
    from packer.errors import PackerError
    from packer.sources import ImageFolder
    try:  # SRC's mistakes before Spark starts, in one line
        listing = ImageFolder(args.src).read()
    except PackerError as e:
        raise SystemExit(f"error: {e}") from None
    root, out = str(args.src.resolve()), str(args.out.resolve())
    builder = SparkSession.builder.appName("packer-build")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.config("spark.ui.enabled", "false").getOrCreate()
    try:
        rows = spark.sparkContext.parallelize(listing.entries, args.parts)
        parts = rows.mapPartitionsWithIndex(
            lambda i, it: write_part(i, it, root, out, listing.classes)).collect()
    finally:
        spark.stop()
    try:  # replaces OUT/train of an earlier run: it points into the parts just rewritten
        m = packer.merge(sorted(parts), args.out / "train", overwrite=True)
    except PackerError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"merged {len(parts)} parts: {m['count']} images -> {args.out / 'train'}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
