"""COCO instances JSON (``--coco FILE``) as detection targets.

The stored fields are what ``torchvision.datasets.wrap_dataset_for_transforms_v2`` makes of
``CocoDetection``: XYXY pixel boxes and the COCO ``category_id`` as the label (not an index
into ``classes``), plus ``area``, ``iscrowd``, the annotation ids and the segmentation as
given. Only the images the JSON lists are packed (other files in the folder are not), in
ascending image id; an image's objects keep the JSON's order. The JSON's image widths and
heights are not trusted: boxes are fitted to the size of the decoded image.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import PackerError
from ..source import Annotations, ImageList, is_utf8
from .meta import image_root, read_text, relative_path, show

INT64_MAX = 2 ** 63 - 1
NUMBER_TYPES = {int, float}  # JSON numbers; bool (true/false) is not one


def coco_schema() -> List[Dict[str, Any]]:
    return [{"name": "image_id", "type": "int"},
            {"name": "boxes", "type": "array", "dtype": "float32", "shape": [-1, 4]},
            {"name": "labels", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "area", "type": "array", "dtype": "float32", "shape": [-1]},
            {"name": "iscrowd", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "ann_ids", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "segmentation", "type": "data"}]


def read_coco(images: os.PathLike, annotations_json: os.PathLike, *,
              skip_empty: bool = False) -> ImageList:
    """The images a COCO instances JSON lists, with their objects.

    A broken or ambiguous JSON (not JSON, missing keys, duplicate ids) stops the build; a
    single unusable image or object is left out with a reason in ``annotations.dropped``.
    ``skip_empty`` leaves out images with no usable object (counted in
    ``extra["skipped_empty"]``). Listed images whose file is missing are kept: the builder
    skips them as unreadable.
    """
    root = image_root(images)
    file = Path(annotations_json)
    data = load_json(file)
    categories = read_categories(file, data["categories"])
    images_by_id, dropped, bad_ids = read_images(file, data["images"])
    rows = {i: {"image_id": i, "bbox": [], "labels": [], "area": [], "iscrowd": [],
                "ann_ids": [], "segmentation": []} for i in images_by_id}
    seen: Dict[int, int] = {}
    for k, ann in enumerate(data["annotations"]):
        aid, iid, cid, obj = read_annotation(file, k, ann)
        if aid in seen:
            raise PackerError(f"{file}: annotation id {aid} appears twice (annotations[{seen[aid]}]"
                              f" and annotations[{k}]); ids must be unique")
        seen[aid] = k
        if iid in bad_ids:
            continue  # its image is dropped, with the reason
        if iid not in rows:
            dropped.append({"path": file.name, "reason": f"annotation {aid}: image id {iid} is "
                            f"not in 'images'"})
        elif cid not in categories:
            dropped.append({"path": images_by_id[iid], "reason": f"annotation {aid}: category "
                            f"id {cid} is not in 'categories'"})
        else:
            row = rows[iid]
            for key in ("bbox", "area", "iscrowd", "segmentation"):
                row[key].append(obj[key])
            row["labels"].append(cid)
            row["ann_ids"].append(aid)
    order = sorted(images_by_id)
    if skip_empty:
        kept = [i for i in order if rows[i]["ann_ids"]]
        skipped, order = len(order) - len(kept), kept
        if not order:
            raise PackerError(f"{file}: no image has a usable annotation, so --skip-empty "
                              f"leaves nothing to pack")
    extra: Dict[str, Any] = {"categories": [categories[c] for c in sorted(categories)]}
    if skip_empty:
        extra["skipped_empty"] = skipped
    ann = Annotations(schema=coco_schema(), rows=[rows[i] for i in order], fit=fit_coco,
                      task="detection", extra=extra, dropped=dropped)
    classes = [categories[c]["name"] for c in sorted(categories)]
    return ImageList(root, classes, [(images_by_id[i], -1) for i in order], ann)


def load_json(file: Path) -> Dict[str, Any]:
    """The top-level object, with its three lists present."""
    text = read_text(file, "COCO annotation file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PackerError(f"{file}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); if the "
                          f"file was cut short (an interrupted download), fetch it again") \
            from None
    except RecursionError:
        raise PackerError(f"{file}: JSON nested too deeply to read") from None
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
    return data


def kind_of(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null",
            bool: "a boolean", int: "a number", float: "a number"}.get(type(v), "a value")


def is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX


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
        iid = need(file, f"images[{k}]", img, "id", is_id, "a non-negative integer")
        name = need(file, f"images[{k}] (id {iid})", img, "file_name", lambda v: True, "")
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


def read_annotation(file: Path, k: int, ann: Any) -> Tuple[int, int, int, Dict[str, Any]]:
    """``(id, image id, category id, fields)``, the record's shape checked (the common,
    well-formed record at a glance; anything else through the checks that name the problem)."""
    if type(ann) is dict:
        aid, iid, cid = ann.get("id"), ann.get("image_id"), ann.get("category_id")
        bbox, area, crowd = ann.get("bbox"), ann.get("area"), ann.get("iscrowd", 0)
        seg = ann.get("segmentation", [])
        if (type(aid) is int and type(iid) is int and type(cid) is int
                and 0 <= min(aid, iid, cid) and max(aid, iid, cid) <= INT64_MAX
                and type(bbox) is list and len(bbox) == 4 and set(map(type, bbox)) <= NUMBER_TYPES
                and (crowd == 0 or crowd == 1) and type(crowd) is int
                and type(area) in NUMBER_TYPES and math.isfinite(area) and area >= 0
                and segmentation_ok(seg)):
            return aid, iid, cid, {"bbox": [float(x) for x in bbox], "area": float(area),
                                   "iscrowd": crowd, "segmentation": seg}
    aid = need(file, f"annotations[{k}]", ann, "id", is_id, "a non-negative integer")
    where = f"annotations[{k}] (id {aid})"
    iid = need(file, where, ann, "image_id", is_id, "a non-negative integer")
    cid = need(file, where, ann, "category_id", is_id, "a non-negative integer")
    bbox = need(file, where, ann, "bbox", lambda v: isinstance(v, list) and len(v) == 4
                and all(is_number(x) for x in v), "[x, y, width, height]")
    area: Optional[float] = ann.get("area")
    area = float(area) if is_number(area) and math.isfinite(area) and area >= 0 else None
    crowd = ann.get("iscrowd", 0)
    if crowd not in (0, 1) or isinstance(crowd, float):
        raise PackerError(f"{file}: {where}: 'iscrowd' must be 0 or 1, got "
                          f"{show(json.dumps(crowd))[:80]}")
    seg = ann.get("segmentation", [])
    if not segmentation_ok(seg):
        raise PackerError(f"{file}: {where}: 'segmentation' must be a list of polygons "
                          f"[[x1, y1, ...], ...] or an RLE {{\"counts\", \"size\"}}")
    return aid, iid, cid, {"bbox": [float(x) for x in bbox], "area": area,
                           "iscrowd": int(crowd), "segmentation": seg}


def segmentation_ok(seg: Any) -> bool:
    """Polygons (lists of numbers) or RLE (``counts`` text or run lengths, ``size`` [h, w])."""
    if isinstance(seg, list):  # set(map(type)): COCO holds tens of millions of coordinates
        return all(isinstance(p, list) and set(map(type, p)) <= NUMBER_TYPES for p in seg)
    if isinstance(seg, dict):
        counts, size = seg.get("counts"), seg.get("size")
        return ((isinstance(counts, str) and is_utf8(counts)
                 or isinstance(counts, list) and set(map(type, counts)) <= {int}
                 and min(counts, default=0) >= 0)
                and isinstance(size, list) and len(size) == 2 and all(is_id(s) for s in size))
    return False


def shown_box(box) -> str:
    return "[" + ", ".join(f"{v:g}" for v in box) + "]"


def fit_coco(row: Dict[str, Any], width: int, height: int):
    """XYWH boxes -> XYXY clipped to the image; degenerate or outside boxes dropped (with
    their other fields, so every per-object array stays aligned)."""
    boxes, labels, areas, crowd, ids, segs = [], [], [], [], [], []
    reasons = []
    for i, box in enumerate(row["bbox"]):
        aid = row["ann_ids"][i]
        x, y, w, h = box
        if not math.isfinite(x + y + w + h):
            reasons.append(f"annotation {aid}: box {shown_box(box)} holds a non-finite number")
            continue
        if w <= 0 or h <= 0:
            reasons.append(f"annotation {aid}: zero or negative size box {shown_box(box)}")
            continue
        x0, y0, x1, y1 = max(x, 0.0), max(y, 0.0), min(x + w, width), min(y + h, height)
        if x1 <= x0 or y1 <= y0:
            reasons.append(f"annotation {aid}: box {shown_box(box)} lies outside the "
                           f"{width}x{height} image")
            continue
        area = row["area"][i]
        boxes.append([float(x0), float(y0), float(x1), float(y1)])
        labels.append(row["labels"][i])
        areas.append(area if area is not None else float((x1 - x0) * (y1 - y0)))
        crowd.append(row["iscrowd"][i])
        ids.append(aid)
        segs.append(row["segmentation"][i])
    return {"image_id": row["image_id"], "boxes": boxes, "labels": labels, "area": areas,
            "iscrowd": crowd, "ann_ids": ids, "segmentation": segs}, reasons
