"""What a COCO source costs a build outside the image checks, in one process: the main
process's serial read (``load_source``) against a list of the same images, and each image's
field encoding (``FieldMaker.encoded``: fit, check, encode, msgpack), which the workers do.

On a machine whose cores run Python slower, the serial read weighs more against a build
that many workers make short: this is how the ``--coco`` build's ratio was explained on the
16-core box (docs/benchmarks.md, issue 14, third session).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from ..builder import load_source, source_schema
from ..shardwork import FieldMaker

__all__ = ["source_costs"]


def source_costs(annotations: Path, images: Path = None, repeats: int = 3) -> Dict[str, float]:
    """Medians over ``repeats``: ``read_coco_ms``, ``read_list_ms`` (the same file names as
    a ``--list``), ``fields_us_per_image`` (at 640x480: the image files are not needed)."""
    annotations = Path(annotations)
    names = [im["file_name"] for im in json.loads(annotations.read_text("utf-8"))["images"]]
    runs: Dict[str, List[float]] = {"read_coco_ms": [], "read_list_ms": [],
                                    "fields_us_per_image": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(images) if images is not None else Path(tmp)
        listing = Path(tmp) / "labels0.txt"
        listing.write_text("".join(f"{n}\t0\n" for n in names), "utf-8")
        for _ in range(repeats):
            t = time.perf_counter()
            src = load_source(root, coco=annotations)
            runs["read_coco_ms"].append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            load_source(root, list=listing)
            runs["read_list_ms"].append((time.perf_counter() - t) * 1e3)
            fields = FieldMaker(src, source_schema(src)["fields"], [])
            t = time.perf_counter()
            for i in range(len(src.entries)):
                fields.encoded(i, 640, 480)
            runs["fields_us_per_image"].append((time.perf_counter() - t) / len(src.entries) * 1e6)
    out = {k: statistics.median(v) for k, v in runs.items()}
    out["images"] = len(names)
    return out
