"""Ultralytics YOLO detection labels (``--yolo LABELS --names NAMES``) as detection targets.

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
several folders would share, nor one whose name is not UTF-8.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Optional, Tuple

from ..errors import PackerError
from .base import IMG_EXTENSIONS, Annotations, ImageList, is_image_file
from .._util.text import is_utf8
from .coco import coco_schema
from .table import image_root, read_text, show, walk_files

TOLERANCE = 1e-3  # coordinates this far outside [0, 1] are rounding, clipped; beyond, wrong
KEY = re.compile(r"(.+?):(?:\s+(.*))?\Z")  # `key: value` or `key:`, split at the first ': '
YAML_HELP = ("packer reads only these YAML shapes: a list ('- person' lines or [person, car]), "
             "or 'names:' followed by such a list, by indented '0: person' lines or by "
             "{0: person, 1: car}; or give NAMES as a text file with one class per line")


def read_yolo(images: os.PathLike, labels_dir: os.PathLike, names: os.PathLike) -> ImageList:
    """Every image under IMAGES with the objects of its YOLO label file (see the module)."""
    root = image_root(images)
    labels_root = Path(labels_dir)
    if not labels_root.is_dir():
        raise PackerError(f"label folder {labels_root} does not exist or is not a folder")
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
        text = path.read_bytes().decode("utf-8-sig")
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
    """Class names from a text file (one per line) or a dataset YAML (see ``yaml_names``)."""
    text = read_text(path, "class names file")
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


def yaml_names(text: str, file: Path) -> List[str]:
    """The class list of a YAML names file, read without a YAML library (only the shapes
    in ``YAML_HELP``); anything else is an error, never a guess."""
    lines = yaml_lines(text, file)
    if not lines:
        raise PackerError(f"{file} is empty; {YAML_HELP}")
    n0, _, first = lines[0]
    if first.startswith("["):
        return flow(" ".join(s for _, _, s in lines), file, n0)
    if is_item(first):
        return block_list(lines, file)
    keys = top_keys(lines, file)
    if "names" not in keys:
        raise PackerError(f"{file} has no top-level 'names:'; {YAML_HELP}")
    n, value, children = keys["names"]
    if value:
        names = flow(" ".join([value] + [s for _, _, s in children]), file, n)
    elif not children:
        raise PackerError(f"{file}:{n}: 'names:' is empty; {YAML_HELP}")
    elif is_item(children[0][2]):
        names = block_list(children, file)
    else:
        names = block_map(children, file)
    nc = keys.get("nc")
    if nc is not None and nc[1].isdigit() and int(nc[1]) != len(names):
        raise PackerError(f"{file}:{nc[0]}: nc is {nc[1]} but 'names' lists {len(names)} "
                          f"classes; make them agree")
    return names


def yaml_lines(text: str, file: Path) -> List[Tuple[int, int, str]]:
    """``(line number, indent, content)`` of each line holding more than a comment."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = strip_comment(raw).rstrip()
        content = line.lstrip(" ")
        if not content or content in ("---", "..."):
            continue
        if content.startswith("\t"):
            raise PackerError(f"{file}:{n}: indented with a tab; YAML indents with spaces")
        out.append((n, len(line) - len(content), content))
    return out


def strip_comment(line: str) -> str:
    """``line`` up to a ``#`` that starts a comment (at the start or after a space, not in
    quotes; a quote opens quoted text only where a value can start)."""
    quote = ""
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"" and (i == 0 or line[i - 1] in " [{,:-"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
        i += 1
    return line


def is_item(content: str) -> bool:
    return content == "-" or content.startswith("- ")


def top_keys(lines, file: Path) -> Dict[str, Tuple[int, str, list]]:
    """Top-level ``key: value`` lines, each with the deeper lines below it (skipped unless
    the key is ``names``: other keys may hold anything, such as a download script)."""
    base = lines[0][1]
    keys: Dict[str, Tuple[int, str, list]] = {}
    current = None
    for n, indent, content in lines:
        if indent < base:
            raise PackerError(f"{file}:{n}: indented less than the first key; {YAML_HELP}")
        if indent == base and not is_item(content):
            m = KEY.match(content)
            if not m:
                raise PackerError(f"{file}:{n}: expected 'key: value', got "
                                  f"{show(content)!r}; {YAML_HELP}")
            current = keys[scalar(m.group(1), file, n)] = (n, m.group(2) or "", [])
        else:
            current[2].append((n, indent, content))
    return keys


def block_list(lines, file: Path) -> List[str]:
    indent = lines[0][1]
    for n, ind, content in lines:
        if ind != indent or not is_item(content):
            raise PackerError(f"{file}:{n}: expected a '- name' item like the line above, got "
                              f"{show(content)!r}; {YAML_HELP}")
    return [scalar(content[1:], file, n) for n, _, content in lines]


def block_map(lines, file: Path) -> List[str]:
    pairs = []
    for n, ind, content in lines:
        m = KEY.match(content)
        if ind != lines[0][1] or not m:
            raise PackerError(f"{file}:{n}: expected '<index>: <name>' like the line above, "
                              f"got {show(content)!r}; {YAML_HELP}")
        pairs.append((n, m.group(1), m.group(2) or ""))
    return indexed(pairs, file)


def indexed(pairs, file: Path) -> List[str]:
    """``{index: name}`` as a list; the indices must be 0..N-1, each once."""
    names: Dict[int, str] = {}
    for n, key, value in pairs:
        key = scalar(key, file, n)
        if not key.isdigit():
            raise PackerError(f"{file}:{n}: class index {show(key)!r} is not a number 0, 1, ...")
        if int(key) in names:
            raise PackerError(f"{file}:{n}: class index {int(key)} is given twice")
        names[int(key)] = scalar(value, file, n)
    missing = sorted(set(range(len(names))) - set(names))
    if missing:
        raise PackerError(f"{file}: class indices must be 0..{len(names) - 1} with none "
                          f"missing; {missing[0]} is missing")
    return [names[i] for i in range(len(names))]


def flow(value: str, file: Path, n: int) -> List[str]:
    """``[a, b]`` or ``{0: a, 1: b}`` on one line (or joined continuation lines)."""
    close = {"[": "]", "{": "}"}.get(value[:1])
    if close is None or not value.endswith(close):
        raise PackerError(f"{file}:{n}: expected [a, b, ...] or {{0: a, ...}}, got "
                          f"{show(value)[:80]!r}; {YAML_HELP}")
    items = split_flow(value[1:-1], file, n)
    if close == "]":
        return [scalar(item, file, n) for item in items]
    pairs = []
    for item in items:
        m = KEY.match(item)
        if not m:
            raise PackerError(f"{file}:{n}: expected 'index: name' in {{...}}, got "
                              f"{show(item)!r}")
        pairs.append((n, m.group(1), m.group(2) or ""))
    return indexed(pairs, file)


def split_flow(inner: str, file: Path, n: int) -> List[str]:
    """Items between commas outside quotes; one trailing comma allowed, no nesting."""
    items, quote, start = [], "", 0
    for i, ch in enumerate(inner):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"" and not inner[start:i].strip():
            quote = ch
        elif ch in "[]{}":
            raise PackerError(f"{file}:{n}: nested lists or maps are not class names; "
                              f"{YAML_HELP}")
        elif ch == ",":
            items.append(inner[start:i])
            start = i + 1
    items.append(inner[start:])
    if not items[-1].strip() and len(items) > 1:
        items.pop()
    if len(items) == 1 and not items[0].strip():
        return []
    return items


def scalar(token: str, file: Path, n: int) -> str:
    """A plain, 'single' or "double" quoted YAML scalar as text."""
    tok = token.strip()
    if len(tok) >= 2 and tok[0] == tok[-1] == '"':
        try:
            return json.loads(tok)
        except json.JSONDecodeError:
            pass
    elif len(tok) >= 2 and tok[0] == tok[-1] == "'" and "'" not in tok[1:-1].replace("''", ""):
        return tok[1:-1].replace("''", "'")
    elif tok and tok[0] not in "'\"[]{}&*!|>%@`," and not is_item(tok) \
            and ": " not in tok and not tok.endswith(":"):
        return tok
    raise PackerError(f"{file}:{n}: cannot read {show(tok)!r} as a class name"
                      f"{' (empty)' if not tok else ''}; {YAML_HELP}")
