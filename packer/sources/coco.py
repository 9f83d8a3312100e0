"""COCO instances JSON (``--coco FILE``) as detection targets.

The stored fields are what ``torchvision.datasets.wrap_dataset_for_transforms_v2`` makes of
``CocoDetection``: XYXY pixel boxes and the COCO ``category_id`` as the label (not an index
into ``classes``), plus ``area``, ``iscrowd``, the annotation ids and the segmentation as
given. Only the images the JSON lists are packed (other files in the folder are not), in
ascending image id; an image's objects keep the JSON's order. The JSON's image widths and
heights are not trusted: boxes are fitted to the size of the decoded image.
"""
from __future__ import annotations

import gc
import hashlib
import json
from math import isfinite
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import PackerError
from ..format.fields import CheckedData, checked_array
from .base import Annotations, ImageList
from .._util.text import is_utf8
from .cocopieces import INT64_MAX, Pieces, glance, is_id, read_pieces, row_objects
from .lazyjson import loads_deferring
from .table import image_root, json_problem, read_data, relative_path, show, utf8_text
from .segmentation import check_text, read_segmentation

FLOAT32_MAX = 3.4028234663852886e38  # area is stored as float32


def coco_schema() -> List[Dict[str, Any]]:
    return [{"name": "image_id", "type": "int"},
            {"name": "boxes", "type": "array", "dtype": "float32", "shape": [-1, 4]},
            {"name": "labels", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "area", "type": "array", "dtype": "float32", "shape": [-1]},
            {"name": "iscrowd", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "ann_ids", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "segmentation", "type": "data"}]


def read_coco(images: os.PathLike, annotations_json: os.PathLike, *,
              skip_empty: bool = False, workers: int = 0) -> ImageList:
    """The images a COCO instances JSON lists, with their objects.

    A broken or ambiguous JSON (not JSON, missing keys, duplicate ids) stops the build; a
    single unusable image or object is left out with a reason in ``annotations.dropped``.
    ``skip_empty`` leaves out images with no usable object (counted in
    ``extra["skipped_empty"]``). Listed images whose file is missing are kept: the builder
    skips them as unreadable. With ``workers`` > 1, a large file's annotations are parsed by
    that many forked processes (``cocopieces``); the result is the same.
    """
    root = image_root(images)
    file = Path(annotations_json)
    raw = read_data(file, "COCO annotation file")
    with gc_paused():
        text = utf8_text(raw, file, "COCO annotation file")
        if workers > 1 and sys.platform == "linux":
            pieces = read_pieces(text, raw, workers)
            listed = pieces and coco_from_pieces(root, file, pieces, skip_empty)
            if listed:
                return listed
        return coco_images(root, file, raw, text, skip_empty)


def coco_images(root: Path, file: Path, raw: bytes, text: str, skip_empty: bool,
                digest: Optional[str] = None) -> ImageList:
    """``read_coco`` in this process. A row is ``{"image_id", "objects"}``, each object
    ``read_annotation``'s tuple as given; ``fit_coco`` turns it into the stored fields.
    ``digest``: the file's sha256 where the caller has it already."""
    with ThreadPoolExecutor(1) as pool:  # sha256 lets go of the GIL: it hashes during the parse
        hashing = pool.submit(lambda: digest or hashlib.sha256(raw).hexdigest())
        data = load_json(file, text)
    categories = read_categories(file, data["categories"])
    images_by_id, dropped, bad_ids = read_images(file, data["images"])
    rows = {i: {"image_id": i, "objects": []} for i in images_by_id}
    seen: Dict[int, int] = {}
    for k, ann in enumerate(data["annotations"]):
        obj = read_annotation(file, k, ann)
        aid, iid, cid = obj[0], ann["image_id"], obj[1]
        if aid in seen:
            raise PackerError(f"{file}: annotation id {aid} appears twice (annotations[{seen[aid]}]"
                              f" and annotations[{k}]); ids must be unique")
        seen[aid] = k
        if iid in rows and cid in categories:
            rows[iid]["objects"].append(obj)
            continue
        check_text(aid, obj[5])  # not stored, but a file that is not JSON stops the build
        if iid in bad_ids:
            continue  # its image is dropped, with the reason
        if iid not in rows:
            dropped.append({"path": file.name, "reason": f"annotation {aid}: image id {iid} is "
                            f"not in 'images'"})
        else:
            dropped.append({"path": images_by_id[iid], "reason": f"annotation {aid}: category "
                            f"id {cid} is not in 'categories'"})
    return coco_list(root, file, categories, images_by_id, rows, dropped, skip_empty,
                     hashing.result())


def coco_from_pieces(root: Path, file: Path, read: Pieces, skip_empty: bool):
    """``coco_images`` from a file read in pieces: a row is ``{"image_id", "packed"}``, the
    image's objects as ``read_pieces`` packed them. None where the serial read must say
    what is wrong: an annotation id used twice, an image or category id not listed."""
    data = dict(read.data, annotations=[])  # the pieces hold them
    check_lists(file, data)
    categories = read_categories(file, data["categories"])
    images_by_id, dropped, bad_ids = read_images(file, data["images"])
    ids: set = set()
    used: set = set()
    for piece in read.pieces:
        ids.update(piece.ids())
        used |= piece.categories
    if len(ids) != sum(p.count for p in read.pieces) or not used <= categories.keys():
        return None
    rows: Dict[int, Dict[str, Any]] = {i: {"image_id": i, "packed": []} for i in images_by_id}
    for piece in read.pieces:
        for iid, packed in piece.objects.items():
            row = rows.get(iid)
            if row is not None:
                row["packed"].append(packed)
            elif iid not in bad_ids:
                return None
            else:  # its image is dropped, with the reason
                check_row({"packed": [packed]})
    return coco_list(root, file, categories, images_by_id, rows, dropped, skip_empty,
                     read.digest)


def coco_list(root: Path, file: Path, categories: Dict[int, Dict[str, Any]],
              images_by_id: Dict[int, str], rows: Dict[int, Dict[str, Any]],
              dropped: List[Dict[str, str]], skip_empty: bool, digest: str) -> ImageList:
    """The images in ascending id, with their rows (those with objects, ``skip_empty``)."""
    order = sorted(images_by_id)
    if skip_empty:
        kept = [i for i in order if rows[i].get("objects") or rows[i].get("packed")]
        skipped, order = len(order) - len(kept), kept
        if not order:
            raise PackerError(f"{file}: no image has a usable annotation, so --skip-empty "
                              f"leaves nothing to pack")
    extra = coco_extra(categories)
    if skip_empty:
        extra["skipped_empty"] = skipped
    return coco_source(root, categories, images_by_id, order, [rows[i] for i in order], extra,
                       dropped, digest)


def coco_extra(categories: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    return {"categories": [categories[c] for c in sorted(categories)]}


def coco_source(root: Path, categories: Dict[int, Dict[str, Any]], images_by_id: Dict[int, str],
                order: List[int], rows, extra: Dict[str, Any], dropped: List[Dict[str, str]],
                digest: str) -> ImageList:
    """The ImageList of images ``order`` (ids) with their ``rows`` (None: not read yet)."""
    ann = Annotations(schema=coco_schema(), rows=rows, fit=fit_coco, task="detection",
                      extra=extra, dropped=dropped, digest=digest, check=check_row)
    classes = [categories[c]["name"] for c in sorted(categories)]
    return ImageList(root, classes, [(images_by_id[i], -1) for i in order], ann)


@contextmanager
def gc_paused():
    """No garbage collection while parsing, which makes millions of objects and no garbage;
    what it made joins the oldest generation (it lives as long as the build), so no young
    collection walks it afterwards either."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if was:
            gc.enable()


def load_json(file: Path, text: str) -> Dict[str, Any]:
    """The top-level object, with its three lists present."""
    try:
        data = loads_deferring(text, "segmentation", "annotations")  # polygons: by the workers
    except json.JSONDecodeError as e:
        raise PackerError(f"{file}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); if the "
                          f"file was cut short (an interrupted download), fetch it again") \
            from None
    except (ValueError, RecursionError) as e:
        raise PackerError(f"{file}: not valid JSON ({json_problem(e)})") from None
    check_lists(file, data)
    return data


def check_lists(file: Path, data: Any) -> None:
    """A PackerError unless ``data`` is an object with the three lists, the images and
    categories not empty."""
    if not isinstance(data, dict):
        raise PackerError(f"{file}: expected a COCO instances object with 'images', "
                          f"'annotations' and 'categories', got {kind_of(data)}")
    for key in ("images", "annotations", "categories"):
        if key not in data:
            raise PackerError(f"{file}: no '{key}' list; --coco needs an instances file "
                              f"(e.g. instances_val2017.json) with images, annotations and "
                              f"categories")
        if not isinstance(data[key], list):
            raise PackerError(f"{file}: '{key}' must be a list, got {kind_of(data[key])}")
    if not data["images"]:
        raise PackerError(f"{file}: 'images' is empty; there is nothing to pack")
    if not data["categories"]:
        raise PackerError(f"{file}: 'categories' is empty; objects need a category")


def kind_of(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null",
            bool: "a boolean", int: "a number", float: "a number"}.get(type(v), "a value")


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def need(file: Path, where: str, rec: Any, key: str, ok, what: str) -> Any:
    """``rec[key]`` if ``ok`` accepts it, else a PackerError naming the record."""
    if not isinstance(rec, dict):
        raise PackerError(f"{file}: {where} must be an object, got {kind_of(rec)}")
    if key not in rec:
        raise PackerError(f"{file}: {where} has no '{key}'")
    if not ok(rec[key]):
        raise PackerError(f"{file}: {where}: '{key}' must be {what}, got "
                          f"{show(json.dumps(rec[key]))[:80]}")
    return rec[key]


def read_categories(file: Path, cats: List[Any]) -> Dict[int, Dict[str, Any]]:
    """id -> ``{"id", "name"[, "supercategory"]}``; ids and names must be unique."""
    out: Dict[int, Dict[str, Any]] = {}
    names: Dict[str, int] = {}
    for k, cat in enumerate(cats):
        where = f"categories[{k}]"
        cid = need(file, where, cat, "id", is_id, "a non-negative integer")
        name = need(file, where, cat, "name", lambda v: isinstance(v, str) and v and is_utf8(v),
                     "a non-empty UTF-8 string")
        if cid in out:
            raise PackerError(f"{file}: category id {cid} appears twice; ids must be unique")
        if name in names:
            raise PackerError(f"{file}: categories {names[name]} and {cid} are both named "
                              f"{show(name)!r}; give each category its own name")
        names[name] = cid
        out[cid] = {"id": cid, "name": name}
        sup = cat.get("supercategory")
        if isinstance(sup, str) and is_utf8(sup):
            out[cid]["supercategory"] = sup
    return out


def read_images(file: Path, imgs: List[Any]) -> Tuple[Dict[int, str], List[Dict[str, str]], set]:
    """id -> path for usable images; the unusable ones (bad file names) dropped."""
    by_id: Dict[int, str] = {}
    by_path: Dict[str, int] = {}
    dropped: List[Dict[str, str]] = []
    bad = set()
    for k, img in enumerate(imgs):
        iid, name = read_image(file, k, img)
        if iid in by_id or iid in bad:
            raise PackerError(f"{file}: image id {iid} appears twice in 'images'; ids must be "
                              f"unique")
        rel, problem = relative_path(name)
        if problem:
            bad.add(iid)
            dropped.append({"path": show(name) if isinstance(name, str) else f"image id {iid}",
                            "reason": f"image id {iid}: file_name {problem}"})
            continue
        if rel in by_path:
            raise PackerError(f"{file}: images {by_path[rel]} and {iid} are both "
                              f"{show(rel)!r}; list each file once")
        by_path[rel] = iid
        by_id[iid] = rel
    return by_id, dropped, bad


def read_image(file: Path, k: int, img: Any) -> Tuple[int, Any]:
    """``(id, file_name)`` of ``images[k]``: the common, well-formed record at a glance
    (``checked_image`` gives the same for it), anything else through ``checked_image``."""
    if type(img) is dict:
        iid, name = img.get("id"), img.get("file_name")
        if type(iid) is int and 0 <= iid <= INT64_MAX and name is not None:
            return iid, name
    return checked_image(file, k, img)


def checked_image(file: Path, k: int, img: Any) -> Tuple[int, Any]:
    """``read_image``, each field checked on its own, or a PackerError naming the first
    problem (the file name is checked by ``read_images``)."""
    iid = need(file, f"images[{k}]", img, "id", is_id, "a non-negative integer")
    return iid, need(file, f"images[{k}] (id {iid})", img, "file_name", lambda v: True, "")


def read_annotation(file: Path, k: int, ann: Any) -> Tuple[int, int, list, Any, int, Any]:
    """``(id, category id, bbox, area, iscrowd, segmentation)`` of ``annotations[k]``, its
    image id checked too: the common, well-formed record at a glance (``checked_annotation``
    gives the same for it), anything else through the checks that name the problem."""
    return glance(ann) or checked_annotation(file, k, ann)


def checked_annotation(file: Path, k: int, ann: Any) -> Tuple[int, int, list, Any, int, Any]:
    """``read_annotation``, each field checked on its own, or a PackerError naming the first
    problem. ``area`` and the segmentation are checked by ``fit_coco``, in the workers."""
    aid = need(file, f"annotations[{k}]", ann, "id", is_id, "a non-negative integer")
    where = f"annotations[{k}] (id {aid})"
    need(file, where, ann, "image_id", is_id, "a non-negative integer")
    cid = need(file, where, ann, "category_id", is_id, "a non-negative integer")
    bbox = need(file, where, ann, "bbox", lambda v: isinstance(v, list) and len(v) == 4
                and all(is_number(x) for x in v), "[x, y, width, height]")
    crowd = ann.get("iscrowd", 0)
    if crowd not in (0, 1) or isinstance(crowd, float):
        raise PackerError(f"{file}: {where}: 'iscrowd' must be 0 or 1, got "
                          f"{show(json.dumps(crowd))[:80]}")
    return aid, cid, bbox, ann.get("area"), int(crowd), ann.get("segmentation", [])


def shown_box(box) -> str:
    return "[" + ", ".join(f"{v:g}" for v in box) + "]"


def check_row(row: Dict[str, Any]) -> None:
    """``Annotations.check``: the row's polygon text must be JSON, its image stored or not."""
    for obj in row_objects(row):
        check_text(obj[0], obj[5])


def fit_coco(row: Dict[str, Any], width: int, height: int):
    """The row's objects as torchvision-style targets: XYWH boxes -> XYXY clipped to the
    image; degenerate or outside boxes and unusable segmentations dropped (with the
    object's other fields, so every per-object array stays aligned). The arrays come out
    as stored (``checked_array``): every value was checked here or by the read."""
    boxes: List[float] = []
    labels, area, crowds, ids = [], [], [], []
    segmentation = CheckedData()
    reasons = []
    for aid, cid, box, a, crowd, seg in row_objects(row):
        seg, problem = read_segmentation(aid, seg)  # first: text that is not JSON stops the build
        xyxy, box_problem = fit_box(box, width, height)
        problem = box_problem or problem
        if problem:
            reasons.append(f"annotation {aid}: {problem}")
            continue
        boxes += xyxy
        labels.append(cid)
        area.append(a if type(a) is float and 0.0 <= a <= FLOAT32_MAX else object_area(a, xyxy))
        crowds.append(crowd)
        ids.append(aid)
        segmentation.append(seg)
    return {"image_id": row["image_id"], "boxes": checked_array("f", boxes),
            "labels": checked_array("q", labels), "area": checked_array("f", area),
            "iscrowd": checked_array("q", crowds), "ann_ids": checked_array("q", ids),
            "segmentation": segmentation}, reasons


def fit_box(box: List[Any], width: int, height: int) -> Tuple[List[float], str]:
    """``([x0, y0, x1, y1] clipped to the image, "")``, or ``([], why the box is unusable)``."""
    try:
        x, y, w, h = map(float, box)
    except OverflowError:
        return [], "box holds a number too large for a float"
    if not isfinite(x + y + w + h):
        return [], f"box {shown_box(box)} holds a non-finite number"
    if w <= 0 or h <= 0:
        return [], f"zero or negative size box {shown_box(box)}"
    # max(x, 0.0) and min(x + w, width), written out: every image's every object comes here
    x0, y0, x1, y1 = 0.0 if x < 0.0 else x, 0.0 if y < 0.0 else y, x + w, y + h
    x1, y1 = width if x1 > width else x1, height if y1 > height else y1
    if x1 <= x0 or y1 <= y0:
        return [], f"box {shown_box(box)} lies outside the {width}x{height} image"
    return [x0, y0, float(x1), float(y1)], ""


def object_area(area: Any, xyxy: List[float]) -> float:
    """The annotation's ``area`` if it is a finite non-negative number, else the box's."""
    try:
        a = float(area) if is_number(area) else -1.0
    except OverflowError:
        a = -1.0
    return a if 0 <= a <= FLOAT32_MAX else (xyxy[2] - xyxy[0]) * (xyxy[3] - xyxy[1])
