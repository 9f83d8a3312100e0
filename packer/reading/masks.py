"""COCO segmentations (polygons, RLE) to binary masks, pixel for pixel as pycocotools'
``decode(merge(frPyObjects(...)))`` without it; the work is bounded before it starts
(``segmentation_problem``; docs/security.md)."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch

from .polygons import Outline, crossings, outline, polygon_intervals

MAX_MASK_PIXELS = 1 << 28        # a mask's height x width: beyond any image packer accepts
MAX_POLYGON_VERTICES = 100_000   # per object, over all its polygons
MAX_COORDINATE = float(1 << 22)  # |x|, |y| of a polygon vertex, pixels
CROSSING_ALLOWANCE = 1 << 20     # column crossings per object beyond height x width / 8
Parsed = List[Union[torch.Tensor, List[List[float]]]]  # run lengths (RLE) or polygons


def segmentation_problem(segmentation: Any, height: int, width: int) -> str:
    """Why ``segmentation`` cannot give masks for this image, or "": checked before allocating."""
    return parse(segmentation, height, width)[0]


def parse(segmentation: Any, height: int, width: int) -> Tuple[str, Parsed, Optional[Outline]]:
    """``("", parts, outline)``: per object its run lengths (an RLE) or its polygons, and
    the outline of the polygon objects (None without any); or ``(problem, [], None)``."""
    if not (isinstance(height, int) and isinstance(width, int) and 0 < height and 0 < width
            and height * width <= MAX_MASK_PIXELS):
        return f"image size {width}x{height} is not a size masks can be made for", [], None
    if not isinstance(segmentation, list):
        return "segmentation is not a list (one entry per object)", [], None
    parts: Parsed = []
    for seg in segmentation:
        problem, part = (rle_counts(seg, height, width) if isinstance(seg, dict)
                         else (polygons_problem(seg), seg))
        if problem:
            return problem, [], None
        parts.append(part)
    polygons = [(k, p) for k, p in enumerate(parts) if not isinstance(p, torch.Tensor)]
    if not polygons:
        return "", parts, None
    lines = outline(polygons, width)
    work, budget = int(crossings(lines, len(parts)).max()), crossing_budget(height, width)
    if work > budget:
        return (f"a polygon outline crossing {work} pixel columns, more than masks of a "
                f"{width}x{height} image may cost ({budget})"), [], None
    return "", parts, lines


def rle_counts(seg: dict, height: int, width: int) -> Tuple[str, Optional[torch.Tensor]]:
    size, counts = seg.get("size"), seg.get("counts")
    if size != [height, width]:
        return f"an RLE of size {str(size)[:40]} on a {height}x{width} image", None
    if isinstance(counts, str):
        try:
            counts = counts_tensor(counts)
        except ValueError:
            return "a compressed RLE string that does not decode", None
    elif isinstance(counts, list) and all(type(c) is int and 0 <= c <= height * width
                                          for c in counts):
        counts = torch.tensor(counts, dtype=torch.int64)
    else:
        counts = None
    if counts is None or (len(counts) and not 0 <= int(counts.min()) <= int(counts.max())
                          <= height * width) or int(counts.sum()) > height * width:
        # each run within the image first: runs of 2^60 would wrap the int64 sum round
        return "RLE counts that are not run lengths within the image", None
    return "", counts


def polygons_problem(seg: Any) -> str:
    if not (isinstance(seg, list) and all(
            isinstance(p, list) and all(type(v) in (int, float) for v in p) for p in seg)):
        return "a polygon that is not a list of numbers"
    vertices = sum(len(p) // 2 for p in seg)
    if vertices > MAX_POLYGON_VERTICES:
        return (f"an object of {vertices} polygon vertices (masks are made for at most "
                f"{MAX_POLYGON_VERTICES})")
    if not all(-MAX_COORDINATE <= v <= MAX_COORDINATE for p in seg for v in p):
        return f"a polygon coordinate that is not a number within ±{int(MAX_COORDINATE)} pixels"
    return ""


def crossing_budget(height: int, width: int) -> int:
    """Image-column crossings one object's polygon edges may add up to: mask work in
    proportion to the image (a real outline crosses each column a few times)."""
    return height * width // 8 + CROSSING_ALLOWANCE


def masks_of(segmentation: List[Any], height: int, width: int) -> torch.Tensor:
    """``(N, height, width)`` uint8 masks, one per object (ValueError: ``segmentation_problem``)."""
    problem, parts, lines = parse(segmentation, height, width)
    if problem:
        raise ValueError(problem)
    n, hw = len(parts), height * width
    starts, ends = [], []
    for k, counts in enumerate(parts):
        if isinstance(counts, torch.Tensor):
            stop = counts.cumsum(0)
            starts.append((stop - counts)[1::2] + k * hw)
            ends.append(stop[1::2] + k * hw)
    chunks = outline_chunks(lines, n, crossing_budget(height, width))
    if len(chunks) == 1:  # the usual case: every interval painted at once
        s, e = polygon_intervals(chunks[0][2], height, width)
        starts.append(s)
        ends.append(e)
    none = torch.zeros(0, dtype=torch.int64)
    flat = paint(torch.cat(starts or [none]), torch.cat(ends or [none]), n * hw)
    for k0, k1, chunk in chunks if len(chunks) > 1 else []:  # each into its objects' slice
        s, e = polygon_intervals(chunk, height, width)
        flat[k0 * hw:k1 * hw].bitwise_or_(paint(s - k0 * hw, e - k0 * hw, (k1 - k0) * hw))
    return flat.view(n, width, height).transpose(1, 2).contiguous()  # runs are column-major


def outline_chunks(lines: Optional[Outline], objects: int,
                   budget: int) -> List[Tuple[int, int, Outline]]:
    """``lines`` split into runs of objects ``[k0, k1)`` of at most about ``2 * budget``
    crossings: a run's intervals cost ~120 bytes a crossing while made, so memory follows
    the masks' size, not the number of objects."""
    if lines is None:
        return []
    work = crossings(lines, objects)
    run = torch.div(work.cumsum(0) - work, budget, rounding_mode="floor")
    if int(run[-1]) == 0:
        return [(0, objects, lines)]
    edges, out = run[lines.obj], []
    for k in run.unique().tolist():
        members, mine = (run == k).nonzero().flatten(), edges == k
        if bool(mine.any()):
            out.append((int(members[0]), int(members[-1]) + 1, Outline(*(f[mine] for f in lines))))
    return out


def paint(starts: torch.Tensor, ends: torch.Tensor, total: int) -> torch.Tensor:
    """A flat uint8 array of ``total`` zeros with ones on the union of the half-open
    intervals ``[starts[i], ends[i])`` (any order, overlapping or empty)."""
    if len(starts) == 0:
        return torch.zeros(total, dtype=torch.uint8)
    starts, order = starts.sort()
    ends = ends[order].cummax(0).values  # the furthest any interval so far reaches
    new = torch.cat([starts.new_ones(1, dtype=torch.bool), starts[1:] > ends[:-1]])
    last = torch.cat([new[1:], new.new_ones(1)])
    s, e = starts[new], ends[last]  # disjoint, sorted, apart: every start and end distinct
    s, e = s[e > s], e[e > s]
    # +1 where a run of ones starts, -1 (255) where it ends; the running uint8 sum is 0 or 1
    edges = torch.zeros(total + 1, dtype=torch.uint8)
    edges[s] = 1
    edges[e] = 255
    return edges[:total].cumsum(0, dtype=torch.uint8)


def counts_tensor(s: str) -> torch.Tensor:
    """COCO's compressed RLE string (``rleFrString``): 6-bit characters from 48, 5 bits of
    value each, 0x20 = more to come, 0x10 in the last = negative; each count after the
    third is stored as a difference from the one two before. ValueError if it is not one."""
    try:
        raw = s.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("a compressed RLE string holds a character that is not ASCII") from None
    if not raw:
        return torch.zeros(0, dtype=torch.int64)
    c = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64) - 48
    if int(c.min()) < 0 or int(c.max()) > 63 or int(c[-1]) & 0x20:
        raise ValueError("a compressed RLE string cut short or holding a foreign character")
    last = c & 0x20 == 0                                      # a count's last character
    ends = last.nonzero().flatten()
    group = torch.cat([c.new_zeros(1), last[:-1].cumsum(0)])
    k = torch.arange(len(c)) - torch.cat([c.new_zeros(1), ends[:-1] + 1])[group]  # index in count
    if int(k.max()) > 11:  # 12 characters hold 60 bits: more is no count
        raise ValueError("a compressed RLE string with a count out of range")
    x = torch.zeros(len(ends), dtype=torch.int64)
    x.index_add_(0, group, (c & 0x1F) << (5 * k))
    negative = (c[ends] & 0x10) != 0
    x -= negative.to(torch.int64) << (5 * (k[ends] + 1))
    if len(x) > 3:  # counts[m] += counts[m - 2] for m > 2: running sums of each parity
        x[3::2] = x[1::2].cumsum(0)[1:]
        x[4::2] = x[2::2].cumsum(0)[1:]
    return x


def decode_counts(s: str) -> List[int]:
    """The run lengths a compressed RLE string holds (ValueError if it is not one)."""
    return counts_tensor(s).tolist()
