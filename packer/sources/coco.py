"""COCO instances JSON (``Coco(images, annotations)``; ``--coco FILE``) as detection targets,
stored as ``wrap_dataset_for_transforms_v2`` makes them (XYXY boxes, ``category_id`` labels).
msgspec reads it, so errors name the JSON path; segmentations are checked by ``fit_coco``."""
from __future__ import annotations

import codecs
import hashlib
import os
import sys
from array import array
from concurrent.futures import ThreadPoolExecutor
from math import inf, isfinite
from pathlib import Path
from typing import Annotated, Any, Dict, List, Optional, Tuple, Union

import msgspec
from msgspec import Meta, Raw, Struct

from ..errors import PackerError
from ..storage.files import folder, source_file
from .base import FLOAT32_MAX, Annotations, ImageList, Source, image_root, read_data, relative_path, show, utf8_text
from .segmentation import INT64_MAX, stored_segmentation

Id = Annotated[int, Meta(ge=0, le=INT64_MAX)]
# What a value must be, by the name of its key: added to msgspec's own words.
HINTS = {**dict.fromkeys(("id", "image_id", "category_id"), "a non-negative integer id"),
         "bbox": "[x, y, width, height] numbers", "iscrowd": "0 or 1", "name": "a non-empty string",
         "images": "a list of {\"id\", \"file_name\"}",
         "annotations": "a list of {\"id\", \"image_id\", \"category_id\", \"bbox\"}",
         "categories": "a list of {\"id\", \"name\"}"}


class Image(Struct, gc=False):
    id: Id
    file_name: Any  # a name that is no safe relative path drops the image, with the reason


class Category(Struct, gc=False):
    id: Id
    name: Annotated[str, Meta(min_length=1)]
    supercategory: Any = None  # kept where it is a string


class Annotation(Struct, gc=False):
    """One object as the file gives it; ``fit_coco`` makes its stored fields."""
    id: Id
    image_id: Id
    category_id: Id
    bbox: Tuple[float, float, float, float]
    area: Any = None  # the box's area where this is no finite number >= 0 (float32)
    # true/false too (coco-annotator writes them; pycocotools and torchvision read them)
    iscrowd: Union[bool, Annotated[int, Meta(ge=0, le=1)]] = 0
    segmentation: Raw = Raw(b"[]")


class Instances(Struct):
    images: List[Image]
    annotations: List[Annotation]
    categories: List[Category] = []  # none (torchvision's test files): any category id


class Row(Struct, gc=False):
    """An image's annotation row: its id and its usable objects, in the file's order."""
    image_id: int
    objects: List[Annotation]


INSTANCES = msgspec.json.Decoder(Instances)
WHO = "Coco(images, annotations)"


def coco_schema() -> List[Dict[str, Any]]:
    return [{"name": "image_id", "type": "int"},
            {"name": "boxes", "type": "array", "dtype": "float32", "shape": [-1, 4]},
            {"name": "labels", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "area", "type": "array", "dtype": "float32", "shape": [-1]},
            {"name": "iscrowd", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "ann_ids", "type": "array", "dtype": "int64", "shape": [-1]},
            {"name": "segmentation", "type": "data"}]


class Coco(Source):
    """The images under ``images`` that the COCO instances JSON ``annotations`` lists, with their
    objects; ``skip_empty`` leaves out images with no usable object (``skipped_empty``)."""

    def __init__(self, images: os.PathLike, annotations: os.PathLike, skip_empty: bool = False,
                 *, storage_options: Optional[dict] = None):
        self.root, self.annotations = folder(images, storage_options), \
            source_file(annotations, storage_options)
        self.skip_empty = skip_empty

    def read(self) -> ImageList:
        return read_coco(self.root, self.annotations, skip_empty=self.skip_empty)

    def options(self) -> Dict[str, Any]:
        return {"coco": str(self.annotations), **({"skip_empty": True} if self.skip_empty else {})}


def read_coco(images: os.PathLike, annotations_json: os.PathLike, *,
              skip_empty: bool = False) -> ImageList:
    """``Coco(images, annotations_json, skip_empty).read()``: rows of ``Row``, digest sha256."""
    root = image_root(images, WHO)
    file = source_file(annotations_json)
    raw = read_data(file, f"{WHO}: annotations")
    with ThreadPoolExecutor(1) as pool:  # sha256 lets go of the GIL: it hashes during the parse
        hashing = pool.submit(lambda: hashlib.sha256(raw).hexdigest())
        data = decode(file, raw)
    categories = read_categories(file, data.categories)
    paths, dropped, bad = read_images(file, data.images)
    rows = {i: Row(i, []) for i in paths}
    seen: set = set()
    for k, ann in enumerate(data.annotations):
        seen.add(ann.id)
        if len(seen) <= k:
            first = next(j for j, a in enumerate(data.annotations) if a.id == ann.id)
            raise PackerError(f"{file}: $.annotations[{k}].id: annotation id {ann.id} appears "
                              f"twice ($.annotations[{first}] and [{k}]); ids must be unique")
        row = rows.get(ann.image_id)
        if row is not None and (ann.category_id in categories or not categories):
            row.objects.append(ann)
        elif row is not None:
            dropped.append({"path": paths[ann.image_id], "reason": f"annotation {ann.id}: "
                            f"category id {ann.category_id} is not in 'categories'"})
        elif ann.image_id not in bad:  # else its image is dropped, with the reason
            dropped.append({"path": file.name, "reason": f"annotation {ann.id}: image id "
                            f"{ann.image_id} is not in 'images'"})
    order = sorted(paths)
    cats = [categories[c] for c in sorted(categories)]
    extra: Dict[str, Any] = {"categories": cats}
    if skip_empty:
        kept = [i for i in order if any(usable_box(a.bbox) for a in rows[i].objects)]
        extra["skipped_empty"], order = len(order) - len(kept), kept
        if not order:
            raise PackerError(f"{file}: no image has a usable annotation, so {WHO[:-1]}, "
                              f"skip_empty=True) leaves nothing to pack")
    ann = Annotations(schema=coco_schema(), rows=[rows[i] for i in order], fit=fit_coco,
                      task="detection", extra=extra, dropped=dropped, digest=hashing.result(),
                      stored=True)
    return ImageList(root, [c["name"] for c in cats], [(paths[i], -1) for i in order], ann)


def decode(file: Path, raw: bytes) -> Instances:
    """The file's top-level object, typed; a PackerError naming what is wrong, and where."""
    if not raw.isascii():
        utf8_text(raw, file, f"{WHO}: annotations")  # refuses bytes that are not UTF-8
    view = memoryview(raw)[3:] if raw.startswith(codecs.BOM_UTF8) else raw
    try:
        data = INSTANCES.decode(view)
    except msgspec.ValidationError as e:
        raise PackerError(f"{file}: {validation_message(str(e))}") from None
    except msgspec.DecodeError as e:
        at = str(e).rpartition("(byte ")[2].rstrip(")")
        at = int(at) if at.isdigit() else len(view)  # "truncated": at the end
        line = bytes(view[:at]).count(b"\n") + 1
        column = at - bytes(view[:at]).rfind(b"\n")
        reason = str(e).replace("JSON is malformed: ", "").split(" (byte ")[0]
        raise PackerError(f"{file}:{line}:{column}: not valid JSON ({reason[0].lower()}"
                          f"{reason[1:]}); if the file was cut short (an interrupted "
                          f"download), fetch it again") from None
    except RecursionError:
        raise PackerError(f"{file}: not valid JSON (nested too deeply)") from None
    if not data.images:
        raise PackerError(f"{file}: $.images is empty; there is nothing to pack")
    return data


def validation_message(text: str) -> str:
    """msgspec's ``Expected `int` >= 0 - at `$.images[1].id``` as ``$.images[1].id:
    expected int >= 0 (a non-negative integer id)``."""
    what, _, where = text.partition(" - at ")
    where = where.strip("`") or "$"
    key = where.rpartition(".")[2].split("[")[0] if where != "$" else ""
    if what.startswith("Object missing required field"):
        key = what.rpartition(" ")[2].strip("`")
    hint = f" ({key}: {HINTS[key]})" if key in HINTS else ""
    if where == "$" and what.startswith("Expected `object`"):
        hint = " (a COCO instances object with images, annotations and categories)"
    return f"{where}: {what[0].lower()}{what[1:].replace('`', '')}{hint}"


def read_categories(file: Path, cats: List[Category]) -> Dict[int, Dict[str, Any]]:
    """id -> ``{"id", "name"[, "supercategory"]}``; ids and names must be unique."""
    out: Dict[int, Dict[str, Any]] = {}
    names: Dict[str, int] = {}
    for k, cat in enumerate(cats):
        if cat.id in out:
            raise PackerError(f"{file}: $.categories[{k}].id: category id {cat.id} appears "
                              f"twice; ids must be unique")
        if cat.name in names:
            raise PackerError(f"{file}: $.categories[{k}].name: categories {names[cat.name]} "
                              f"and {cat.id} are both named {show(cat.name)!r}; give each "
                              f"category its own name")
        names[cat.name] = cat.id
        out[cat.id] = {"id": cat.id, "name": cat.name}
        if isinstance(cat.supercategory, str):
            out[cat.id]["supercategory"] = cat.supercategory
    return out


def read_images(file: Path, imgs: List[Image]) -> Tuple[Dict[int, str], List[Dict[str, str]], set]:
    """id -> path of the usable images (ids may share a file), and the others' reasons and ids."""
    by_id: Dict[int, str] = {}
    dropped: List[Dict[str, str]] = []
    bad = set()
    for k, img in enumerate(imgs):
        iid, name = img.id, img.file_name
        if iid in by_id or iid in bad:
            raise PackerError(f"{file}: $.images[{k}].id: image id {iid} appears twice in "
                              f"'images'; ids must be unique")
        rel, problem = relative_path(name)
        if problem:
            bad.add(iid)
            dropped.append({"path": show(name) if isinstance(name, str) else f"image id {iid}",
                            "reason": f"image id {iid}: file_name {problem}"})
            continue
        by_id[iid] = rel
    return by_id, dropped, bad


def fit_coco(row: Row, width: int, height: int):
    """The row's objects as stored torchvision-style targets: XYWH -> XYXY clipped to the image
    (float32, as torchvision's wrapper, to the bit); a bad box or segmentation drops its object."""
    boxes: List[float] = []
    labels, area, crowds, ids, segmentation, reasons = [], [], [], [], [], []
    for obj in row.objects:
        xyxy, problem = fit_box(obj.bbox, width, height)
        seg, problem = (None, problem) if problem else \
            stored_segmentation(obj.segmentation, width, height)
        if seg is None:
            reasons.append(f"annotation {obj.id}: {problem}")
            continue
        boxes += xyxy
        labels.append(obj.category_id)
        a = obj.area
        area.append(a if type(a) is float and 0.0 <= a <= FLOAT32_MAX else object_area(a, xyxy))
        crowds.append(obj.iscrowd)
        ids.append(obj.id)
        segmentation.append(seg)
    return {"image_id": row.image_id, "boxes": stored_array("f", boxes),
            "labels": stored_array("q", labels), "area": stored_array("f", area),
            "iscrowd": stored_array("q", crowds), "ann_ids": stored_array("q", ids),
            "segmentation": segmentation}, reasons


def stored_array(typecode: str, values: List[Any]) -> bytes:
    """Numbers the fit checked, as an array field stores them (little-endian)."""
    out = array(typecode, values)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def fit_box(box: Tuple[float, float, float, float], width: int,
            height: int) -> Tuple[List[float], str]:
    """``([x0, y0, x1, y1] clipped to the image, "")``, or ``([], why the box is unusable)``;
    in float32, as torchvision computes them: ``x1 = float32(x) + float32(w)``."""
    if not isfinite(box[0] + box[1] + box[2] + box[3]):
        return [], f"box {shown_box(box)} holds a non-finite number"
    x, y, w, h = array("f", box)
    if not (w > 0 and h > 0):
        return [], f"zero or negative size box {shown_box(box)}"
    x1, y1 = array("f", (x + w, y + h))  # a double sum rounded to float32: the float32 sum
    if x1 != x1 or y1 != y1:  # NaN: -inf + inf, numbers beyond float32 on both sides
        return [], f"box {shown_box(box)} holds a non-finite number in float32"
    # max(x, 0.0) and min(x1, width), written out: every image's every object comes here
    x0, y0 = 0.0 if x < 0.0 else x, 0.0 if y < 0.0 else y
    x1, y1 = width if x1 > width else x1, height if y1 > height else y1
    if x1 <= x0 or y1 <= y0:
        return [], f"box {shown_box(box)} lies outside the {width}x{height} image"
    return [x0, y0, float(x1), float(y1)], ""


def usable_box(box: Tuple[float, float, float, float]) -> bool:
    """Whether the box can hold an object in some image (``fit_box`` against one with no
    edge): one with no area, or wholly at negative coordinates, cannot in any."""
    return not fit_box(box, inf, inf)[1]


def shown_box(box) -> str:
    return "[" + ", ".join(f"{v:g}" for v in box) + "]"


def object_area(area: Any, xyxy: List[float]) -> float:
    """The annotation's ``area`` if it is a finite number within float32, not negative,
    else the box's."""
    number = isinstance(area, (int, float)) and not isinstance(area, bool)
    a = float(area) if number and abs(area) <= FLOAT32_MAX else -1.0
    return a if 0 <= a <= FLOAT32_MAX else (xyxy[2] - xyxy[0]) * (xyxy[3] - xyxy[1])
