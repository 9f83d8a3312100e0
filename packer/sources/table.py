"""Per-image metadata tables (``Table(images, table, label=None)``; ``--meta FILE.jsonl|FILE.csv``)
as typed record fields: each column's type is inferred over all rows, then checked, with no
silent defaults (docs/annotations.md). Only the listed rows are packed, in file order."""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from array import array
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import PackerError
from .._util.text import is_utf8
from ..storage.files import folder, source_file
from .base import (DEFAULT_MAX_CLASSES, FLOAT32_MAX, Annotations, ImageList, Source,
                   class_labels, image_root, read_text, relative_path, show)

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
# Names the record itself uses (or the class label): a column may not shadow them.
RESERVED = ("image", "path", "width", "height", "format", "mode", "crc32", "label")
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
TABLE = "Table(images, table, label): table"  # for errors reading it
CSV_INT = re.compile(r"[+-]?[0-9]{1,4300}\Z")  # int() reads no longer text
CSV_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")
CSV_NONFINITE = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity",
                 "-infinity"}
# A column's kinds that may mix, and what they become together.
MERGES = {frozenset({"int", "float"}): "float",
          frozenset({"list of int", "list of float"}): "list of float"}


def fit_identity(row: Dict[str, Any], width: int, height: int):
    """Metadata does not depend on the image's size: stored as read, nothing dropped."""
    return row, []


class Table(Source):
    """The images a ``.jsonl`` or ``.csv`` ``table`` lists (paths relative to ``images``), its other
    columns as typed fields; ``label=COLUMN`` makes that column the class label instead."""

    def __init__(self, images: os.PathLike, table: os.PathLike, label: Optional[str] = None, *,
                 max_classes: int = DEFAULT_MAX_CLASSES, storage_options: Optional[dict] = None):
        self.root, self.table = folder(images, storage_options), source_file(table, storage_options)
        self.label, self.max_classes = label, max_classes

    def read(self) -> ImageList:
        return read_meta(self.root, self.table, label=self.label, max_classes=self.max_classes)

    def options(self) -> Dict[str, Any]:
        return {"meta": str(self.table), **({"label": self.label} if self.label else {})}


def read_meta(images: os.PathLike, meta_file: os.PathLike, *, label: Optional[str] = None,
              max_classes: int = DEFAULT_MAX_CLASSES) -> ImageList:
    """``Table(images, meta_file, label).read()``."""
    root = image_root(images, "Table(images, table, label)")
    file = source_file(meta_file)
    records_of = {".jsonl": jsonl_records, ".csv": csv_records}.get(file.suffix.lower())
    if records_of is None:
        raise PackerError(f"Table(images, table, label): table {file} must end in .jsonl (one "
                          f"JSON object per line) or .csv (a header row naming the columns)")
    records = records_of(file)
    if not records:
        raise PackerError(f"metadata file {file} lists no images")
    paths = row_paths(file, records)
    columns = column_names(file, records, label)
    types = {c: column_type(file, records, c) for c in columns}
    labels, classes = [-1] * len(records), []
    if label is not None:
        labels, classes = label_column(file, records, label, types.pop(label), max_classes)
    schema = [field_schema(c, t, records) for c, t in types.items()]
    rows = [{c: as_type(rec[c], types[c]) for c in types} for _, rec in records]
    ann = Annotations(schema=schema, rows=rows, fit=fit_identity, task="generic")
    return ImageList(root, classes, list(zip(paths, labels)), ann)


def jsonl_records(file: Path) -> List[Tuple[int, Dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line."""
    records = []
    for n, line in enumerate(read_text(file, TABLE).split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as e:
            raise PackerError(f"{file}:{n}: not valid JSON ({e.msg} at column {e.colno}); "
                              f"each line must be one JSON object") from None
        except (ValueError, RecursionError) as e:  # a key twice, nested too deeply...
            raise PackerError(f"{file}:{n}: {json_problem(e)}") from None
        if not isinstance(obj, dict):
            raise PackerError(f"{file}:{n}: expected a JSON object {{\"path\": ...}}, got "
                              f"{type_name(obj)}")
        records.append((n, obj))
    return records


def json_problem(e: Exception) -> str:
    """Why ``json.loads`` refused a text, in words for the dataset's owner."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    if isinstance(e, RecursionError):
        return "JSON nested too deeply"
    if "integer string conversion" in str(e):
        return "a number with over 4300 digits"
    return str(e)  # unique_keys's


def unique_keys(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        k = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {show(k)!r} appears twice in one object")
    return out


def csv_records(file: Path) -> List[Tuple[int, Dict[str, Any]]]:
    """``(line number, row)``, each column's cells as the one type they all fit (``csv_column``)."""
    reader = csv.reader(io.StringIO(read_text(file, TABLE), newline=""))
    try:
        header = [h.strip() for h in next(reader, [])]
        if not header:
            return []
        if "path" not in header:
            raise PackerError(f"{file}:1: the header has no 'path' column (the image, "
                              f"relative to the image folder)")
        cells: List[Tuple[int, List[str]]] = []
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise PackerError(f"{file}:{reader.line_num}: {len(row)} cells, but the header "
                                  f"names {len(header)} columns")
            cells.append((reader.line_num, row))
    except csv.Error as e:
        raise PackerError(f"{file}:{reader.line_num}: not valid CSV ({e})") from None
    for i, name in enumerate(header):
        if name in header[:i]:
            raise PackerError(f"{file}:1: column {show(name)!r} appears twice in the header")
    columns = [[row[i] for _, row in cells] if name == "path" else
               csv_column(file, name, [(n, row[i]) for n, row in cells])
               for i, name in enumerate(header)]
    return [(n, dict(zip(header, values))) for (n, _), values in zip(cells, zip(*columns))]


def csv_column(file: Path, name: str, column: List[Tuple[int, str]]) -> List[Any]:
    """One CSV column's cells as int, float, bool, str or (JSON) list values; an empty cell is
    missing (None) unless the column is text."""
    given = [c.strip() for _, c in column if c.strip()]
    if given and all(c.startswith("[") for c in given):
        out = []
        for n, cell in column:
            try:
                out.append(json.loads(cell) if cell.strip() else None)
            except (ValueError, RecursionError) as e:
                raise PackerError(f"{file}:{n}: column {name!r}: {show(cell)[:80]!r} is not a "
                                  f"JSON list ({json_problem(e)})") from None
        return out
    if given and all(CSV_INT.match(c) for c in given):
        convert: Any = int
    elif given and all(CSV_FLOAT.match(c) or c.lower() in CSV_NONFINITE for c in given):
        convert = float
    elif given and all(c.lower() in ("true", "false") for c in given):
        convert = lambda c: c.lower() == "true"  # noqa: E731
    else:
        return [c for _, c in column]  # text: an empty cell is an empty string
    return [convert(c.strip()) if c.strip() else None for _, c in column]


def row_paths(file: Path, records) -> List[str]:
    """Each row's checked ``path``; the same image twice would be ambiguous."""
    seen: Dict[str, int] = {}
    paths = []
    for n, rec in records:
        if "path" not in rec:
            raise PackerError(f"{file}:{n}: no 'path' (the image, relative to the image "
                              f"folder); every row needs one")
        raw = rec.pop("path")
        rel, problem = relative_path(raw)
        if problem:
            raise PackerError(f"{file}:{n}: path {show(raw)!r} {problem}")
        if rel in seen:
            raise PackerError(f"{file}:{n}: path {show(rel)!r} is listed twice (also line "
                              f"{seen[rel]}); list each image once")
        seen[rel] = n
        paths.append(rel)
    return paths


def column_names(file: Path, records, label: Optional[str]) -> List[str]:
    """Columns in order of first appearance, each a usable field name."""
    first: Dict[str, int] = {}
    for n, rec in records:
        for c in rec:
            first.setdefault(c, n)
    for c, n in first.items():
        if not isinstance(c, str) or not NAME.match(c):
            raise PackerError(f"{file}:{n}: column name {show(c)!r} must be a letter or '_' "
                              f"then up to 63 letters, digits or '_'; rename it")
        if c in RESERVED and c != label:
            raise PackerError(f"{file}:{n}: column {c!r} clashes with a name every record "
                              f"uses ({', '.join(RESERVED)}); rename it"
                              + (" or make it the label (label='label')" if c == "label" else ""))
    if label is not None and label not in first:
        raise PackerError(f"Table(images, table, label={label!r}): {file} has no such column "
                          f"(columns: {', '.join(first) or 'none besides path'})")
    return list(first)


def kind(v: Any) -> str:
    """The value's type in a column's terms; JSON and CSV give exactly these Python types."""
    if type(v) in (bool, int, float, str):
        return type(v).__name__
    if isinstance(v, list):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return "list of int"  # an empty list too: it fits a float list as well
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            return "list of float"
        return "list of something else"
    return "null" if v is None else type_name(v)


def type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null",
            bool: "a boolean"}.get(type(v), type(v).__name__)


def column_type(file: Path, records, column: str) -> str:
    """The one type every value of ``column`` has (ints in a float column are fine)."""
    first: Dict[str, int] = {}
    for n, rec in records:
        if column not in rec:
            raise PackerError(f"{file}:{n}: no value for column {column!r}; every row needs "
                              f"one (packer fills in no defaults)")
        v = rec[column]
        k = kind(v)
        if k not in ("bool", "int", "float", "str", "list of int", "list of float"):
            what = "null" if k == "null" else f"{k}, which is not a supported type"
            raise PackerError(f"{file}:{n}: column {column!r} is {what}; give every row an "
                              f"int, float, bool, string, or a list of numbers")
        check_value(file, n, column, v)
        first.setdefault(k, n)
    kinds = list(first)
    merged = kinds[0] if len(kinds) == 1 else MERGES.get(frozenset(kinds))
    if merged is None:
        a, b = kinds[0], next(k for k in kinds[1:] if MERGES.get(frozenset((kinds[0], k)))
                              is None)
        raise PackerError(f"{file}: column {column!r} mixes types: {a} (first at line "
                          f"{first[a]}) and {b} (first at line {first[b]}); make every value "
                          f"of a column the same type")
    if merged == "list of float":  # stored as float32 (field_schema)
        for n, rec in records:
            big = next((x for x in rec[column] if abs(x) > FLOAT32_MAX
                        and math.isinf(array("f", [x])[0])), None)  # FLT_MAX rounds in
            if big is not None:
                raise PackerError(f"{file}:{n}: column {column!r} holds {big}, beyond 32-bit "
                                  f"floats (a list of numbers is stored as float32)")
    return merged


def check_value(file: Path, n: int, column: str, v: Any) -> None:
    """No NaN or infinity, ints within int64, text that is UTF-8."""
    for x in v if isinstance(v, list) else [v]:
        if isinstance(x, float) and not math.isfinite(x):
            raise PackerError(f"{file}:{n}: column {column!r} holds {x} (NaN or infinity); "
                              f"store a finite number")
        if isinstance(x, int) and not INT64_MIN <= x <= INT64_MAX:
            raise PackerError(f"{file}:{n}: column {column!r} holds {x}, beyond 64-bit "
                              f"integers")
        if isinstance(x, str) and not is_utf8(x):
            raise PackerError(f"{file}:{n}: column {column!r} holds text that is not valid "
                              f"UTF-8: {show(x)!r}")


def as_type(v: Any, t: str) -> Any:
    if t == "float":
        return float(v)
    if t == "list of float":
        return [float(x) for x in v]
    return v


def field_schema(column: str, t: str, records) -> Dict[str, Any]:
    """A list column is ``[n]`` when every row has n items, else ``[-1]``."""
    if not t.startswith("list"):
        return {"name": column, "type": t}
    lengths = {len(rec[column]) for _, rec in records}
    n = lengths.pop() if len(lengths) == 1 else -1
    return {"name": column, "type": "array", "dtype": "int64" if t == "list of int" else
            "float32", "shape": [n if n > 0 else -1]}


def label_column(file: Path, records, column: str, t: str,
                 max_classes: int) -> Tuple[List[int], List[str]]:
    """Entry labels and class names from the ``label`` column (then not a field)."""
    values = [rec.pop(column) for _, rec in records]
    if t not in ("str", "int"):
        raise PackerError(f"Table(images, table, label={column!r}): the column holds {t} values; "
                          f"a class label must be a class name (text) or a class index (int)")
    for (n, _), v in zip(records, values):
        if t == "str" and not v:
            raise PackerError(f"{file}:{n}: the label column {column!r} is empty; every "
                              f"image needs a class")
        if t == "int" and v < 0:
            raise PackerError(f"{file}:{n}: the label column {column!r} holds {v}; class "
                              f"indices must be >= 0")
    return class_labels(values, lambda i: f"{file}:{records[i][0]}: the label column {column!r}",
                        max_classes)
