"""Ultralytics YOLO detection labels (``Yolo(images, labels, names)``; ``--yolo LABELS --names
NAMES``) as detection targets.

Every image under IMAGES is packed (recursively, in ImageFolder's walk order); its labels
are ``LABELS/<same relative path>.txt`` as ultralytics lays them out, or ``LABELS/<stem>.txt``
(a flat folder) when that is missing. An image without a label file is a background image
(no objects). Each label line is ``class cx cy w h`` normalized to [0, 1]; a line with an odd
count of 7 or more values is an ultralytics polygon ``class x1 y1 x2 y2 ...`` and is stored
as its bounding box. Pose labels (boxes plus keypoints) are not read. A class is an integer
(``2.0`` too, as ultralytics reads it); coordinates within 1e-3 outside [0, 1] are clipped.
Lines that cannot be used (malformed, 6 values as in predictions, class out of range,
coordinates outside [0, 1], no area, an exact duplicate) are dropped with
``labels/a.txt:3: why``. An image whose label file is not UTF-8 is not packed at all (packing
it with no objects would be silently wrong), nor is one whose flat ``<stem>.txt`` images in
several folders would share, nor one whose name is not UTF-8. NAMES is a text file (a class
per line) or a dataset YAML, read with PyYAML as ultralytics reads it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Optional, Tuple

import yaml

from ..errors import PackerError
from .._util.fsio import read_file
from .._util.text import is_utf8
from .base import IMG_EXTENSIONS, Annotations, ImageList, Source, image_root, is_image_file, read_data, show, utf8_text, walk_files
from .coco import coco_schema

TOLERANCE = 1e-3  # coordinates this far outside [0, 1] are rounding, clipped; beyond, wrong
MAX_NAMES_BYTES = 4 << 20  # a names file holds class names (and a dataset's settings)
YAML_HELP = ("a names YAML is a list ('- person' lines or [person, car]), or 'names:' followed "
             "by such a list, by indented '0: person' lines or by {0: person, 1: car}; or give "
             "names as a text file with one class per line")


class Yolo(Source):
    """Every image under ``images`` with the objects of its label file under ``labels``;
    ``names``: the class names, a text file or a dataset YAML (see the module)."""

    def __init__(self, images: os.PathLike, labels: os.PathLike, names: os.PathLike):
        self.root, self.labels, self.names = Path(images), Path(labels), Path(names)

    def read(self) -> ImageList:
        return read_yolo(self.root, self.labels, self.names)

    def options(self) -> Dict[str, Any]:
        return {"yolo": str(self.labels), "names": str(self.names)}


def read_yolo(images: os.PathLike, labels_dir: os.PathLike, names: os.PathLike) -> ImageList:
    """``Yolo(images, labels_dir, names).read()``."""
    root = image_root(images, "Yolo(images, labels, names)")
    labels_root = Path(labels_dir)
    if not labels_root.is_dir():
        raise PackerError(f"Yolo(images, labels, names): labels {labels_root} does not exist "
                          f"or is not a folder")
    classes = read_names(Path(names))
    label_files = set(walk_files(labels_root, lambda f: f.lower().endswith(".txt")))
    names_path = Path(names).resolve()
    if labels_root.resolve() in names_path.parents:  # a classes.txt beside the labels
        label_files.discard(names_path.relative_to(labels_root.resolve()).as_posix())
    shown_root = labels_root.resolve().name or str(labels_root)
    chosen, dropped, claimed = match_labels(walk_files(root, is_image_file), label_files)
    parsed: Dict[str, Any] = {}
    entries, rows = [], []
    for rel, label_rel in chosen:
        if label_rel is None:
            boxes, labels, reasons = [], [], []
        else:
            if label_rel not in parsed:
                parsed[label_rel] = parse_label_file(labels_root / label_rel,
                                                     f"{shown_root}/{label_rel}", len(classes))
            result = parsed[label_rel]
            if isinstance(result, str):
                dropped.append({"path": rel, "reason": result})
                continue
            boxes, labels, reasons = result
        dropped.extend({"path": rel, "reason": r} for r in reasons)
        rows.append({"image_id": len(entries), "boxes": boxes, "labels": labels})
        entries.append((rel, -1))
    dropped.extend({"path": f"{shown_root}/{lab}", "reason": "no image for this label file"}
                   for lab in sorted(label_files - claimed))
    if not entries:
        raise PackerError(f"no images (extensions {', '.join(IMG_EXTENSIONS)}) "
                          f"to pack under {root}")
    extra = {"categories": [{"id": i, "name": n} for i, n in enumerate(classes)]}
    ann = Annotations(schema=coco_schema()[:5], rows=rows, fit=fit_yolo, task="detection",
                      extra=extra, dropped=dropped)
    return ImageList(root, classes, entries, ann)


def match_labels(images: List[str], label_files: set):
    """``[(image, label file or None)]``, the images left out (a non-UTF-8 name, or a flat
    ``<stem>.txt`` that images in different folders would share: whose is it?) and the label
    files some image claims."""
    dropped: List[Dict[str, str]] = []
    flat_claims: Dict[str, set] = {}
    plan: List[Tuple[str, Optional[str], Optional[str]]] = []
    for rel in images:
        if not is_utf8(rel):
            dropped.append({"path": show(rel), "reason": "file name is not valid UTF-8, so it "
                            "cannot be stored; rename it"})
            continue
        p = PurePosixPath(rel)
        same = p.with_suffix(".txt").as_posix()
        flat = p.stem + ".txt"
        if same in label_files:
            plan.append((rel, same, None))
        elif flat in label_files:
            plan.append((rel, None, flat))
            flat_claims.setdefault(flat, set()).add(p.with_suffix("").as_posix())
        else:
            plan.append((rel, None, None))
    chosen: List[Tuple[str, Optional[str]]] = []
    for rel, same, flat in plan:
        if flat is not None and len(flat_claims[flat]) > 1:
            dropped.append({"path": rel, "reason": f"label file {show(flat)} could belong to "
                            f"any of {len(flat_claims[flat])} images named "
                            f"{show(PurePosixPath(flat).stem)}.*; lay LABELS out like IMAGES"})
            continue
        chosen.append((rel, same or flat))
    claimed = {same or flat for _, same, flat in plan}
    return chosen, dropped, claimed


def parse_label_file(path: Path, shown: str, nclasses: int):
    """``(boxes cxcywh, class ids, reasons)``, or why the whole file cannot be used."""
    try:
        text = read_file(path).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return (f"{shown} is not UTF-8 text ({e.reason} at byte {e.start}): its objects are "
                f"unknown, so the image is not packed; save the file as UTF-8")
    except OSError as e:
        return f"cannot read {shown} ({e.strerror or e}), so the image is not packed"
    boxes: List[List[float]] = []
    labels: List[int] = []
    reasons: List[str] = []
    first: Dict[Tuple[int, Tuple[float, ...]], int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        obj = parse_line(fields, nclasses)
        if isinstance(obj, str):
            reasons.append(f"{shown}:{n}: {obj}")
            continue
        key = (obj[0], tuple(obj[1]))
        if key in first:
            reasons.append(f"{shown}:{n}: duplicate of line {first[key]}")
            continue
        first[key] = n
        labels.append(obj[0])
        boxes.append(obj[1])
    return boxes, labels, reasons


def parse_line(fields: List[str], nclasses: int):
    """``(class, [cx, cy, w, h])`` normalized, or why the line cannot be used."""
    n = len(fields)
    if n == 6:
        return ("6 values: a box and one more (a confidence? predictions are not labels); "
                "expected 'class cx cy w h'")
    if n < 5 or n > 5 and n % 2 == 0:
        return (f"{n} values; expected 5 ('class cx cy w h') or a polygon "
                f"'class x1 y1 x2 y2 x3 y3 ...'")
    try:
        c = float(fields[0])
    except ValueError:
        c = math.nan
    if not math.isfinite(c) or c != int(c):
        return f"class {show(fields[0])!r} is not an integer"
    if not 0 <= c < nclasses:
        return f"class {int(c)} is out of range: NAMES has {nclasses} classes (0..{nclasses - 1})"
    coords = []
    for tok in fields[1:]:
        try:
            v = float(tok)
        except ValueError:
            return f"{show(tok)!r} is not a number"
        if not math.isfinite(v):
            return f"coordinate {show(tok)} is not finite"
        if not -TOLERANCE <= v <= 1 + TOLERANCE:
            return (f"coordinate {tok} is outside [0, 1]; YOLO labels are fractions of the "
                    f"image size")
        coords.append(min(max(v, 0.0), 1.0))
    if n == 5:
        cx, cy, w, h = coords
        if w <= 0 or h <= 0:
            return f"zero or negative size box (w={fields[3]}, h={fields[4]})"
        return int(c), [cx, cy, w, h]
    xs, ys = coords[0::2], coords[1::2]
    w, h = max(xs) - min(xs), max(ys) - min(ys)
    if w <= 0 or h <= 0:
        return "polygon has zero width or height"
    return int(c), [min(xs) + w / 2, min(ys) + h / 2, w, h]


def fit_yolo(row: Dict[str, Any], width: int, height: int):
    """Normalized cxcywh -> XYXY pixels (clipped to the image), area in pixels."""
    boxes, areas = [], []
    for cx, cy, w, h in row["boxes"]:
        x0, x1 = max((cx - w / 2) * width, 0.0), min((cx + w / 2) * width, float(width))
        y0, y1 = max((cy - h / 2) * height, 0.0), min((cy + h / 2) * height, float(height))
        boxes.append([x0, y0, x1, y1])
        areas.append((x1 - x0) * (y1 - y0))
    return {"image_id": row["image_id"], "boxes": boxes, "labels": list(row["labels"]),
            "area": areas, "iscrowd": [0] * len(boxes)}, []


def read_names(path: Path) -> List[str]:
    """Class names from a text file (one per line) or a dataset YAML (``yaml_names``)."""
    what = "Yolo(images, labels, names): names"
    data = read_data(path, what)
    if len(data) > MAX_NAMES_BYTES:
        raise PackerError(f"{what} {path} holds {len(data):,} bytes, more than a names file "
                          f"needs ({MAX_NAMES_BYTES:,} at most); is it the right file?")
    text = utf8_text(data, path, what)
    if path.suffix.lower() in (".yaml", ".yml"):
        names = yaml_names(text, path)
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise PackerError(f"class names file {path} names no classes")
    index: Dict[str, int] = {}
    for i, name in enumerate(names):
        if not is_utf8(name):
            raise PackerError(f"{path}: class {i} is not valid UTF-8 text: {show(name)!r}")
        if name in index:
            raise PackerError(f"{path}: classes {index[name]} and {i} are both named "
                              f"{show(name)!r}; give each class its own name")
        index[name] = i
    return names


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (YAML keeps the
    last, which would drop a class silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def yaml_names(text: str, file: Path) -> List[str]:
    """The class list of a YAML names file, as ultralytics reads it: the file is a list of
    names, or a mapping whose ``names`` is such a list or an ``{index: name}`` map (indices
    0..N-1); names are scalars, as text. Anything else is an error, never a guess."""
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise PackerError(f"{file}{where}: not valid YAML ({getattr(e, 'problem', None) or e}); "
                          f"{YAML_HELP}") from None
    if data is None:
        raise PackerError(f"{file} is empty; {YAML_HELP}")
    if isinstance(data, dict):
        if "names" not in data:
            raise PackerError(f"{file} has no top-level 'names:'; {YAML_HELP}")
        names, nc = data["names"], data.get("nc")
        if names is None:
            raise PackerError(f"{file}: 'names:' is empty; {YAML_HELP}")
    elif isinstance(data, list):
        names, nc = data, None
    else:
        raise PackerError(f"{file}: expected a list of names or 'names:', got "
                          f"{show(data)[:80]!r}; {YAML_HELP}")
    if isinstance(names, dict):
        names = indexed(names, file)
    elif not isinstance(names, list):
        raise PackerError(f"{file}: 'names' must be a list or an {{index: name}} map, got "
                          f"{show(names)[:80]!r}; {YAML_HELP}")
    out = [class_name(v, i, file) for i, v in enumerate(names)]
    if type(nc) is int and nc != len(out):
        raise PackerError(f"{file}: nc is {nc} but 'names' lists {len(out)} classes; make them "
                          f"agree")
    return out


def indexed(names: dict, file: Path) -> list:
    """``{index: name}`` as a list; the indices must be 0..N-1 (ints or digit text), each once."""
    by_index: Dict[int, Any] = {}
    for key, value in names.items():
        if type(key) is not int and not (isinstance(key, str) and key.isdigit()):
            raise PackerError(f"{file}: class index {show(key)!r} is not a number 0, 1, ...")
        if int(key) in by_index:
            raise PackerError(f"{file}: class index {int(key)} is given twice")
        by_index[int(key)] = value
    missing = sorted(set(range(len(by_index))) - set(by_index))
    if missing:
        raise PackerError(f"{file}: class indices must be 0..{len(by_index) - 1} with none "
                          f"missing; {missing[0]} is missing")
    return [by_index[i] for i in range(len(by_index))]


def class_name(value: Any, i: int, file: Path) -> str:
    """A scalar as the class name ultralytics makes of it (``str``: ``yes`` is ``True``, as
    YAML reads it); a list, a map or an empty value is no name."""
    what = ("a list" if isinstance(value, list) else "a map" if isinstance(value, dict)
            else "empty" if value is None or value == "" else "")
    if what:
        raise PackerError(f"{file}: class {i} is {what}, not a name; {YAML_HELP}")
    return str(value)
