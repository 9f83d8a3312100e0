#!/usr/bin/env python3
"""Mask cost: ``PackedDataset(masks=True)[i]`` time and peak memory (issue 29, item 4).

Two cases, each built into a fresh private temporary folder and read in a fresh child
process (its peak RSS is its own; one torch thread, as in a DataLoader worker):

  attack   one --size x --size JPEG whose single COCO object has --polygons triangles
           spanning the whole image (a ~1 KB annotation file); ``ds[0]`` with masks, and
           the masks alone (``masks_of`` on the stored record)
  coco     --images photo scenes of ``packer.demo`` (COCO-like objects, 24-vertex
           outlines); masks per image, the image decode excluded

    python benchmarks/bench_masks.py                      # both, this checkout's packer
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_masks.py   # compare one

Prints one JSON object per case: wall and CPU seconds (CPU time is the steadier on a
shared machine), the child's peak RSS over its baseline (after imports) for the masks
alone and for the whole ``ds[0]`` (the image decode included), the masks' own MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(1)  # as in a DataLoader worker
from packer import PackedDataset
from packer.reading.masks import masks_of
try:
    from torchvision import tv_tensors  # imported before the baseline: not the masks' memory
except ImportError:
    pass
root, case = sys.argv[1], sys.argv[2]
ds = PackedDataset(root, masks=True)
out = {"case": case}


def peak_mib():
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


rss0 = peak_mib()
if case == "attack":
    rec = ds.load(0)
    t, c = time.perf_counter(), time.process_time()
    m = masks_of(rec["segmentation"], rec["height"], rec["width"])
    out["masks_s"] = round(time.perf_counter() - t, 3)
    out["masks_cpu_s"] = round(time.process_time() - c, 3)
    out["masks_peak_mib"] = round(peak_mib() - rss0, 1)  # over the baseline
    out["mask_mib"] = round(m.numel() / 2**20, 1)
    del m
    t, c = time.perf_counter(), time.process_time()
    image, target = ds[0]
    out["getitem_s"] = round(time.perf_counter() - t, 3)
    out["getitem_cpu_s"] = round(time.process_time() - c, 3)
else:
    recs = [ds.load(i) for i in range(len(ds))]
    t, c = time.perf_counter(), time.process_time()
    n = sum(len(masks_of(r["segmentation"], r["height"], r["width"])) for r in recs)
    dt, dc = time.perf_counter() - t, time.process_time() - c
    out.update(images=len(recs), objects=n, ms_per_image=round(1000 * dt / len(recs), 3),
               cpu_ms_per_image=round(1000 * dc / len(recs), 3))
out["peak_over_baseline_mib"] = round(peak_mib() - rss0, 1)
out["baseline_rss_mib"] = rss0
out["packer"] = __import__("packer").__file__
print(json.dumps(out))
"""


def make_attack(work: Path, size: int, polygons: int) -> Path:
    from PIL import Image
    import packer
    from packer.sources import Coco
    images = work / "big"
    images.mkdir()
    Image.new("RGB", (size, size), (90, 120, 150)).save(images / "a.jpg", quality=50)
    s = size
    # Triangles from the top-left corner to the far sides: each spans every row and column.
    polys = [[0, 0, s, s * (k + 1) / polygons, s * k / polygons, s] for k in range(polygons)]
    coco = {"images": [{"id": 1, "file_name": "a.jpg", "width": s, "height": s}],
            "categories": [{"id": 1, "name": "thing"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "iscrowd": 0,
                             "bbox": [0, 0, s, s], "area": float(s * s) / 2,
                             "segmentation": polys}]}
    ann = work / "big.json"
    ann.write_text(json.dumps(coco))
    print(f"attack: {size}x{size} image, {polygons} polygons, annotation file "
          f"{ann.stat().st_size} bytes", file=sys.stderr)
    packer.build(Coco(images, ann), work / "attack", progress=False, workers=0)
    return work / "attack"


def make_coco(work: Path, images: int) -> Path:
    import packer
    from packer.sources import Coco
    from packer.demo.scenes import make_detection_folder
    src = make_detection_folder(work / "scenes", images=images, seed=1)
    packer.build(Coco(src / "images", src / "annotations.json"), work / "coco", progress=False,
                 workers=0)
    return work / "coco"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=8192, help="attack image side (px)")
    ap.add_argument("--polygons", type=int, default=40, help="attack polygons")
    ap.add_argument("--images", type=int, default=200, help="COCO-like scenes")
    ap.add_argument("--case", choices=("attack", "coco", "both"), default="both")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-masks-") as tmp:
        work = Path(tmp)
        cases = []
        if args.case in ("attack", "both"):
            cases.append(("attack", make_attack(work, args.size, args.polygons)))
        if args.case in ("coco", "both"):
            cases.append(("coco", make_coco(work, args.images)))
        for name, root in cases:
            # cwd: not a checkout, whose packer/ would come before PYTHONPATH's
            r = subprocess.run([sys.executable, "-c", CHILD, str(root), name], env=os.environ,
                               capture_output=True, text=True, cwd=tmp)
            print(r.stdout.strip() or r.stderr.strip()[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
