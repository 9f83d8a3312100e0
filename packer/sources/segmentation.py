"""A COCO object's ``segmentation``: polygons or an RLE, checked before it is stored.

Polygons come from the main process as text (``lazyjson``) and are parsed here, in the
build's workers. The common, plain text goes straight to its stored bytes where the C
accelerator is built (``_polygons``: no Python object per number); else it is parsed, and
known good from its characters alone. Anything else is checked number by number.
"""
from __future__ import annotations

import json
from itertools import chain
from typing import Any, Tuple

from ..errors import PackerError
from ..format.fields import PackedData, data_problem
from .cocopieces import NUMBER_TYPES, is_id
from .lazyjson import Deferred
from .table import json_problem

# Polygon text with its digits as "0" and its other usual characters as " ": plain numbers
# are then all that is left, and no run of LONG_DIGITS zeros means each is below 1e18.
POLYGON_TEXT = str.maketrans("0123456789.,-[] \t\r\n", "0" * 10 + " " * 9)
LONG_DIGITS = "0" * 19
DECODER = json.JSONDecoder()
try:
    from ._polygons import packed_polygons
except ImportError:  # not compiled (no C compiler at install): the same results, in Python
    packed_polygons = None


def segmentation_ok(seg: Any) -> bool:
    """Polygons (lists of numbers) or RLE (``counts`` text or run lengths, ``size`` [h, w]),
    with values the record can store (plain data: ``data_problem`` has nothing to say)."""
    # Stored one level down, in the image's list of segmentations: checked at that depth
    # (data_problem: numbers within int64 and finite, text valid, any other RLE keys too).
    if isinstance(seg, list):  # set(map(type)): COCO holds tens of millions of coordinates
        return (set(map(type, seg)) <= {list}
                and set(map(type, chain.from_iterable(seg))) <= NUMBER_TYPES
                and not data_problem(seg, 1))
    if isinstance(seg, dict):
        counts, size = seg.get("counts"), seg.get("size")
        return ((isinstance(counts, str)
                 or isinstance(counts, list) and set(map(type, counts)) <= {int}
                 and min(counts, default=0) >= 0)
                and isinstance(size, list) and len(size) == 2 and all(is_id(s) for s in size)
                and not data_problem(seg, 1))
    return False


def read_segmentation(aid: int, seg: Any) -> Tuple[Any, str]:
    """``(segmentation, "")`` if it is polygons or an RLE (parsed here if the main process
    left it as text; as stored bytes, ``PackedData``, where the accelerator took the text),
    else ``(None, why not)``. Polygon text that does not parse means the
    file is not JSON: that stops the build, as it would have had the whole file been parsed
    up front."""
    if type(seg) is Deferred:
        packed = packed_polygons(seg) if packed_polygons is not None else None
        if packed is not None:
            return PackedData(packed), ""
        polygons = plain_polygons(seg)
        if polygons is not None:
            return polygons, ""
        try:
            seg = json.loads(seg)
        except (ValueError, RecursionError) as e:
            raise PackerError(f"COCO annotation file: annotation {aid}'s 'segmentation' is not "
                              f"valid JSON ({json_problem(e)}); if the file was cut short or "
                              f"damaged (an interrupted download), fetch it again") from None
    if not segmentation_ok(seg):
        return None, ("'segmentation' must be polygons [[x1, y1, ...], ...] of finite numbers "
                      "or an RLE {\"counts\", \"size\"}")
    return seg, ""


def check_text(aid: int, seg: Any) -> None:
    """For an object that is not stored (its image skipped or dropped): a PackerError where
    its polygon text is not JSON, as for a stored one (``read_segmentation``), so a file
    that is not JSON stops the build whatever became of its images."""
    if type(seg) is Deferred:
        read_segmentation(aid, seg)


def plain_polygons(text: str) -> Any:
    """The polygons in ``text`` when it is the common case, known good without a walk over
    every number: only digits, signs, points, commas, brackets and spaces (no exponent, NaN
    or string), no run of 19 digits (so every number is an int64 and a finite float), and
    one bracket per polygon besides the outer one (so each holds numbers only). Else None:
    ``segmentation_ok`` decides, number by number."""
    shape = text.translate(POLYGON_TEXT)
    if shape.count("0") + shape.count(" ") != len(shape) or LONG_DIGITS in shape:
        return None
    try:
        polygons, end = DECODER.raw_decode(text)  # json.loads less its wrapping
    except (ValueError, RecursionError):  # the long way says what is wrong
        return None
    if (end == len(text) and set(map(type, polygons)) <= {list}  # text starts with "["
            and text.count("[") == len(polygons) + 1):
        return polygons
    return None
