"""One record on disk: a msgpack map of the image, its own keys and its schema's fields; its LMDB
key; its checksum. Plain data only: unpacking a stranger's record never runs code."""
from __future__ import annotations

import struct
import zlib
from typing import Any, Dict, NamedTuple, Optional, Sequence

import msgpack
import msgspec

from ..errors import FormatError
from .fields import Field, IntField

KEY = struct.Struct(">Q")  # 8-byte big-endian: LMDB's order is the numeric one, appends are O(1)
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
    """One record: its image, own keys, stored ``fields`` (``fields.encode``), the image's CRC."""
    return record_bytes(image, path=path, width=width, height=height, format=format, mode=mode,
                        fields=pack_fields(fields or {}))


def pack_fields(fields: Dict[str, Any]) -> "PackedFields":
    """Stored fields as msgpack key-value pairs to splice into a record (``msgspec.Raw`` values
    spliced as they are); the bytes ``msgpack.packb`` gives for the plain data."""
    return PackedFields(b"".join(PACK(k) + PACK(v) for k, v in fields.items()), len(fields))


class PackedFields(NamedTuple):
    pairs: bytes  # msgpack key, value, key, value...
    count: int


def base_type(v: Any) -> Any:
    """A subclass of int, float or str (an IntEnum) as its base type, as msgpack-python packs it."""
    for t in (int, float, str):
        if isinstance(v, t):
            return t(v)
    raise TypeError(f"a {type(v).__name__} cannot be stored in a record")


# The same bytes as ``msgpack.Packer(use_bin_type=True).pack`` for plain data (smallest int,
# str and bin forms, float64), and it splices ``msgspec.Raw`` (tests/test_format.py).
PACK = msgspec.msgpack.Encoder(enc_hook=base_type).encode


def record_bytes(image: bytes, *, path: str, width: int, height: int, format: str, mode: str,
                 fields: PackedFields) -> bytes:
    """The record as a msgpack map (image, fields, own keys): ``msgpack.packb``'s bytes for it."""
    n = 7 + fields.count
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
    return b"".join((head, PACK("image"), PACK(image), fields.pairs, PACK("path"), PACK(path),
                     PACK("width"), PACK(int(width)), PACK("height"), PACK(int(height)),
                     PACK("format"), PACK(format), PACK("mode"), PACK(mode),
                     PACK("crc32"), PACK(crc32(image))))


def unpack_record(data: bytes) -> Dict[str, Any]:
    """A record's fields: plain msgpack only (extension types refused, so a stranger's shard
    stays data); the record's own keys checked here, its schema's fields by their readers."""
    try:
        rec = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except (ValueError, msgpack.UnpackException) as e:  # truncated, nested too deep, odd keys
        raise FormatError(f"record is not valid msgpack ({type(e).__name__}: {str(e)[:120]}): a "
                          f"damaged or foreign shard") from None
    if not isinstance(rec, dict) or "image" not in rec:
        raise FormatError("record is not a packer record (no 'image' field)")
    problem = record_problem(rec, ())
    if problem:
        raise FormatError(f"record is not a packer record: {problem}")
    return rec


def _refuse_ext(code: int, data: bytes):
    raise FormatError(f"record holds a msgpack extension type ({code}); packer records are "
                      f"plain data (a damaged or foreign shard)")


def record_problem(rec: Dict[str, Any], fields: Sequence[Field] = (IntField("label"),)) -> str:
    """What is wrong with an unpacked record (its own keys, then its schema's ``fields``), or ""."""
    for name, kind in RECORD_TYPES.items():
        value = rec.get(name)
        if name not in rec:
            return f"field {name!r} is missing"
        if not isinstance(value, kind) or kind is int and isinstance(value, bool):
            return f"field {name!r} is {type(value).__name__}, not {kind.__name__}"
    for f in fields:
        if f.name not in rec:
            return f"field {f.name!r} is missing"
        problem = f.check(rec[f.name])
        if problem:
            return problem
    return ""
