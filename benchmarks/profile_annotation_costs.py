#!/usr/bin/env python3
"""What a COCO annotation file costs a build besides the image checks: the main process's
read against a --list of the same images, and each image's field encoding (what the
workers add per image). Run it on each machine to see how the --coco build's ratio will
move with its cores. The measurement is ``benchlib.sourcecost``.

    python3 benchmarks/profile_annotation_costs.py --coco instances_val2017.json
    python3 benchmarks/profile_annotation_costs.py --synthetic 60000   # a large file's read
"""
import argparse
import sys
import tempfile
from pathlib import Path

from benchlib.sourcecost import source_costs, write_coco_like


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--coco", type=Path, help="a COCO instances JSON")
    given.add_argument("--synthetic", type=int, metavar="N",
                       help="time a COCO-train-shaped file of N images made for the run "
                            "(7 objects each, 24-point polygons; COCO train2017 is ~118,000)")
    p.add_argument("--images", type=Path, help="its image folder (not read; default: none)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        coco = a.coco or write_coco_like(Path(tmp) / "instances.json", a.synthetic)
        r = source_costs(coco, a.images, a.repeats)
    print(f"{r['images']:,} images: reading the COCO file {r['read_coco_ms']:.1f} ms, the same "
          f"names as a --list {r['read_list_ms']:.1f} ms (in the main process); "
          f"fields {r['fields_us_per_image']:.1f} us per image (in the workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
