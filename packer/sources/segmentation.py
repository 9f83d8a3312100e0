"""A COCO object's ``segmentation`` checked at build against its image with the reader's limits
(``packer.reading.masks``, without torch): stored only where it can give its mask."""
from __future__ import annotations

from typing import Annotated, Any, Dict, List, Optional, Tuple, Union

import msgspec
from msgspec import Meta, Raw

from ..format.fields import data_problem

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
MAX_POLYGON_VERTICES = 100_000   # per object, over all its polygons
MAX_COORDINATE = float(1 << 22)  # |x|, |y| of a polygon vertex, pixels
CROSSING_ALLOWANCE = 1 << 20     # column crossings per object beyond height x width / 8
UNUSABLE = ("'segmentation' must be polygons [[x1, y1, ...], ...] of finite numbers or an "
            "RLE {\"counts\", \"size\"}")
# Polygons: numbers only (no bool, string or null), ints within int64, floats finite.
POLYGONS = msgspec.json.Decoder(List[List[Union[Annotated[int, Meta(ge=INT64_MIN,
                                                                     le=INT64_MAX)], float]]])
RLE = msgspec.json.Decoder(Dict[str, Any])
MSGPACK = msgspec.msgpack.Encoder()


def stored_segmentation(raw: Raw, width: int, height: int) -> Tuple[Optional[Raw], str]:
    """``(msgpack of the JSON value, "")``, or ``(None, why it cannot be this image's)``."""
    try:
        polygons = POLYGONS.decode(raw)
    except msgspec.ValidationError:
        pass
    else:
        problem = polygons_problem(polygons, width, height)
        return (None, problem) if problem else (Raw(MSGPACK.encode(polygons)), "")
    try:
        rle = RLE.decode(raw)
    except (msgspec.ValidationError, RecursionError):
        return None, UNUSABLE
    counts, size = rle.get("counts"), rle.get("size")
    counts_ok = isinstance(counts, str) or (isinstance(counts, list) and all(
        type(c) is int for c in counts) and min(counts, default=0) >= 0)
    size_ok = isinstance(size, list) and len(size) == 2 and all(
        type(s) is int and 0 <= s <= INT64_MAX for s in size)
    # data_problem at depth 1: it is stored one level down, in the image's list
    if not (counts_ok and size_ok) or data_problem(rle, 1):
        return None, UNUSABLE
    problem = rle_problem(counts, size, width, height)
    return (None, problem) if problem else (Raw(MSGPACK.encode(rle)), "")


def rle_problem(counts: Union[str, List[int]], size: List[int], width: int, height: int) -> str:
    """Why an RLE cannot be this image's mask, or ""."""
    if size != [height, width]:
        return (f"an RLE of size {size} (height, width) cannot belong to the {width}x{height} "
                f"image")
    if isinstance(counts, str):
        try:
            counts = decode_counts(counts)
        except ValueError as e:
            return f"an RLE whose compressed counts do not decode: {e}"
    if min(counts, default=0) < 0 or sum(counts) > width * height:
        return f"an RLE whose counts are not run lengths within the {width}x{height} image"
    return ""


def decode_counts(s: str) -> List[int]:
    """COCO's compressed RLE string as counts (``rleFrString``), else ValueError: characters from
    48, 5 bits each, 0x20: more to come, 0x10 in a count's last: negative; a count after the third
    is a difference from the one two before."""
    counts: List[int] = []
    x = k = 0
    for ch in s:
        c = ord(ch) - 48
        if not 0 <= c <= 63 or k == 12:  # 12 characters hold 60 bits: more is no count
            raise ValueError("a character out of range or a count too long")
        x |= (c & 0x1F) << (5 * k)
        k += 1
        if c & 0x20:
            continue
        if c & 0x10:
            x -= 1 << (5 * k)
        counts.append(x + counts[-2] if len(counts) > 2 else x)
        x = k = 0
    if k:
        raise ValueError("cut short")
    return counts


def polygons_problem(polygons: List[List[Union[int, float]]], width: int, height: int) -> str:
    """Why an object's polygons cannot be this image's, or ""."""
    vertices = sum(len(p) // 2 for p in polygons)
    if vertices > MAX_POLYGON_VERTICES:
        return (f"{vertices} polygon vertices, more than masks are made for "
                f"({MAX_POLYGON_VERTICES})")
    m = max(width, height)  # a polygon may reach outside its image, not this far
    x0, x1 = max(-m, -MAX_COORDINATE), min(width + m, MAX_COORDINATE)
    y0, y1 = max(-m, -MAX_COORDINATE), min(height + m, MAX_COORDINATE)
    for p in polygons:
        xs, ys = p[0:len(p) // 2 * 2:2], p[1::2]
        if xs and not (x0 <= min(xs) and max(xs) <= x1 and y0 <= min(ys) and max(ys) <= y1):
            return (f"a polygon reaching further outside the {width}x{height} image than its "
                    f"longer side: it cannot belong to this image")
    budget = crossing_budget(width, height)
    if vertices * width > budget:  # else no outline can cross more columns than allowed
        work = crossings(polygons, width)
        if work > budget:
            return (f"polygon edges crossing {work} pixel columns, more than masks of a "
                    f"{width}x{height} image may cost ({budget})")
    return ""


def crossing_budget(width: int, height: int) -> int:
    """Image-column crossings one object's polygon edges may add up to (the reader's)."""
    return height * width // 8 + CROSSING_ALLOWANCE


def crossings(polygons: List[List[Union[int, float]]], width: int) -> int:
    """How many image columns' centres (``5n+2..5n+3`` on rleFrPoly's 5x grid) the polygons'
    edges cross: the work the mask costs."""
    total = 0
    for p in polygons:
        xs = [int(5 * v + 0.5) for v in p[0:len(p) // 2 * 2:2]]  # C's (int): toward zero
        for a, b in zip(xs, xs[1:] + xs[:1]):
            lo, hi = min(a, b), max(a, b)
            total += max(0, min((hi - 3) // 5, width - 1) - max(-((2 - lo) // 5), 0) + 1)
    return total
