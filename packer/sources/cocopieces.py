"""A large COCO file's ``annotations`` read by several processes at once.

On a 16-core box, one process parsing the annotations was most of what ``--coco`` added to
a build (the images wait for the annotations). ``read_pieces`` cuts the list into pieces
(``jsonchunks``); forked processes each parse one (polygons left as text,
``lazyjson``), check its records at a glance and send back, per image, its objects packed
with msgpack: one bytes object per image and piece, which the main process only files under
its image, and the build's workers unpack (``unpacked_objects``). Meanwhile the main
process hashes the file.

Anything unusual gives None and ``read_coco`` reads the file the serial way, which names
exactly what is wrong: a record that needs more than a glance, a cut that did not fall
between two items, a number msgpack cannot hold. The caller checks what needs the whole
list (ids used twice, image and category ids that are not listed).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import msgpack

from .._util.system import die_with_parent
from .jsonchunks import array_pieces, parse_around, parse_piece
from .lazyjson import Deferred, loads_deferring

INT64_MAX = 2 ** 63 - 1
NUMBER_TYPES = {int, float}  # JSON numbers; bool (true/false) is not one
PIECE_CHARS = 4 << 20  # at least this much text per process: below it, forking costs more
LAST_SHARE = 0.25      # the last piece may parse its polygons too (to find the list's end)

Object = Tuple[int, int, list, Any, int, Any]  # (id, category id, bbox, area, iscrowd, seg)


@dataclass
class Piece:
    """One piece's annotations: per image id, its objects (msgpack); every annotation id
    (``array("q")`` bytes), the category ids used, and where the list ended."""
    objects: Dict[int, bytes]
    ann_ids: bytes
    count: int
    categories: Set[int]
    end: int

    def ids(self) -> array:
        out = array("q")
        out.frombytes(self.ann_ids)
        return out


@dataclass
class Pieces:
    """The file read in pieces: the top-level object (``annotations`` not in it), the
    pieces in text order, and the file's sha256."""
    data: Dict[str, Any]
    pieces: List[Piece]
    digest: str


def is_id(v: Any) -> bool:
    """A COCO id: a JSON integer (not a boolean) within int64, not negative."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX


def glance(ann: Any) -> Optional[Object]:
    """The object of a common, well-formed annotation record (its ``image_id`` checked
    too), or None where it needs the checks that name a problem."""
    if type(ann) is dict:
        aid, iid, cid = ann.get("id"), ann.get("image_id"), ann.get("category_id")
        bbox, crowd = ann.get("bbox"), ann.get("iscrowd", 0)
        if (type(aid) is int and type(iid) is int and type(cid) is int
                and 0 <= aid | iid | cid <= INT64_MAX  # all in range: no min() or max() call
                and type(bbox) is list and len(bbox) == 4 and type(bbox[0]) in NUMBER_TYPES
                and type(bbox[1]) in NUMBER_TYPES and type(bbox[2]) in NUMBER_TYPES
                and type(bbox[3]) in NUMBER_TYPES and (crowd == 0 or crowd == 1)
                and type(crowd) is int):
            return aid, cid, bbox, ann.get("area"), crowd, ann.get("segmentation", [])
    return None


def read_pieces(text: str, raw: bytes, workers: int) -> Optional[Pieces]:
    """The file's annotations read by up to ``workers - 1`` forked processes, or None (read
    it the serial way: too small or too few cores to be worth it, or anything unusual)."""
    pieces = cut(text, workers - 1, PIECE_CHARS)  # one core left for this process's hashing
    if not pieces:
        return None
    share(text, pieces)
    try:
        with ProcessPoolExecutor(len(pieces), mp_context=mp.get_context("fork"),
                                 initializer=_start, initargs=(os.getpid(),)) as pool:
            futures = [pool.submit(read_piece, j) for j in range(len(pieces))]
            digest = hashlib.sha256(raw).hexdigest()  # while they parse
            read = [f.result() for f in futures]
    finally:
        share(None, [])
    return gathered(text, pieces, read, digest)


def cut(text: str, processes: int, min_chars: int) -> List[Tuple[int, Optional[int]]]:
    """Where to cut the ``annotations`` list for up to ``processes`` processes, each piece
    ``min_chars`` of text or more; empty when one process should read it all."""
    return array_pieces(text, "annotations", min(processes, len(text) // min_chars), LAST_SHARE)


def share(text: Optional[str], pieces: list) -> None:
    """The text and cuts ``read_piece`` works on: set before the processes that run it are
    forked (they inherit it), cleared after."""
    _READING[0] = (text, pieces) if text is not None else None


def gathered(text: str, pieces: list, read: List[Optional[Piece]], digest: str) -> Optional[Pieces]:
    """The pieces ``read_piece`` gave, with the rest of the file parsed around them; None
    where any piece, or the rest, needs the serial read."""
    if any(p is None for p in read):
        return None
    data = parse_around(text, pieces, read[-1].end, "annotations")
    return None if data is None else Pieces(data, read, digest)


def packed_row(row: Dict[str, Any]) -> Dict[str, Any]:
    """A row the serial read made (``{"image_id", "objects"}``) as plain data for another
    process: its objects packed as ``read_piece`` packs them, or as JSON text where msgpack
    cannot hold a number (an integer beyond 64 bits: the worker's checks name it)."""
    objs = [portable(obj) for obj in row["objects"]]
    try:
        return {"image_id": row["image_id"], "packed": [msgpack.packb(objs)]}
    except (OverflowError, ValueError, TypeError):
        return {"image_id": row["image_id"], "json": json.dumps(objs)}


def portable(obj: Object) -> list:
    """An object as plain data for another process: whether its segmentation is polygon
    text left unparsed (``Deferred``) goes with it."""
    aid, cid, bbox, area, crowd, seg = obj
    return [aid, cid, bbox, area, crowd, seg, type(seg) is Deferred]


def row_objects(row: Dict[str, Any]) -> List[Object]:
    """A row's objects, whichever form it came in (``objects``, ``packed`` or ``json``)."""
    if "objects" in row:
        return row["objects"]
    if "json" in row:
        return [(aid, cid, bbox, area, crowd, Deferred(seg) if deferred else seg)
                for aid, cid, bbox, area, crowd, seg, deferred in json.loads(row["json"])]
    return unpacked_objects(row["packed"])


def unpacked_objects(packed: List[bytes]) -> List[Object]:
    """The objects ``read_pieces`` packed for one image, in the file's order."""
    out: List[Object] = []
    for blob in packed:
        for aid, cid, bbox, area, crowd, seg, deferred in msgpack.unpackb(blob):
            out.append((aid, cid, bbox, area, crowd, Deferred(seg) if deferred else seg))
    return out


_READING: list = [None]  # (text, pieces) of the read in progress: forked processes inherit it


def _start(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    die_with_parent(parent)


def read_piece(j: int) -> Optional[Piece]:
    """Piece ``j`` of the shared text (``share``), parsed and checked at a glance; None where
    it needs the serial read. Runs in a forked process."""
    text, pieces = _READING[0]
    try:
        items, end = parse_piece(text, pieces[j],
                                 lambda s: loads_deferring(s, "segmentation", None))
    except (ValueError, RecursionError):
        return None
    by_image: Dict[int, list] = {}
    ids, categories = array("q"), set()
    for ann in items:
        obj = glance(ann)
        if obj is None:
            return None
        aid, cid, bbox, area, crowd, seg = obj
        ids.append(aid)
        categories.add(cid)
        by_image.setdefault(ann["image_id"], []).append(portable(obj))
    try:
        packed = {iid: msgpack.packb(objs) for iid, objs in by_image.items()}
    except (OverflowError, ValueError, TypeError):  # e.g. an integer beyond 64 bits
        return None
    return Piece(packed, ids.tobytes(), len(ids), categories, end)
