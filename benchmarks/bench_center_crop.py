#!/usr/bin/env python3
"""Evaluation decode: ``DecodeCenterCrop(224)`` against torchvision's
``Resize(256) + CenterCrop(224)`` on ``Image.open(f).convert("RGB")`` (issue 30).

Photo-like JPEGs made from the photos packer ships (``packer.demo.make_image``: a crop of
a photo, unsharp mask, sensor grain, quality 75-95), held in memory, decoded on one core;
per set, the best of --rounds passes in CPU milliseconds per image, and the largest and
mean difference from torchvision's pixels:

  imagenet   ImageNet's common sizes (500x375, 500x333, 333x500, 640x427, 375x500)
  large      2000-4000 px photos (where JPEG draft decoding used to apply)

    python benchmarks/bench_center_crop.py --jpegs /tmp/cc-jpegs     # makes them there
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_center_crop.py --jpegs /tmp/cc-jpegs

Runs with whichever Pillow is active (Pillow-SIMD or stock Pillow: it says which).
"""
from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
from pathlib import Path

SETS = {"imagenet": [(500, 375), (500, 333), (333, 500), (640, 427), (375, 500)],
        "large": [(2000, 1500), (3000, 2000), (4000, 3000), (2448, 3264)]}


def jpegs(folder, name: str, make) -> list:
    """The set's JPEGs: read from ``folder/name`` when there, else made (and kept there)."""
    if folder is None:
        return make()
    where = Path(folder) / name
    if not where.is_dir():
        where.mkdir(parents=True)
        for i, data in enumerate(make()):
            (where / f"{i:04d}.jpg").write_bytes(data)
    return [p.read_bytes() for p in sorted(where.glob("*.jpg"))]


def best_ms(fn, datas, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.process_time()
        for d in datas:
            fn(d)
        best = min(best, (time.process_time() - t) / len(datas) * 1000)
    return round(best, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-size", type=int, default=8, help="JPEGs per size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--jpegs", help="a folder to read the JPEGs from, made there if missing "
                                    "(so another checkout decodes the same files)")
    args = ap.parse_args(argv)
    import torch
    from PIL import Image
    from torchvision import transforms as T
    import packer
    from packer._util.system import pil_info
    from packer.demo import load_photos, make_image
    from packer.transforms.decode import DecodeCenterCrop
    torch.set_num_threads(1)
    photos = load_photos()
    rng = random.Random(0)
    ref = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])

    def torchvision_decode(data: bytes):
        return ref(Image.open(io.BytesIO(data)).convert("RGB"))
    info = pil_info()
    print(json.dumps({"packer": packer.__file__, "pil": f"{info['flavour']} {info['version']}",
                      "libjpeg": info.get("jpeg_version")}))
    for name, sizes in SETS.items():
        datas = jpegs(args.jpegs, name, lambda: [make_image(rng, photos, (w, h)) for w, h in sizes
                                                 for _ in range(args.per_size)])
        dec = DecodeCenterCrop(224)
        diffs = [(dec(d).int() - torchvision_decode(d).int()).abs() for d in datas]
        row = {"set": name, "images": len(datas),
               "DecodeCenterCrop_ms": best_ms(dec, datas, args.rounds),
               "torchvision_ms": best_ms(torchvision_decode, datas, args.rounds),
               "max_diff": max(int(x.max()) for x in diffs),
               "mean_diff": round(sum(float(x.float().mean()) for x in diffs) / len(diffs), 3)}
        try:
            draft = DecodeCenterCrop(224, draft=True)
        except TypeError:  # a packer without the option: its default drafted
            draft = None
        if draft is not None:
            row["draft_ms"] = best_ms(draft, datas, args.rounds)
            row["draft_max_diff"] = max(int((draft(d).int() - torchvision_decode(d).int())
                                            .abs().max()) for d in datas)
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
