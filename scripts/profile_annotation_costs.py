#!/usr/bin/env python3
"""What a COCO annotation file costs a build besides the image checks: the main process's
serial read against a --list of the same images, and each image's field encoding (what
the workers add per image). Run it on each machine to see how the --coco build's ratio
will move with its cores. The measurement is ``packer.bench.sourcecost``.

    python3 scripts/profile_annotation_costs.py --coco instances_val2017.json
"""
import argparse
import sys
from pathlib import Path

from packer.bench.sourcecost import source_costs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coco", type=Path, required=True, help="a COCO instances JSON")
    p.add_argument("--images", type=Path, help="its image folder (not read; default: none)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    r = source_costs(a.coco, a.images, a.repeats)
    print(f"{r['images']:,} images: reading the COCO file {r['read_coco_ms']:.1f} ms, the same "
          f"names as a --list {r['read_list_ms']:.1f} ms (serial, in the main process); "
          f"fields {r['fields_us_per_image']:.1f} us per image (in the workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
