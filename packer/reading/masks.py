"""COCO segmentations (polygons, RLE) to binary masks, with no pycocotools dependency.

The stored segmentation is the JSON's data, unchanged; masks are made only when a dataset
is asked for them (``PackedDataset(..., masks=True)``). Polygons are filled by the
pixel-centre rule (pycocotools' rasterizer differs from it on outline pixels only); RLE,
compressed (COCO's string form) or not, is decoded exactly.
"""
from __future__ import annotations

from typing import Any, List

import torch


MAX_MASK_PIXELS = 1 << 28  # a mask's height x width: beyond any image packer accepts


def segmentation_problem(segmentation: Any, height: int, width: int) -> str:
    """Why ``segmentation`` cannot give masks for a ``height`` x ``width`` image, or "" —
    checked before anything is allocated (the record may come from a stranger)."""
    if not (isinstance(height, int) and isinstance(width, int) and 0 < height and 0 < width
            and height * width <= MAX_MASK_PIXELS):
        return f"image size {width}x{height} is not a size masks can be made for"
    if not isinstance(segmentation, list):
        return "segmentation is not a list (one entry per object)"
    for seg in segmentation:
        if isinstance(seg, dict):
            size, counts = seg.get("size"), seg.get("counts")
            if size != [height, width]:
                return f"an RLE of size {str(size)[:40]} on a {height}x{width} image"
            if isinstance(counts, str):
                try:
                    counts = decode_counts(counts)
                except (IndexError, ValueError):
                    return "a compressed RLE string that does not decode"
            if (not isinstance(counts, list) or not all(isinstance(c, int) and c >= 0
                                                       for c in counts)
                    or sum(counts) > height * width):
                return "RLE counts that are not run lengths within the image"
        elif not (isinstance(seg, list) and all(
                isinstance(p, list) and all(isinstance(v, (int, float)) for v in p) for p in seg)):
            return "a polygon that is not a list of numbers"
    return ""


def masks_of(segmentation: List[Any], height: int, width: int) -> torch.Tensor:
    """``(N, height, width)`` uint8 masks, one per object's segmentation (ValueError for a
    segmentation that cannot be one: see ``segmentation_problem``)."""
    problem = segmentation_problem(segmentation, height, width)
    if problem:
        raise ValueError(problem)
    out = torch.zeros((len(segmentation), height, width), dtype=torch.uint8)
    for k, seg in enumerate(segmentation):
        if isinstance(seg, dict):
            out[k] = rle_mask(seg, height, width)
        elif isinstance(seg, list) and seg:
            out[k] = polygon_mask(seg, height, width)
    return out


def polygon_mask(polygons: List[List[float]], height: int, width: int) -> torch.Tensor:
    """Pixels whose centre lies inside any of the polygons (even-odd rule per polygon), in
    COCO's continuous coordinates: pixel (x, y) has its centre at (x + 0.5, y + 0.5)."""
    mask = torch.zeros((height, width), dtype=torch.bool)
    for poly in polygons:
        if len(poly) < 6:
            continue
        pts = torch.tensor([float(v) for v in poly[: len(poly) // 2 * 2]], dtype=torch.float64)
        pts = pts.view(-1, 2)
        r0 = max(0, int(pts[:, 1].min()))
        r1 = min(height, int(pts[:, 1].max()) + 1)
        if r0 >= r1:
            continue
        x0, y0 = pts[:, 0], pts[:, 1]
        x1, y1 = pts.roll(-1, 0).unbind(1)
        y = torch.arange(r0, r1, dtype=torch.float64)[:, None] + 0.5        # (rows, 1)
        crosses = (y0 > y) != (y1 > y)                                      # (rows, edges)
        t = (y - y0) / torch.where(y1 == y0, torch.ones_like(y1), y1 - y0)
        xs = torch.where(crosses, x0 + t * (x1 - x0), torch.full_like(t, float("-inf")))
        xs = xs.sort(1).values
        centres = (torch.arange(width, dtype=torch.float64) + 0.5).expand(r1 - r0, width)
        # Crossings to the right of each pixel centre: odd = inside.
        right = xs.shape[1] - torch.searchsorted(xs.contiguous(), centres.contiguous(), right=True)
        mask[r0:r1] |= right % 2 == 1
    return mask.to(torch.uint8)


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
            if i >= len(s) or k > 12:
                raise ValueError("a compressed RLE string cut short or out of range")
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
