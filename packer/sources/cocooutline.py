"""A COCO file's images and categories, read before its annotations, so that a build's
workers check the images while the annotations are parsed.

The annotations are nearly all of a COCO file's text; a 16-core build's workers waited for
them. ``coco_outline`` reads only what the workers need to start: the images (their order,
the shards) and the categories (the classes and the resume fingerprint). ``Outline.finish``
then reads the whole file as ``read_coco`` does (its ``annotations`` in pieces by the
build's own workers where it is large, ``Outline.start``); the builder hands the rows over
and checks that the full read lists the same images and classes.

Finding them without parsing the annotations: the text up to the first ``"annotations": [``,
closed with ``null}``, parses only if that key is at the top level (a key deeper down leaves
brackets open, and none can sit inside a string, whose quotes are escaped); it holds the
top-level keys before it. ``{`` plus the text from the last ``"categories": [`` parses only
if that key is at the top level too; it holds the keys after it. A file laid out otherwise,
or whose images or categories need the checks that name a problem, gets no outline: the
build reads it the serial way, which says what is wrong.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, List, Optional

from ..errors import PackerError
from .base import ImageList
from .coco import coco_extra, coco_from_pieces, coco_images, coco_source, gc_paused, read_categories, read_images
from .cocopieces import cut, gathered, packed_row, read_piece, share
from .table import image_root, read_data, utf8_text

ANNOTATIONS_KEY = re.compile(r'"annotations"\s*:\s*\[')
CATEGORIES_KEY = re.compile(r'"categories"\s*:\s*\[')
PIECE_CHARS = 1 << 20  # the build's workers are running already: no fork to pay for


@dataclass
class Outline:
    """``source``: the images in build order, the classes, the annotations' schema and
    digest, and no rows yet. ``finish`` gives the same source with its rows."""
    source: ImageList
    file: Path
    raw: bytes
    text: str
    pieces: list  # cuts of the annotations for the build's workers (empty: read here)

    def start(self, submit: Callable[..., Future]) -> List[Future]:
        """The pieces' parses, handed to the build's pool before any shard (its workers
        were forked after ``coco_outline``, so they hold the text)."""
        return [submit(read_piece, j) for j in range(len(self.pieces))]

    def finish(self, started: List[Future]) -> ImageList:
        """The whole file read (``read_coco``'s result), its rows as plain data a worker
        can take (``packed_row``). PackerError where the file is broken."""
        try:
            read = [f.result() for f in started]
        finally:
            share(None, [])
        root, digest = self.source.root, self.source.annotations.digest
        raw, text, self.raw, self.text = self.raw, self.text, b"", ""  # not kept for the build
        with gc_paused():
            got = gathered(text, self.pieces, read, digest) if self.pieces else None
            full = got and coco_from_pieces(root, self.file, got, False)
            if full:
                return full
            full = coco_images(root, self.file, raw, text, False, digest)
            rows = [packed_row(r) for r in full.annotations.rows]
        return replace(full, annotations=replace(full.annotations, rows=rows))


def coco_outline(images: os.PathLike, annotations_json: os.PathLike,
                 workers: int) -> Optional[Outline]:
    """The outline of a COCO file for a build with ``workers`` processes, or None where the
    build should read it whole first (an unusual layout, or images or categories with a
    problem: the serial read names it)."""
    root, file = image_root(images), Path(annotations_json)
    raw = read_data(file, "COCO annotation file")
    with gc_paused(), ThreadPoolExecutor(1) as pool:  # sha256 lets go of the GIL: it
        digest = pool.submit(hashlib.sha256, raw)      # hashes while this thread reads
        text = utf8_text(raw, file, "COCO annotation file")
        found = top_level_lists(text)
        if found is None:
            return None
        try:
            categories = read_categories(file, found["categories"])
            images_by_id = read_images(file, found["images"])[0]
        except PackerError:
            return None
        pieces = cut(text, workers - 1, PIECE_CHARS)
        source = coco_source(root, categories, images_by_id, sorted(images_by_id), None,
                             coco_extra(categories), [], digest.result().hexdigest())
    share(text, pieces)
    return Outline(source, file, raw, text, pieces)


def top_level_lists(text: str) -> Optional[dict]:
    """The top-level ``images`` and ``categories`` lists, both not empty, found without
    parsing the annotations; None where the text is not laid out for that."""
    m = ANNOTATIONS_KEY.search(text)
    if m is None:
        return None
    head = loads_object(text[:m.end() - 1] + "null}")
    if head is None or head.get("annotations", 0) is not None:
        return None
    found = {"images": head.get("images"), "categories": head.get("categories")}
    at = text.rfind('"categories"')
    if at > m.end() and CATEGORIES_KEY.match(text, at):
        tail = loads_object("{" + text[at:])
        if tail is None or found["categories"] is not None or "images" in tail \
                or "annotations" in tail:
            return None
        found["categories"] = tail["categories"]
    if not all(type(v) is list and v for v in found.values()):
        return None
    return found


def loads_object(text: str) -> Optional[dict]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return data if type(data) is dict else None
