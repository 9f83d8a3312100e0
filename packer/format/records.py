"""The on-disk contract for one record: a msgpack map of the image, its own keys and its
schema's fields; the LMDB key of each; the checksum. Plain data only: unpacking a
stranger's record never runs code (no extension types)."""
from __future__ import annotations

import struct
import zlib
from typing import Any, Dict, NamedTuple, Optional, Sequence

import msgpack

from ..errors import FormatError
from .fields import CheckedData, PackedData, value_problem
from .manifest import LABEL_FIELD

KEY = struct.Struct(">Q")  # 8-byte big-endian: LMDB's byte order == numeric order, so appends are O(1)
# Every record's own keys; its schema's fields (``label`` for classification) come beside them.
RECORD_TYPES = {"image": bytes, "path": str, "width": int, "height": int,
                "format": str, "mode": str, "crc32": int}
RECORD_FIELDS = tuple(RECORD_TYPES)


def key(index: int) -> bytes:
    """The LMDB key of the ``index``-th record of a shard."""
    return KEY.pack(index)


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def pack_record(image: bytes, *, path: str, width: int, height: int, format: str, mode: str,
                fields: Optional[Dict[str, Any]] = None) -> bytes:
    """Serialize one record: its image, its own keys, and its stored ``fields`` (see
    ``packer.format.fields.encode``); the checksum covers the stored image bytes."""
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
