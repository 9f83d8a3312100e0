"""The on-disk contract: record and manifest schemas, keys, versions, checksums.

Everything here is plain data (msgpack records, a JSON manifest, raw int32 labels): opening
a dataset from a stranger never runs code. ``docs/format.md`` is the human version of this
file; keep them in step.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import msgpack

from .errors import FormatError
from .fields import CheckedData, PackedData, value_problem
from .schema import validate_manifest

FORMAT_NAME = "packer"
FORMAT_VERSION = "1.2"  # major.minor: readers refuse a newer major, accept a newer minor
MANIFEST = "manifest.json"
LABELS = "labels.i32"  # little-endian int32, one per record, in global record order
OFFSETS = "offsets.u64"  # little-endian uint64 (offset, length) per record: where its value sits in its shard
PATHS_INDEX = "paths.u64"  # little-endian uint64 per record: where its source path ends in paths.utf8
PATHS_TEXT = "paths.utf8"  # every record's source path, UTF-8, back to back
SHARD_PATTERN = "shard-{:05d}.lmdb"
KEY = struct.Struct(">Q")  # 8-byte big-endian: LMDB's byte order == numeric order, so appends are O(1)
# Every record's own keys; its schema's fields (``label`` for classification) come beside them.
RECORD_TYPES = {"image": bytes, "path": str, "width": int, "height": int,
                "format": str, "mode": str, "crc32": int}
RECORD_FIELDS = tuple(RECORD_TYPES)
HASH_CHUNK = 8 << 20
LABEL_FIELD = {"name": "label", "type": "int"}
# Datasets written before schemas (format < 1.2) are classification datasets.
CLASSIFICATION = {"task": "classification", "fields": [LABEL_FIELD]}
COLUMN_SUFFIX = {"int32": "i32", "int64": "i64", "float64": "f64", "uint8": "u8"}
SIZE_COLUMNS = ("width", "height")  # int32 side tables every dataset since 1.2 has


def shard_number(name: str) -> int:
    """N of a ``shard-NNNNN.lmdb`` name (-1 for any other name)."""
    stem = name[len("shard-"):-len(".lmdb")] if name.startswith("shard-") and name.endswith(
        ".lmdb") else ""
    return int(stem) if stem.isdigit() and stem.isascii() else -1


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
    out += [(f"paths.{k}", paths[k], name) for k, name in (("index", PATHS_INDEX), ("text", PATHS_TEXT))
            if k in paths]
    return out


def set_table(manifest: Dict[str, Any], key: str, entry: Dict[str, Any]) -> None:
    """Put a side table's entry back under its ``side_tables`` key."""
    if key.startswith(("columns.", "paths.")):
        group, name = key.split(".", 1)
        manifest.setdefault(group, {})[name] = entry
    else:
        manifest[key] = entry


def key(index: int) -> bytes:
    """The LMDB key of the ``index``-th record of a shard."""
    return KEY.pack(index)


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def pack_record(image: bytes, *, path: str, width: int, height: int, format: str, mode: str,
                fields: Optional[Dict[str, Any]] = None) -> bytes:
    """Serialize one record: its image, its own keys, and its stored ``fields`` (see
    ``packer.fields.encode``); the checksum covers the stored image bytes."""
    return record_bytes(image, path=path, width=width, height=height, format=format, mode=mode,
                        fields=pack_fields(fields or {}))


def pack_fields(fields: Dict[str, Any]) -> "PackedFields":
    """Stored fields as msgpack key-value pairs, ready to splice into a record: the build's
    workers pack them, so the single writer process only concatenates."""
    return PackedFields(b"".join(PACK(k) + packed_value(v) for k, v in fields.items()),
                        len(fields))


def packed_value(v: Any) -> bytes:
    """``v`` as msgpack: a ``CheckedData`` list item by item, its ``PackedData`` items as
    they are (the same bytes ``msgpack.packb`` gives for the plain data they hold)."""
    if type(v) is not CheckedData:
        return PACK(v)
    return array_head(len(v)) + b"".join(x if type(x) is PackedData else PACK(x) for x in v)


def array_head(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items."""
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if n < 1 << 16 else b"\xdd" + struct.pack(">I", n)


class PackedFields(NamedTuple):
    pairs: bytes  # msgpack key, value, key, value...
    count: int


PACK = msgpack.Packer(use_bin_type=True, autoreset=True).pack


def record_bytes(image: bytes, *, path: str, width: int, height: int, format: str, mode: str,
                 fields: PackedFields) -> bytes:
    """The record as a msgpack map: image first, then the fields, then the record's own keys
    (the same bytes ``msgpack.packb`` gives for that dict)."""
    n = 7 + fields.count
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
    return b"".join((head, PACK("image"), PACK(image), fields.pairs, PACK("path"), PACK(path),
                     PACK("width"), PACK(int(width)), PACK("height"), PACK(int(height)),
                     PACK("format"), PACK(format), PACK("mode"), PACK(mode),
                     PACK("crc32"), PACK(crc32(image))))


def unpack_record(data: bytes) -> Dict[str, Any]:
    """A record's fields. Plain msgpack only: str as UTF-8, and extension types (which a
    format could hook to objects or code) refused, so a stranger's shard stays data."""
    try:
        rec = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except (ValueError, msgpack.UnpackException) as e:  # truncated, nested too deep, odd keys
        raise FormatError(f"record is not valid msgpack ({type(e).__name__}: {str(e)[:120]}): a "
                          f"damaged or foreign shard") from None
    if not isinstance(rec, dict) or "image" not in rec:
        raise FormatError("record is not a packer record (no 'image' field)")
    return rec


def _refuse_ext(code: int, data: bytes):
    raise FormatError(f"record holds a msgpack extension type ({code}); packer records are "
                      f"plain data (a damaged or foreign shard)")


def record_problem(rec: Dict[str, Any], fields: Sequence[Dict[str, Any]] = (LABEL_FIELD,)) -> str:
    """What is wrong with an unpacked record (its own keys, then its schema's ``fields``:
    names and types), or ""."""
    for name, kind in RECORD_TYPES.items():
        value = rec.get(name)
        if not isinstance(value, kind) or kind is int and isinstance(value, bool):
            return f"field {name!r} is {type(value).__name__}, not {kind.__name__}"
    for f in fields:
        if f["name"] not in rec:
            return f"field {f['name']!r} is missing"
        problem = value_problem(f, rec[f["name"]])
        if problem:
            return problem
    return ""


def file_sha256(path: os.PathLike, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(HASH_CHUNK)
            if not chunk:
                break
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
            f"understands ({FORMAT_VERSION}); upgrade packer (pip install -U packer)")


def shard_file(root: os.PathLike, rel: str) -> Path:
    """Where the shard at manifest path ``rel`` lives. A path outside the dataset folder (a
    merged dataset's) must lead into a packer dataset, so a manifest cannot make packer
    read, hash or copy an arbitrary file."""
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
    images = ("*.jpg", "*.jpeg", "*.png", "*.JPEG", "*.JPG", "*/*.jpg", "*/*.jpeg", "*/*.png",
              "*/*.JPEG", "*/*.JPG")
    if any(next(root.glob(p), None) is not None for p in images):
        return (f"{root} is an image folder, not a packed dataset: pack it first with "
                f"`packer build {root} DST` (then use DST)")
    return f"{root} is not a packer dataset: {root / MANIFEST} not found"


def read_manifest(root: os.PathLike) -> Dict[str, Any]:
    """Load and sanity-check ``root/manifest.json``; a dataset without one is not complete."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise FormatError(not_a_dataset(root))
    try:
        man = json.loads(path.read_text("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else e
        raise FormatError(f"{path} is damaged ({reason}); rebuild or re-stage the dataset") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT_NAME:
        raise FormatError(f"{path} is not a packer manifest")
    check_version(man.get("format_version", "?"), path)
    return validate_manifest(man, str(path))
