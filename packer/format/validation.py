"""Every manifest field checked before it drives any work: a bad manifest is a ``FormatError``
naming the field, never a ``TypeError`` or a runaway loop (``docs/security.md``)."""
from __future__ import annotations

import re
from itertools import dropwhile
from pathlib import PurePosixPath
from typing import Any, Dict, Optional

from ..errors import FormatError
from .fields import Field, IntField, check_schema, detection_problem

MIN_RECORD_BYTES = 16  # an LMDB entry takes at least its node header and 8-byte key
SHA256 = re.compile(r"[0-9a-f]{64}")
TABLE_WIDTH = {"labels": 4, "offsets": 16}  # bytes per record of each side table
COLUMN_WIDTH = {"int32": 4, "int64": 8, "float64": 8, "uint8": 1}  # bytes per record of a column
TASKS = ("classification", "detection", "generic")


def is_plain_name(name: Any) -> bool:
    """A file name inside one folder: no separator, no NUL, not hidden (so not ``.``/``..``)."""
    return (isinstance(name, str) and name != "" and not name.startswith(".")
            and "/" not in name and "\\" not in name and "\0" not in name)


def is_data_name(name: Any) -> bool:
    """A plain name a dataset's own file may have: not the manifest nor a ``NAME.tmp``."""
    return is_plain_name(name) and name != "manifest.json" and not name.endswith(".tmp")


def shard_path_problem(path: Any) -> str:
    """Why ``path`` cannot be a shard path, or "": a plain name in the dataset folder, or
    ``PART/NAME`` with PART a relative folder (``../part-0``: a merge's part) and NAME plain."""
    if not isinstance(path, str) or not path or "\\" in path or "\0" in path:
        return "must be a relative '/'-separated path"
    p = PurePosixPath(path)
    if p.is_absolute() or str(p) != path:
        return "must be relative and normalized (no leading '/', './' or '//')"
    *folders, name = p.parts
    if not is_data_name(name):
        return ("must end in a plain file name that is not one of packer's own (manifest.json, "
                "*.tmp)")
    if any(not is_plain_name(f) for f in dropwhile(lambda f: f == "..", folders)):
        return "may go up ('..') only at its start"
    return ""


class _Check:
    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, what: str) -> FormatError:
        return FormatError(f"{self.where}: field {field!r} {what}; the manifest is damaged or "
                           f"not from packer (rebuild or re-stage the dataset)")

    def int(self, obj: dict, key: str, field: str, low: int = 0) -> int:
        v = obj.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise self.fail(field, f"must be an integer >= {low}, got {v!r}"[:200])
        return v

    def str(self, obj: dict, key: str, field: str, optional: bool = False) -> None:
        v = obj.get(key)
        if not (isinstance(v, str) or optional and v is None):
            raise self.fail(field, f"must be a string, got {type(v).__name__}")

    def sha(self, obj: dict, field: str) -> None:
        v = obj.get("sha256")
        if not isinstance(v, str) or not SHA256.fullmatch(v):
            raise self.fail(field, "must be a 64-digit lowercase hex SHA-256")

    def of(self, kind: type, obj: dict, key: str, field: str, optional: bool = False) -> Any:
        """``obj[key]``, a ``dict`` or ``list`` (``optional``: an empty one for None)."""
        v = obj.get(key)
        if optional and v is None:
            return kind()
        if not isinstance(v, kind):
            noun = "an object" if kind is dict else "a list"
            raise self.fail(field, f"must be {noun}, got {type(v).__name__}")
        return v


def validate_manifest(man: Any, where: str) -> Dict[str, Any]:
    """``man`` if every field packer reads is well formed and consistent, else FormatError."""
    c = _Check(where)
    if not isinstance(man, dict):
        raise FormatError(f"{where} is not a packer manifest (not a JSON object)")
    count = c.int(man, "count", "count")
    c.int(man, "bytes", "bytes")
    _classes(c, man)
    shards = c.of(list, man, "shards", "shards")
    if not shards:
        raise c.fail("shards", "lists no shard")
    seen = set()
    for k, s in enumerate(shards):
        field = f"shards[{k}]"
        if not isinstance(s, dict):
            raise c.fail(field, "must be an object")
        problem = shard_path_problem(s.get("path"))
        if problem:
            raise c.fail(f"{field}.path", problem)
        if s["path"] in seen:
            raise c.fail(f"{field}.path", f"repeats {s['path']!r} (its records would count twice)")
        seen.add(s["path"])
        n, size = c.int(s, "count", f"{field}.count"), c.int(s, "bytes", f"{field}.bytes")
        if n * MIN_RECORD_BYTES > size:
            raise c.fail(f"{field}.count", f"says {n} records in {size} bytes: impossible")
        c.sha(s, f"{field}.sha256")
    for key, held in (("count", "the shards hold"), ("bytes", "the shards' sizes add up to")):
        n = sum(s[key] for s in shards)
        if n != man[key]:
            raise c.fail(key, f"is {man[key]}, {held} {n}")
    fields = _schema(c, man)
    for kind, width in TABLE_WIDTH.items():
        if man.get(kind) is None and (kind == "offsets" or "label" not in fields):
            continue  # optional
        _table(c, c.of(dict, man, kind, kind), kind, width, count)
    columns = c.of(dict, man, "columns", "columns", optional=True)
    for name, t in columns.items():
        if not isinstance(t, dict) or t.get("dtype") not in COLUMN_WIDTH:
            raise c.fail(f"columns.{name}", f"must be an object with a dtype of "
                                            f"{', '.join(COLUMN_WIDTH)}")
        if name not in fields and name not in ("width", "height"):
            raise c.fail(f"columns.{name}", "names no field of the schema")
        want = "int32" if name in ("width", "height") else fields[name].column
        if t["dtype"] != want:
            raise c.fail(f"columns.{name}.dtype", f"must be {want}, the dtype of its field")
        _table(c, t, f"columns.{name}", COLUMN_WIDTH[t["dtype"]], count)
    paths = c.of(dict, man, "paths", "paths", optional=True)
    if paths:
        _table(c, c.of(dict, paths, "index", "paths.index"), "paths.index", 8, count)
        _table(c, c.of(dict, paths, "text", "paths.text"), "paths.text", None, count)
    wanted = [n for n, f in fields.items() if f.column and n != "label"]
    if man.get("schema") is not None and any(n not in columns for n in wanted):
        raise c.fail("columns", f"must hold a table for each scalar field ({', '.join(wanted)})")
    for key in ("skipped", "dropped"):  # "dropped" is optional
        for k, s in enumerate(c.of(list, man, key, key) if key in man or key == "skipped" else []):
            if not isinstance(s, dict):
                raise c.fail(f"{key}[{k}]", "must be an object")
            c.str(s, "path", f"{key}[{k}].path")
            c.str(s, "reason", f"{key}[{k}].reason")
    if "dropped_count" in man:
        c.int(man, "dropped_count", "dropped_count")
    categories = c.of(list, man, "categories", "categories") if "categories" in man else []
    for k, cat in enumerate(categories):
        if not isinstance(cat, dict) or not isinstance(cat.get("name"), str) or not (
                isinstance(cat.get("id"), int) and not isinstance(cat.get("id"), bool)):
            raise c.fail(f"categories[{k}]", "must be an object with an int id and a str name")
    c.of(dict, man, "options", "options", optional=True)
    c.of(dict, man, "staged", "staged", optional=True)
    for key in ("source", "pil", "created", "packer_version", "build_id", "fingerprint"):
        c.str(man, key, key, optional=True)
    return man


def _table(c: _Check, t: dict, kind: str, width: Optional[int], count: int) -> None:
    """A side table's entry: a plain name, ``width`` bytes a record (None: any size), a hash."""
    if not is_data_name(t.get("path")):
        raise c.fail(f"{kind}.path", "must be a plain file name in the dataset folder")
    size = c.int(t, "bytes", f"{kind}.bytes")
    if width is not None and size != width * count:
        raise c.fail(f"{kind}.bytes", f"must be {width} x count = {width * count}")
    c.sha(t, f"{kind}.sha256")


def _schema(c: _Check, man: dict) -> Dict[str, Field]:
    """The dataset's fields by name (older datasets: ``label`` alone)."""
    schema = man.get("schema")
    if schema is None:
        return {"label": IntField("label")}
    if not isinstance(schema, dict) or schema.get("task") not in TASKS:
        raise c.fail("schema", f"must be an object with a task of {', '.join(TASKS)}")
    try:
        fields = check_schema(schema.get("fields"), c.where)
    except FormatError as e:
        raise c.fail("schema.fields", str(e).split(": ", 1)[-1]) from None
    by_name = {f.name: f for f in fields}
    if "label" in by_name and not isinstance(by_name["label"], IntField):
        raise c.fail("schema.fields", "declares 'label' with a type other than int")
    problem = detection_problem(fields) if schema["task"] == "detection" else ""
    if problem:
        raise c.fail("schema", f"says detection but {problem}")
    return by_name


def _classes(c: _Check, man: dict) -> None:
    classes = c.of(list, man, "classes", "classes")
    if not all(isinstance(x, str) for x in classes):
        raise c.fail("classes", "must be a list of strings")
    if len(set(classes)) != len(classes):
        raise c.fail("classes", "repeats a class name")
    idx = man.get("class_to_idx")
    if idx is not None and idx != {name: i for i, name in enumerate(classes)}:
        raise c.fail("class_to_idx", "does not match classes")
    counts = man.get("class_counts")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(classes)
                               or not all(isinstance(n, int) and not isinstance(n, bool)
                                          and n >= 0 for n in counts)):
        raise c.fail("class_counts", "must list one count >= 0 per class")
