"""The on-disk contract: the manifest, its files' names, versions, checksums. All plain data,
so opening a stranger's dataset never runs code; ``docs/format.md`` is the human version."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ..errors import FormatError
from .validation import validate_manifest

FORMAT_NAME = "packer"
FORMAT_VERSION = "1.2"  # major.minor: readers refuse a newer major, accept a newer minor
MANIFEST = "manifest.json"
LABELS = "labels.i32"  # little-endian int32, one per record, in global record order
OFFSETS = "offsets.u64"  # little-endian uint64 (offset, length) of each record in its shard
PATHS_INDEX = "paths.u64"  # little-endian uint64 per record: where its path ends in paths.utf8
PATHS_TEXT = "paths.utf8"  # every record's source path, UTF-8, back to back
SHARD_PATTERN = "shard-{:05d}.lmdb"
HASH_CHUNK = 8 << 20
LABEL_FIELD = {"name": "label", "type": "int"}
# Datasets written before schemas (format < 1.2) are classification datasets.
CLASSIFICATION = {"task": "classification", "fields": [LABEL_FIELD]}
COLUMN_SUFFIX = {"int32": "i32", "int64": "i64", "float64": "f64", "uint8": "u8"}
SIZE_COLUMNS = ("width", "height")  # int32 side tables every dataset since 1.2 has


def shard_number(name: str) -> int:
    """N of a ``shard-NNNNN.lmdb`` name (-1 for any other name)."""
    m = re.fullmatch(r"shard-([0-9]+)\.lmdb", name)
    return int(m[1]) if m else -1


def column_file(name: str, dtype: str) -> str:
    """The side table of scalar field ``name``: ``column-NAME.i64`` and the like."""
    return f"column-{name}.{COLUMN_SUFFIX[dtype]}"


def dataset_schema(manifest: Dict[str, Any]) -> Dict[str, Any]:
    """``{"task", "fields"}`` of a dataset (older datasets: classification with ``label``)."""
    return manifest.get("schema") or CLASSIFICATION


def side_tables(manifest: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any], str]]:
    """Every per-record side table a manifest lists: ``(key, entry, file name when staged)``,
    key ``labels``, ``offsets``, ``columns.NAME``, ``paths.index`` or ``paths.text``."""
    out = [(k, manifest[k], name) for k, name in (("labels", LABELS), ("offsets", OFFSETS))
           if manifest.get(k) is not None]
    for name, entry in (manifest.get("columns") or {}).items():
        out.append((f"columns.{name}", entry, column_file(name, entry["dtype"])))
    paths = manifest.get("paths") or {}
    out += [(f"paths.{k}", paths[k], name)
            for k, name in (("index", PATHS_INDEX), ("text", PATHS_TEXT)) if k in paths]
    return out


def set_table(manifest: Dict[str, Any], key: str, entry: Dict[str, Any]) -> None:
    """Put a side table's entry back under its ``side_tables`` key."""
    if key.startswith(("columns.", "paths.")):
        group, name = key.split(".", 1)
        manifest.setdefault(group, {})[name] = entry
    else:
        manifest[key] = entry


def file_sha256(path: os.PathLike, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def check_version(version: str, where: os.PathLike) -> None:
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        raise FormatError(f"{where}: unreadable format_version {version!r}") from None
    if major > int(FORMAT_VERSION.split(".")[0]):
        raise FormatError(
            f"{where} was written in packer format {version}, newer than this packer "
            f"understands ({FORMAT_VERSION}); upgrade packer (pip install -U packer-lmdb)")


def shard_file(root: os.PathLike, rel: str) -> Path:
    """Where the shard at manifest path ``rel`` lives; one outside the dataset folder (merged)
    must lead into a packer dataset, so a manifest cannot name an arbitrary file."""
    path = Path(root) / rel
    if "/" in rel and not (path.parent / MANIFEST).is_file():
        raise FormatError(f"shard {rel} in {Path(root) / MANIFEST} lies in {path.parent}, which "
                          f"is not a packer dataset (a merged dataset's parts are); refusing it")
    return path


def not_a_dataset(root: Path) -> str:
    """Why ``root`` holds no dataset, with the next step for the usual first mistakes."""
    if not root.exists():
        return f"{root} does not exist (give the folder a `packer build` wrote, or stage made)"
    if not root.is_dir():
        return f"{root} is a file, not a packer dataset folder"
    if (root / ".packer-build.json").exists() or any(root.glob(".shard-*.partial")):
        return (f"{root} is an unfinished build (no {MANIFEST} yet); re-run the same "
                f"`packer build` command to resume it")
    images = [f"{d}*.{e}" for d in ("", "*/") for e in ("jpg", "jpeg", "png", "JPEG", "JPG")]
    if any(next(root.glob(p), None) is not None for p in images):
        return (f"{root} is an image folder, not a packed dataset: pack it first with "
                f"`packer build {root} DST` (then use DST)")
    return f"{root} is not a packer dataset: {root / MANIFEST} not found"


def read_manifest(root: os.PathLike) -> Dict[str, Any]:
    """Load and sanity-check ``root/manifest.json``; a dataset without one is not complete."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FormatError(not_a_dataset(Path(root)))
    return parse_manifest(path.read_bytes(), str(path), "rebuild or re-stage the dataset")


def parse_manifest(data: bytes, where: str,
                   fix: str = "rebuild or re-upload the dataset") -> Dict[str, Any]:
    """A manifest's bytes, checked; ``where`` names it in messages, ``fix`` ends a damaged one's."""
    try:
        man = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else e
        raise FormatError(f"{where} is damaged ({reason}); {fix}") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT_NAME:
        raise FormatError(f"{where} is not a packer manifest")
    check_version(man.get("format_version", "?"), where)
    return validate_manifest(man, where)


def classes_text(m: dict) -> str:
    """"10 classes", "80 categories" (COCO) or "no class labels" (e.g. a --meta build)."""
    if isinstance(m.get("categories"), list):
        return f"{len(m['categories'])} categories"
    return f"{len(m['classes'])} classes" if m["classes"] else "no class labels"
