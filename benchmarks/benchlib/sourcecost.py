"""What a COCO source costs a build outside the image checks, in one process: the main
process's read (``read_coco``) against a list of the same images, and each image's field
encoding (``FieldMaker.encoded``: fit, check, encode, msgpack), which the workers do.

On a machine whose cores run Python slower, the read weighs more against a build that many
workers make short: this is how the ``--coco`` build's ratio was explained on the 16-core box
(docs/benchmarks.md, issue 14, third session).
"""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from packer.format.fields import field_of
from packer.sources.folder import read_list
from packer.sources.coco import read_coco
from packer.writing.builder import source_schema
from packer.writing.worker import FieldMaker

__all__ = ["source_costs", "write_coco_like"]


def source_costs(annotations: Path, images: Path = None, repeats: int = 3) -> Dict[str, float]:
    """Medians over ``repeats``: ``read_coco_ms``, ``read_list_ms`` (the same file names as a
    ``--list``) and ``fields_us_per_image`` (at 640x480: the image files are not needed)."""
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
            src = read_coco(root, annotations)
            runs["read_coco_ms"].append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            read_list(root, listing)
            runs["read_list_ms"].append((time.perf_counter() - t) * 1e3)
            fields = FieldMaker(src, [field_of(f) for f in source_schema(src)["fields"]], [])
            runs["fields_us_per_image"].append(encoding_us(fields, len(src.entries)))
    out = {k: statistics.median(v) for k, v in runs.items()}
    out["images"] = len(names)
    return out


def encoding_us(fields: FieldMaker, images: int) -> float:
    """Microseconds per image to encode every image's fields (at 640x480)."""
    t = time.perf_counter()
    for i in range(images):
        fields.encoded(i, 640, 480)
    return (time.perf_counter() - t) / images * 1e6


def write_coco_like(path: Path, images: int, objects: int = 7, points: int = 24,
                    seed: int = 0) -> Path:
    """An instances file shaped like COCO train2017's (its image records' keys, ``objects``
    per image with ``points``-point polygons, 80 categories, objects in no image order),
    for timing the read alone: the images it names do not exist."""
    rng = random.Random(seed)
    anns = [{"segmentation": [[round(rng.uniform(0, 640), 2) for _ in range(2 * points)]],
             "area": round(rng.uniform(10, 9000), 2), "iscrowd": 0, "image_id": i + 1,
             "bbox": [round(rng.uniform(0, 300), 2), round(rng.uniform(0, 200), 2),
                      round(rng.uniform(5, 300), 2), round(rng.uniform(5, 250), 2)],
             "category_id": rng.randrange(1, 81), "id": i * objects + k + 1}
            for i in range(images) for k in range(objects)]
    rng.shuffle(anns)
    data = {"info": {"description": "COCO-like, made by benchlib.sourcecost"},
            "licenses": [],
            "images": [{"license": 3, "file_name": f"{i + 1:012d}.jpg", "height": 480,
                        "width": 640, "date_captured": "2013-11-14 11:18:45", "id": i + 1}
                       for i in range(images)],
            "annotations": anns,
            "categories": [{"supercategory": "thing", "id": c, "name": f"class {c}"}
                           for c in range(1, 81)]}
    path.write_text(json.dumps(data), "utf-8")
    return path
