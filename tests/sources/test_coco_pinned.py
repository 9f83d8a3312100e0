"""The records a COCO build stores, pinned: a small fixed instances file (every kind of
object: polygons, RLEs, crowds, clipped and unusable boxes, odd areas, unusable
segmentations) over images whose bytes no encoder makes (binary PPM/PGM written here), built
in this process and by worker processes, must give the shard bytes it gave when this test
was written. A change to how COCO is read must keep them, or change them deliberately
(SHARD_SHA256 says which changes were)."""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from packer.sources import Coco
from packer.writing.builder import build

# Changed deliberately twice: box ends as torchvision computes them (float32(x) +
# float32(w), not float32(x + w): 24 of these 78 boxes differ in their last bit), and
# polygons that reach further outside their image than its longer side dropped (19, 25).
SHARD_SHA256 = "c501cf55d66da8bc8ff018cc93d006d59d72a42dd6d8bff6ac4bab0f9b58e583"


def pnm(width: int, height: int, channels: int, seed: int) -> bytes:
    """A binary PPM (3 channels) or PGM (1) with a fixed pattern of pixels."""
    head = f"P{6 if channels == 3 else 5}\n{width} {height}\n255\n".encode()
    return head + bytes((seed + 7 * i + (i // 13)) % 256 for i in range(width * height * channels))


POLY = [[10, 10, 30, 10, 30, 20]]
ANNOTATIONS = [
    {"id": 11, "image_id": 2, "category_id": 90, "bbox": [10, 10, 20, 10], "area": 100.0,
     "iscrowd": 0, "segmentation": POLY, "note": "an extra key"},
    {"id": 12, "image_id": 7, "category_id": 1, "bbox": [0.5, 1.5, 5, 4]},
    {"id": 10, "image_id": 2, "category_id": 3, "bbox": [-4, -2, 80, 60], "area": 2400,
     "iscrowd": 1, "segmentation": {"counts": "0`0Q0", "size": [48, 64]}},
    {"id": 13, "image_id": 2, "category_id": 4, "bbox": [1.25, 2.125, 3e1, 1E1],
     "area": "big", "segmentation": [[1.5, -2.25, 3e1, 4, 5.000001, 6], [0, 0, 1, 1, 1, 0]]},
    {"id": 14, "image_id": 2, "category_id": 4, "bbox": [100, 100, 5, 5]},  # outside
    {"id": 15, "image_id": 2, "category_id": 4, "bbox": [1, 1, 0, 5]},  # zero width
    {"id": 16, "image_id": 7, "category_id": 1, "bbox": [1, 1, 2, 2], "area": 1e39,
     "segmentation": {"counts": [0, 5, 3, 2], "size": [40, 60], "extra": [1, "x"]}},
    {"id": 17, "image_id": 7, "category_id": 1, "bbox": [1, 1, 2, 2], "area": -4,
     "segmentation": "poly"},  # unusable segmentation: dropped
    {"id": 18, "image_id": 7, "category_id": 3, "bbox": [2, 2, 3, 3], "area": 7,
     "segmentation": [[1, True, 3, 4]]},  # dropped
    {"id": 19, "image_id": 7, "category_id": 3, "bbox": [2, 2, 3, 3],
     "segmentation": [[999999999999999999, 5, 6, 7, 8, 9]]},
    {"id": 20, "image_id": 7, "category_id": 90, "bbox": [2, 2, 3, 3], "segmentation": [[]]},
    {"id": 21, "image_id": 7, "category_id": 90, "bbox": [2, 2, 3, 3], "segmentation": []},
    {"id": 22, "image_id": 99, "category_id": 1, "bbox": [0, 0, 1, 1]},  # no such image
    {"id": 23, "image_id": 2, "category_id": 77, "bbox": [0, 0, 1, 1]},  # no such category
    {"id": 24, "image_id": 9, "category_id": 1, "bbox": [0, 0, 1, 1]},  # its image dropped
    {"id": 9223372036854775807, "image_id": 12, "category_id": 1, "bbox": [0, 0, 1, 1]},
    {"id": 25, "image_id": 7, "category_id": 1, "bbox": [3, 4, 5, 6], "iscrowd": 0,
     "segmentation": [[0.1, 0.2, 0.30000000000000004, 1e-7, 123456.789, 42]]},
    {"id": 26, "image_id": 7, "category_id": 3, "bbox": [3, 4, 5, 6],
     "segmentation": [[[1, 2, 3]]]},  # nested too deep for polygons: dropped
]
RNG = random.Random(0)
ANNOTATIONS += [{"id": 100 + k, "image_id": 5, "category_id": RNG.choice([1, 3, 4, 90]),
                 "bbox": [RNG.uniform(-5, 45), RNG.uniform(-5, 25), RNG.uniform(0.01, 30),
                          round(RNG.uniform(0.01, 30), RNG.randint(0, 3))],
                 "area": RNG.choice([RNG.uniform(0, 900), RNG.randint(0, 900)]),
                 "iscrowd": 0,
                 "segmentation": [[RNG.choice([round(RNG.uniform(-10, 70), RNG.randint(0, 6)),
                                               RNG.randint(-10, 70), RNG.uniform(0, 1e-3)])
                                   for _ in range(2 * RNG.randint(3, 30))]
                                  for _ in range(RNG.randint(1, 3))]}
                for k in range(60)]
COCO = {
    "info": {"description": "pinned", "version": "1"},
    "images": [{"id": 7, "file_name": "b/seven.ppm", "width": 60, "height": 40},
               {"id": 2, "file_name": "two.ppm"},
               {"id": 5, "file_name": "./five.pgm"},
               {"id": 9, "file_name": "../outside.ppm"},
               {"id": 11, "file_name": "missing.ppm"},
               {"id": 12, "file_name": "broken.ppm"}],
    "annotations": ANNOTATIONS,
    "categories": [{"id": 90, "name": "toothbrush", "supercategory": "indoor"},
                   {"id": 1, "name": "person", "supercategory": "person"},
                   {"id": 3, "name": "car"},
                   {"id": 4, "name": "caf\u00e9", "supercategory": 5}],
}


@pytest.fixture(scope="module")
def coco_input(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pinned")
    img = root / "images"
    (img / "b").mkdir(parents=True)
    (img / "b" / "seven.ppm").write_bytes(pnm(60, 40, 3, 1))
    (img / "two.ppm").write_bytes(pnm(64, 48, 3, 2))
    (img / "five.pgm").write_bytes(pnm(50, 30, 1, 3))
    (img / "broken.ppm").write_bytes(b"P6\n10 10\n255\n" + b"\0" * 20)
    (root / "instances.json").write_text(json.dumps(COCO, indent=1), encoding="utf-8")
    return root


@pytest.mark.parametrize("workers", [0, 2])
def test_a_coco_build_stores_the_pinned_records(coco_input, tmp_path, workers):
    m = build(Coco(coco_input / "images", coco_input / "instances.json"), tmp_path / "d",
              workers=workers, progress=False).manifest
    assert m["count"] == 3 and len(m["shards"]) == 1
    assert [s["path"] for s in m["skipped"]] == ["missing.ppm", "broken.ppm"]
    digest = hashlib.sha256((tmp_path / "d" / m["shards"][0]["path"]).read_bytes()).hexdigest()
    assert digest == m["shards"][0]["sha256"] == SHARD_SHA256
    assert m["dropped"] == DROPPED


UNUSABLE = ("'segmentation' must be polygons [[x1, y1, ...], ...] of finite numbers or an "
            "RLE {\"counts\", \"size\"}")
FAR = ("a polygon reaching further outside the 60x40 image than its longer side: it cannot "
       "belong to this image")
DROPPED = [
    {"path": "../outside.ppm",
     "reason": "image id 9: file_name contains '..'; it must stay inside the image folder"},
    {"path": "instances.json", "reason": "annotation 22: image id 99 is not in 'images'"},
    {"path": "two.ppm", "reason": "annotation 23: category id 77 is not in 'categories'"},
    {"path": "two.ppm", "reason": "annotation 14: box [100, 100, 5, 5] lies outside the 64x48 image"},
    {"path": "two.ppm", "reason": "annotation 15: zero or negative size box [1, 1, 0, 5]"},
    {"path": "five.pgm", "reason": "annotation 137: box [23.1455, -2.98639, 22.0553, 2.52] lies "
                                   "outside the 50x30 image"},
    {"path": "b/seven.ppm", "reason": f"annotation 17: {UNUSABLE}"},
    {"path": "b/seven.ppm", "reason": f"annotation 18: {UNUSABLE}"},
    {"path": "b/seven.ppm", "reason": f"annotation 19: {FAR}"},
    {"path": "b/seven.ppm", "reason": f"annotation 25: {FAR}"},
    {"path": "b/seven.ppm", "reason": f"annotation 26: {UNUSABLE}"},
]
