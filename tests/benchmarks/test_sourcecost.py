"""``benchlib.sourcecost`` and its script: a COCO file's serial read and per-image fields."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchlib.sourcecost import source_costs, write_coco_like
from packer.sources.coco import read_coco

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_annotation_costs.py"


def small_coco(path: Path) -> Path:
    poly = [[1.0, 1.0, 9.0, 1.0, 9.0, 9.0]]
    data = {"images": [{"id": i, "file_name": f"{i}.jpg"} for i in (1, 2, 3)],
            "annotations": [{"id": 10 + i, "image_id": i, "category_id": 1, "bbox": [1, 1, 8, 8],
                             "area": 64.0, "iscrowd": 0, "segmentation": poly} for i in (1, 2)],
            "categories": [{"id": 1, "name": "thing"}]}
    path.write_text(json.dumps(data))
    return path


def test_source_costs(tmp_path):
    r = source_costs(small_coco(tmp_path / "a.json"), repeats=2)
    assert r["images"] == 3
    assert all(r[k] > 0 for k in ("read_coco_ms", "read_list_ms", "fields_us_per_image"))


def test_script_prints_the_figures(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--coco", str(small_coco(tmp_path / "a.json")),
                          "--repeats", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("3 images: reading the COCO file ")
    assert "us per image (in the workers)" in run.stdout


def test_a_coco_like_file_reads(tmp_path):
    path = write_coco_like(tmp_path / "train.json", 4000)
    (tmp_path / "img").mkdir()
    src = read_coco(tmp_path / "img", path)
    assert len(src.entries) == 4000 and len(src.classes) == 80
    assert src.entries[:2] == [("000000000001.jpg", -1), ("000000000002.jpg", -1)]
    assert all(len(r.objects) == 7 for r in src.annotations.rows)
