"""COCO segmentations (polygons, RLE) to binary masks, with no pycocotools dependency.

The stored segmentation is the JSON's data, unchanged; masks are made only when a dataset
is asked for them (``PackedDataset(..., masks=True)``). Polygons are filled with PIL (the
same pixel-centre rule as pycocotools up to boundary pixels); RLE, compressed (COCO's
string form) or not, is decoded exactly.
"""
from __future__ import annotations

from typing import Any, List

import torch
from PIL import Image, ImageDraw


def masks_of(segmentation: List[Any], height: int, width: int) -> torch.Tensor:
    """``(N, height, width)`` uint8 masks, one per object's segmentation."""
    out = torch.zeros((len(segmentation), height, width), dtype=torch.uint8)
    for k, seg in enumerate(segmentation):
        if isinstance(seg, dict):
            out[k] = rle_mask(seg, height, width)
        elif isinstance(seg, list) and seg:
            out[k] = polygon_mask(seg, height, width)
    return out


def polygon_mask(polygons: List[List[float]], height: int, width: int) -> torch.Tensor:
    im = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(im)
    for poly in polygons:
        if len(poly) >= 6:
            # COCO coordinates put pixel centres at +0.5, PIL's at integers.
            draw.polygon([(float(poly[i]) - 0.5, float(poly[i + 1]) - 0.5)
                          for i in range(0, len(poly) - 1, 2)], fill=1)
    return torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(height, width)


def rle_mask(rle: dict, height: int, width: int) -> torch.Tensor:
    """A COCO RLE (column-major runs, starting with zeros) as an (height, width) mask."""
    counts = rle.get("counts")
    if isinstance(counts, str):
        counts = decode_counts(counts)
    h, w = (rle.get("size") or [height, width])[:2]
    flat = torch.zeros(h * w, dtype=torch.uint8)
    pos, value = 0, 0
    for run in counts or ():
        run = int(run)
        if value:
            flat[pos:pos + run] = 1
        pos += run
        value ^= 1
    mask = flat.view(w, h).t()  # column-major
    if (h, w) != (height, width):  # an RLE of another size: crop or pad to the image
        fitted = torch.zeros((height, width), dtype=torch.uint8)
        hh, ww = min(h, height), min(w, width)
        fitted[:hh, :ww] = mask[:hh, :ww]
        mask = fitted
    return mask.contiguous()


def decode_counts(s: str) -> List[int]:
    """COCO's compressed RLE string: 5-bit groups + 48, continuation bit 0x20, sign bit 0x10,
    each count after the second stored as a difference from the one two before."""
    counts: List[int] = []
    i = 0
    while i < len(s):
        x, k, more = 0, 0, True
        while more:
            c = ord(s[i]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            i += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts
