"""Ultralytics YOLO labels (``Yolo(images, labels, names, rules)``; ``--yolo``) as detection
targets: ``LABELS/<relative path>.txt`` (or a flat ``<stem>.txt``) per image, boxes stored XYXY in
the stored pixels' frame; which lines and images are kept: docs/annotations.md."""
from __future__ import annotations

import math
import os
from array import array
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Optional, Tuple

import yaml

from ..errors import PackerError
from .._util.fsio import read_file
from .._util.text import is_utf8
from ..storage.files import ObjectFile, RemoteFolder, folder, source_file
from .base import (IMG_EXTENSIONS, Annotations, ImageList, Source, image_root, read_data, show,
                   utf8_text, walk_files)
from .coco import coco_schema


def f32(*values: float) -> List[float]:
    """``values`` rounded to float32, as ultralytics holds labels (numpy float32 arrays)."""
    return array("f", values).tolist()


LOW, HIGH = f32(-0.01, 1.01)  # ultralytics' tolerance: 1 % outside [0, 1], kept and clipped
MIN_SIDE = 10  # ultralytics leaves out images under 10 pixels on a side
RULES = ("ultralytics", "lines")
MAX_LABEL_BYTES = 64 << 20  # a label file read from object storage (lines of five numbers)
MAX_NAMES_BYTES = 4 << 20  # a names file holds class names (and a dataset's settings)
YAML_HELP = ("a names YAML is a list ('- person' lines or [person, car]), or 'names:' followed "
             "by such a list, by indented '0: person' lines or by {0: person, 1: car}; or give "
             "names as a text file with one class per line")
# EXIF orientation -> (flip x, flip y) after the axes swap of 5-8: the inverse of exif_transpose.
FLIPS = {2: (True, False), 3: (True, True), 4: (False, True), 5: (False, False),
         6: (False, True), 7: (True, True), 8: (True, False)}


class Yolo(Source):
    """Each image under ``images`` with its label file's objects; ``names``: a text file or a
    dataset YAML; ``rules``: "ultralytics" (a bad line drops the image) or "lines" (the line)."""

    def __init__(self, images: os.PathLike, labels: os.PathLike, names: os.PathLike,
                 rules: str = "ultralytics", *, storage_options: Optional[dict] = None):
        if rules not in RULES:
            raise PackerError(f"Yolo(images, labels, names, rules): rules must be "
                              f"'ultralytics' or 'lines', not {show(rules)!r}")
        self.root, self.labels = folder(images, storage_options), folder(labels, storage_options)
        self.names, self.rules = source_file(names, storage_options), rules

    def read(self) -> ImageList:
        return read_yolo(self.root, self.labels, self.names, self.rules)

    def options(self) -> Dict[str, Any]:
        return {"yolo": str(self.labels), "names": str(self.names), "yolo_rules": self.rules}


def read_yolo(images: os.PathLike, labels_dir: os.PathLike, names: os.PathLike,
              rules: str = "ultralytics") -> ImageList:
    """``Yolo(images, labels_dir, names, rules).read()``: a row per image, ``{"image_id",
    "boxes", "labels"}`` or ``{"image_id", "reject": why the image is left out}``."""
    root = image_root(images, "Yolo(images, labels, names)")
    labels_root = image_root(labels_dir, "Yolo(images, labels, names)", "labels")
    classes = read_names(source_file(names))
    label_files = set(walk_files(labels_root, lambda f: f.lower().endswith(".txt")))
    if isinstance(labels_root, Path) and not isinstance(names, ObjectFile):
        names_path = Path(names).resolve()
        if labels_root.resolve() in names_path.parents:  # a classes.txt beside the labels
            label_files.discard(names_path.relative_to(labels_root.resolve()).as_posix())
    shown_root = labels_root.resolve().name or str(labels_root)
    images = walk_files(root, lambda f: f.lower().endswith(IMG_EXTENSIONS))
    chosen, claimed = match_labels(images, label_files)
    texts = label_texts(labels_root, {lab for _, lab, _ in chosen if lab is not None})
    parsed: Dict[str, Any] = {}
    rows, dropped = [], []
    for k, (rel, label_rel, problem) in enumerate(chosen):
        if label_rel is not None and label_rel not in parsed:
            parsed[label_rel] = parse_label_file(partial(texts, label_rel),
                                                 f"{shown_root}/{label_rel}", len(classes), rules)
        result = problem or parsed.get(label_rel, ([], [], []))
        if isinstance(result, str):
            rows.append({"image_id": k, "reject": result})
        else:
            rows.append({"image_id": k, "boxes": result[0], "labels": result[1]})
            dropped.extend({"path": rel, "reason": r} for r in result[2])
    dropped.extend({"path": f"{shown_root}/{lab}", "reason": "no image for this label file"}
                   for lab in sorted(label_files - claimed))
    if not rows:
        raise PackerError(f"no images (extensions {', '.join(IMG_EXTENSIONS)}) "
                          f"to pack under {root}")
    extra = {"categories": [{"id": i, "name": n} for i, n in enumerate(classes)]}
    fit = fit_ultralytics if rules == "ultralytics" else fit_yolo
    ann = Annotations(schema=coco_schema()[:5], rows=rows, fit=fit, task="detection",
                      extra=extra, dropped=dropped, upright=True)
    return ImageList(root, classes, [(rel, -1) for rel, _, _ in chosen], ann)


def match_labels(images: List[str], label_files: set):
    """``[(image, label file or None, why none or "")]`` and the label files claimed; a flat
    ``<stem>.txt`` that images in several folders would share belongs to none."""
    flat_claims: Dict[str, set] = {}
    plan: List[Tuple[str, Optional[str], bool]] = []  # (image, label file, whether flat)
    for rel in images:
        p = PurePosixPath(rel)
        same, flat = p.with_suffix(".txt").as_posix(), p.stem + ".txt"
        is_flat = same not in label_files and flat in label_files
        label = same if same in label_files else flat if is_flat else None
        if label == flat:  # a flat claim, or a top-level image's own file that one would share
            flat_claims.setdefault(flat, set()).add(p.with_suffix("").as_posix())
        plan.append((rel, label, is_flat))
    chosen: List[Tuple[str, Optional[str], str]] = []
    for rel, label, is_flat in plan:
        sharing = len(flat_claims[label]) if is_flat else 1
        chosen.append((rel, label, "") if sharing == 1 else
                      (rel, None, f"label file {show(label)} could belong to any of {sharing} "
                                  f"images named {show(PurePosixPath(label).stem)}.*; lay LABELS "
                                  f"out like IMAGES"))
    return chosen, {label for _, label, _ in plan}


def label_texts(labels_root, rels: set):
    """``rel`` -> its bytes (or ``OSError``); from object storage all are fetched first, 16 GETs
    at a time."""
    if not isinstance(labels_root, RemoteFolder):
        return lambda rel: read_file(labels_root / rel)
    with ThreadPoolExecutor(16, thread_name_prefix="packer-labels") as pool:
        got = {rel: pool.submit(labels_root.read, rel, MAX_LABEL_BYTES, "a label file's limit")
               for rel in sorted(rels)}
    for f in got.values():  # an OSError is that image's; anything else stops the read now
        e = f.exception()
        if e is not None and not isinstance(e, OSError):
            raise e
    return lambda rel: got[rel].result()


def parse_label_file(data, shown: str, nclasses: int, rules: str = "ultralytics"):
    """``(boxes cxcywh, class ids, reasons for dropped lines)`` of the label file (``data()``:
    its bytes), or why the image cannot be packed (unreadable; by ultralytics', a bad line)."""
    try:
        text = data().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return (f"{shown} is not UTF-8 text ({e.reason} at byte {e.start}): its objects are "
                f"unknown, so the image is not packed; save the file as UTF-8")
    except OSError as e:
        return f"cannot read {shown} ({e.strerror or e}), so the image is not packed"
    lines = [(n, fields) for n, fields in enumerate(map(str.split, text.splitlines()), 1) if fields]
    reasons: List[str] = []
    first: Dict[Tuple[float, ...], int] = {}  # each distinct row: its line
    duplicates = False
    polygon = next((n for n, fields in lines if len(fields) > 6), 0)
    for n, fields in lines:
        obj = parse_line(fields, nclasses)
        if rules == "ultralytics" and polygon and len(fields) == 5:
            obj = (f"a box row in a file of polygon rows (line {polygon}): ultralytics would "
                   f"read it as a two-point polygon")
        if isinstance(obj, str):
            if rules == "ultralytics":
                return (f"{shown}:{n}: {obj}; the image is left out, as ultralytics does "
                        f"(rules='lines' drops the line alone)")
            reasons.append(f"{shown}:{n}: {obj}")
            continue
        if obj in first:
            reasons.append(f"{shown}:{n}: duplicate of line {first[obj]}")
            duplicates = True
            continue
        first[obj] = n
    # ultralytics removes duplicates with np.unique(rows, axis=0), which sorts the rows too
    kept = sorted(first) if duplicates else first
    return [list(o[1:]) for o in kept], [int(o[0]) for o in kept], reasons


def parse_line(fields: List[str], nclasses: int):
    """``(class, cx, cy, w, h)`` normalized, in float32, or why the line is not valid."""
    n = len(fields)
    if n == 6:
        return ("6 values: a box and one more (a confidence? predictions are not labels); "
                "expected 'class cx cy w h'")
    if n < 5 or n > 5 and n % 2 == 0:
        return (f"{n} values; expected 5 ('class cx cy w h') or a polygon "
                f"'class x1 y1 x2 y2 x3 y3 ...'")
    values = []
    for tok in fields:
        try:
            values.append(float(tok))
        except ValueError:
            return f"{show(tok)!r} is not a number"
    values = f32(*values)
    c = values[0]
    if not all(map(math.isfinite, values)):
        return f"{show(next(t for t, v in zip(fields, values) if not math.isfinite(v)))} " \
               f"is not a finite number"
    if c != int(c):
        return f"class {show(fields[0])!r} is not an integer"
    if not 0 <= c < nclasses:
        return f"class {int(c)} is out of range: NAMES has {nclasses} classes (0..{nclasses - 1})"
    if n == 5:
        box = values[1:]
    else:  # the polygon's box, as ultralytics' segments2boxes makes it (float32)
        xs, ys = values[1::2], values[2::2]
        x0, y0, x1, y1 = min(xs), min(ys), max(xs), max(ys)
        box = f32((x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0)
    if not all(LOW <= v <= HIGH for v in box):
        return (f"box (cx cy w h) {' '.join(f'{v:.6g}' for v in box)} is more than 1 % outside "
                f"[0, 1]; YOLO labels are fractions of the image size")
    return (c, *box)


def fit_ultralytics(row: Dict[str, Any], width: int, height: int, orientation: int = 1):
    """``fit_yolo``, and an image under 10 pixels on a side left out, as ultralytics does."""
    if min(width, height) < MIN_SIDE:
        raise ValueError(f"the image is {width}x{height} pixels: ultralytics leaves out images "
                         f"under {MIN_SIDE} pixels on a side (rules='lines' keeps them)")
    return fit_yolo(row, width, height, orientation)


def fit_yolo(row: Dict[str, Any], width: int, height: int, orientation: int = 1):
    """Normalized cxcywh of the image as shown -> XYXY pixels of the stored image with this EXIF
    orientation, clipped; area in pixels. A ``reject`` row raises ValueError (image skipped)."""
    if "reject" in row:
        raise ValueError(row["reject"])
    uw, uh = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
    boxes, areas = [], []
    for cx, cy, w, h in row["boxes"]:
        w, h = max(w, 0.0), max(h, 0.0)  # down to -1 % is valid: no size
        x0, x1 = clip((cx - w / 2) * uw, uw), clip((cx + w / 2) * uw, uw)
        y0, y1 = clip((cy - h / 2) * uh, uh), clip((cy + h / 2) * uh, uh)
        boxes.append(stored_box([x0, y0, x1, y1], orientation, width, height))
        areas.append((x1 - x0) * (y1 - y0))
    return {"image_id": row["image_id"], "boxes": boxes, "labels": list(row["labels"]),
            "area": areas, "iscrowd": [0] * len(boxes)}, []


def clip(v: float, hi: int) -> float:
    return min(max(v, 0.0), float(hi))


def stored_box(box: List[float], orientation: int, width: int, height: int) -> List[float]:
    """An XYXY box of the image as shown, in the stored image's pixels (orientation 1: as is)."""
    x0, y0, x1, y1 = box
    if orientation in (5, 6, 7, 8):
        x0, y0, x1, y1 = y0, x0, y1, x1
    fx, fy = FLIPS.get(orientation, (False, False))
    if fx:
        x0, x1 = width - x1, width - x0
    if fy:
        y0, y1 = height - y1, height - y0
    return [x0, y0, x1, y1]


def read_names(path: Path) -> List[str]:
    """Class names from a text file (one per line) or a dataset YAML (``yaml_names``)."""
    what = "Yolo(images, labels, names): names"
    data = read_data(path, what)
    if len(data) > MAX_NAMES_BYTES:
        raise PackerError(f"{what} {path} holds {len(data):,} bytes, more than a names file "
                          f"needs ({MAX_NAMES_BYTES:,} at most); is it the right file?")
    text = utf8_text(data, path, what)
    names = (yaml_names(text, path) if path.suffix.lower() in (".yaml", ".yml") else
             [line.strip() for line in text.splitlines() if line.strip()])
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
    """``yaml.SafeLoader`` refusing a key twice in a mapping (YAML keeps the last: a lost class)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                twice = key in seen
            except TypeError:  # a list or map as a key: SafeLoader refuses it too, but later
                raise yaml.constructor.ConstructorError(
                    None, None, "found an unhashable key", key_node.start_mark) from None
            if twice:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def yaml_names(text: str, file: Path) -> List[str]:
    """The class list of a YAML names file as ultralytics reads it (a list, or ``names``: a list
    or an ``{index: name}`` map); anything else is an error, never a guess."""
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
        if type(key) is not int and not (isinstance(key, str) and key.isascii() and key.isdigit()):
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
    """A scalar as ultralytics' class name (``str``: ``yes`` is ``True``); a list, a map or an
    empty value is no name."""
    what = ("a list" if isinstance(value, list) else "a map" if isinstance(value, dict)
            else "empty" if value is None or value == "" else "")
    if what:
        raise PackerError(f"{file}: class {i} is {what}, not a name; {YAML_HELP}")
    return str(value)
