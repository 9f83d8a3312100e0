"""Typed record fields: the schema a manifest declares, and values <-> stored data.

A record holds its image and, per the manifest's ``schema``, any number of named fields:

- ``int`` (int64), ``float`` (float64, finite), ``bool``, ``str`` (UTF-8): scalars. Scalars
  also go to a side table (one fixed-width value per record), so a column loads without
  reading a record;
- ``array``: raw little-endian bytes with the schema's ``dtype`` and ``shape`` (``-1`` as
  the first dimension: any count, e.g. boxes ``[-1, 4]``) — never a pickled object;
- ``data``: plain nested data (lists, string-keyed maps, str, int, float, bool, None), e.g.
  COCO segmentation polygons and RLE, stored as msgpack without extension types.

Everything is checked on the way in (a wrong type names the field and the sample) and on
the way out (a record that does not match its schema is a damaged record).
"""
from __future__ import annotations

import math
import re
import sys
from array import array
from itertools import chain
from typing import Any, Dict, List, Optional, Tuple

from ..errors import FormatError
from .._util.text import is_utf8

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# The record's own keys: no field may take them.
RESERVED = frozenset({"image", "path", "width", "height", "format", "mode", "crc32"})
SCALAR_TYPES = ("int", "float", "bool", "str")
TYPES = SCALAR_TYPES + ("array", "data")
# dtype name -> array typecode (all fixed-width on every platform packer runs on).
DTYPES = {"uint8": "B", "int8": "b", "int16": "h", "uint16": "H", "int32": "i", "uint32": "I",
          "int64": "q", "float32": "f", "float64": "d"}
# Side-table dtype of each scalar type; label, width and height are int32 as labels.i32 has been.
COLUMN_DTYPE = {"int": "int64", "float": "float64", "bool": "uint8"}
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_DEPTH = 32  # nesting of ``data`` values
BIG_ENDIAN = sys.byteorder == "big"  # stored arrays are little-endian


class CheckedData(list):
    """A ``data`` value its maker has already checked is plain data (e.g. COCO polygons,
    checked as they are parsed): ``encode`` stores it without walking it a second time.
    Its items may be ``PackedData``."""


class PackedData(bytes):
    """An item of a ``CheckedData`` list in its stored form already: the msgpack bytes of
    plain data its maker checked while packing it (COCO polygon text, which
    ``packer.sources.coco`` packs with msgspec).
    ``packer.format.manifest.pack_fields`` splices it in; a reader sees the plain data. Only ever an
    item of a ``CheckedData``: anywhere else msgpack would store it as bytes."""


class CheckedArray(bytes):
    """An ``array`` value its maker built as stored (``checked_array``: little-endian, the
    schema's dtype, a whole number of rows, finite): ``encode`` keeps it as it is. The
    build's workers fit every object of every image: the general checks cost them more
    than the rest of a COCO image's fields."""


def checked_array(typecode: str, values) -> CheckedArray:
    """``values`` (numbers its caller checked) as a stored array of ``typecode``."""
    out = array(typecode, values)
    if BIG_ENDIAN:
        out.byteswap()
    return CheckedArray(out)


def field_problem(f: Any) -> str:
    """Why ``f`` is not a valid schema entry, or ""."""
    if not isinstance(f, dict):
        return "must be an object"
    name, kind = f.get("name"), f.get("type")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return f"name {name!r} must match {NAME.pattern}"
    if name in RESERVED:
        return f"name {name!r} is reserved for the record's own data"
    if kind not in TYPES:
        return f"type {kind!r} must be one of {', '.join(TYPES)}"
    if kind == "array":
        if f.get("dtype") not in DTYPES:
            return f"dtype {f.get('dtype')!r} must be one of {', '.join(DTYPES)}"
        shape = f.get("shape")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 8
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
                or any(d < 0 for d in shape[1:]) or shape[0] < -1):
            return f"shape {shape!r} must list 1-8 sizes >= 0 (the first may be -1: any count)"
    return ""


def check_schema(fields: Any, where: str) -> List[dict]:
    """``fields`` if it is a list of valid, uniquely named entries, else FormatError."""
    if not isinstance(fields, list):
        raise FormatError(f"{where}: schema fields must be a list")
    seen = set()
    for f in fields:
        problem = field_problem(f)
        if problem:
            raise FormatError(f"{where}: schema field {str(f)[:80]}: {problem}")
        if f["name"] in seen:
            raise FormatError(f"{where}: schema names field {f['name']!r} twice")
        seen.add(f["name"])
    return fields


def detection_problem(fields: List[dict]) -> str:
    """Why ``fields`` cannot be a detection dataset's, or "": detection targets need
    ``boxes`` (float, ``[-1, 4]``, XYXY pixels), ``labels`` (int, ``[-1]``), ``image_id`` (int);
    other per-object arrays (``area``, ``iscrowd``...) must have one row per box."""
    by = {f["name"]: f for f in fields}
    b, lab, iid = by.get("boxes"), by.get("labels"), by.get("image_id")
    if not b or b["type"] != "array" or b["shape"] != [-1, 4] or b["dtype"] not in ("float32", "float64"):
        return "needs a 'boxes' field: array float32 [-1, 4] (XYXY pixels)"
    if not lab or lab["type"] != "array" or lab["shape"] != [-1] or lab["dtype"][0] not in "iu":
        return "needs a 'labels' field: array int64 [-1] (one per box)"
    if not iid or iid["type"] != "int":
        return "needs an 'image_id' field: int"
    return ""


def is_column(f: dict) -> bool:
    """Scalars of fixed width go to side tables too (``str`` does not: variable width)."""
    return f["type"] in COLUMN_DTYPE


# -- values in ----------------------------------------------------------------------------

def encode(fields: List[dict], values: Dict[str, Any]) -> Dict[str, Any]:
    """The stored form of a sample's ``values`` (a ValueError names what does not fit)."""
    missing = [f["name"] for f in fields if f["name"] not in values]
    extra = sorted(set(values) - {f["name"] for f in fields})
    if missing or extra:
        raise ValueError(f"fields do not match the schema: missing {missing}, unexpected {extra}")
    return {f["name"]: encode_value(f, values[f["name"]]) for f in fields}


def encode_value(f: dict, v: Any) -> Any:
    kind, name = f["type"], f["name"]
    if kind in SCALAR_TYPES and hasattr(v, "dtype") and hasattr(v, "shape"):
        if tuple(v.shape) != ():  # a tensor or numpy array: only a 0-d one is a scalar
            raise ValueError(f"field {name!r} is a {kind}, got an array of shape {tuple(v.shape)}")
        v = v.item()  # its Python value, by its own dtype: 2.7 stays a float (refused for int)
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"field {name!r}: {v!r} is not an int")
        v = int(v)
        if not INT64[0] <= v <= INT64[1]:
            raise ValueError(f"field {name!r}: {shown_int(v)} does not fit in int64")
        return v
    if kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"field {name!r}: {v!r} is not a number")
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"field {name!r}: {v} is not finite (NaN and inf are refused)")
        return v
    if kind == "bool":
        if not isinstance(v, bool):
            raise ValueError(f"field {name!r}: {v!r} is not a bool")
        return v
    if kind == "str":
        if not isinstance(v, str):
            raise ValueError(f"field {name!r}: {type(v).__name__} is not a str")
        if not is_utf8(v):
            raise ValueError(f"field {name!r}: the text is not valid Unicode")
        return v
    if kind == "array":
        return v if type(v) is CheckedArray else encode_array(f, v)
    if type(v) is CheckedData:
        return v
    problem = data_problem(v)
    if problem:
        raise ValueError(f"field {name!r}: {problem}")
    return v


def encode_array(f: dict, v: Any) -> bytes:
    """Nested lists, an ``array.array``, a tensor or a numpy array -> little-endian bytes."""
    code = DTYPES[f["dtype"]]
    rows = f["shape"][1:]
    if len(rows) == 1 and isinstance(v, list) and v and isinstance(v[0], (list, tuple)):
        try:  # rows of numbers (boxes): flattened in C; anything odd: the general path says
            if set(map(len, v)) == {rows[0]}:
                v = array(code, chain.from_iterable(v))
        except (TypeError, OverflowError):
            pass
    elif not rows and type(v) is list and not (v and isinstance(v[0], (list, tuple))):
        try:  # a flat list of numbers (labels, ids): straight into the array
            v = array(code, v)
        except (TypeError, OverflowError):
            pass
    if hasattr(v, "detach"):  # a torch tensor: no torch import needed here
        v = v.detach().cpu().reshape(-1).tolist()
    elif hasattr(v, "tolist") and not isinstance(v, array):  # numpy
        v = v.reshape(-1).tolist() if hasattr(v, "reshape") else v.tolist()
    if isinstance(v, array) and v.typecode == code:
        out = v
    else:
        flat = _flatten(v, f["name"]) if not isinstance(v, array) else v
        try:
            out = array(code, flat)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"field {f['name']!r}: values do not fit {f['dtype']} ({e})") \
                from None
    if code in "fd" and not all(map(math.isfinite, out)):
        raise ValueError(f"field {f['name']!r}: holds NaN or inf (refused)")
    array_shape(f, len(out) * out.itemsize)  # checks the element count against the shape
    if sys.byteorder != "little":
        out = array(code, out)  # a copy: the caller's array stays as it was
        out.byteswap()
    return out.tobytes()


def _flatten(v: Any, name: str, depth: int = 0) -> List[Any]:
    if not isinstance(v, (list, tuple)):
        return [v]
    if depth > 8:
        raise ValueError(f"field {name!r}: nested too deeply for an array")
    out: List[Any] = []
    for x in v:
        out.extend(_flatten(x, name, depth + 1) if isinstance(x, (list, tuple)) else [x])
    return out


def shown_int(v: int) -> str:
    return str(v) if v.bit_length() <= 128 else f"a {v.bit_length()}-bit integer"


def numbers_fit(values) -> bool:
    """All numbers, finite, ints within int64: one pass at C speed. A finite sum of
    magnitudes bounds every value; anything else (False for NaN and inf too, and for text)
    is left to ``data_problem``'s loop, which says why."""
    try:
        return math.fsum(map(abs, values)) < INT64[1]
    except (TypeError, OverflowError):
        return False


def data_problem(v: Any, depth: int = 0) -> str:
    """Why ``v`` is not plain nested data, or ""."""
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if v is None or isinstance(v, bool):
        return ""
    if isinstance(v, str):
        return "" if v.isascii() or is_utf8(v) else "text is not valid Unicode (a lone surrogate)"
    if isinstance(v, int):
        return "" if INT64[0] <= v <= INT64[1] else f"{shown_int(v)} does not fit in int64"
    if isinstance(v, float):
        return "" if math.isfinite(v) else "holds NaN or inf (refused)"
    if isinstance(v, (list, tuple)):
        if v and type(v[0]) is list and set(map(type, v)) == {list}:
            if numbers_fit(chain.from_iterable(v)):  # lists of numbers (polygons)
                return ""
        elif v and not isinstance(v[0], (list, tuple, dict, str)) and numbers_fit(v):
            return ""
        for x in v:
            p = data_problem(x, depth + 1)
            if p:
                return p
        return ""
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                return f"map key {k!r} is not a str"
            p = data_problem(x, depth + 1)
            if p:
                return p
        return ""
    return f"{type(v).__name__} is not plain data (lists, maps, str, numbers, bool, None)"


# -- values out ---------------------------------------------------------------------------

def array_shape(f: dict, nbytes: int) -> Tuple[int, ...]:
    """The shape of an array field stored in ``nbytes`` bytes (ValueError if impossible)."""
    size = array(DTYPES[f["dtype"]]).itemsize
    shape = list(f["shape"])
    inner = 1
    for d in shape[1:]:
        inner *= d
    if shape[0] == -1:
        if inner == 0:
            raise ValueError(f"field {f['name']!r}: shape {shape} has no size")
        if nbytes % (inner * size):
            raise ValueError(f"field {f['name']!r}: {nbytes} bytes is no whole number of "
                             f"{f['dtype']} rows of shape {shape[1:]}")
        shape[0] = nbytes // (inner * size)
    elif nbytes != inner * shape[0] * size:
        raise ValueError(f"field {f['name']!r}: {nbytes // size} values do not make shape {shape}")
    return tuple(shape)


def value_problem(f: dict, v: Any) -> str:
    """Why a stored value does not match its schema entry, or "" (a damaged record)."""
    kind = f["type"]
    if kind == "array":
        if not isinstance(v, bytes):
            return f"field {f['name']!r} is {type(v).__name__}, not array bytes"
        try:
            array_shape(f, len(v))
        except ValueError as e:
            return str(e)
        return ""
    if kind == "data":
        p = data_problem(v)
        return f"field {f['name']!r}: {p}" if p else ""
    want = {"int": int, "float": float, "bool": bool, "str": str}[kind]
    if not isinstance(v, want) or want is int and isinstance(v, bool):
        return f"field {f['name']!r} is {type(v).__name__}, not {kind}"
    return ""


def to_array(f: dict, raw: bytes) -> array:
    """A stored array field as a flat ``array.array`` in native byte order (shape: array_shape)."""
    out = array(DTYPES[f["dtype"]])
    out.frombytes(raw)
    if sys.byteorder != "little":
        out.byteswap()
    return out


# -- inference (for ``packer.write`` without a schema) ------------------------------------

def infer_field(name: str, v: Any) -> Optional[dict]:
    """A schema entry for one example value, or None if it cannot be told from it (an empty
    list: pass ``schema=``). Lists of ints are int64 arrays, of floats float32 (torch's
    default dtype; pass a schema for float64)."""
    if isinstance(v, bool):
        return {"name": name, "type": "bool"}
    if isinstance(v, int):
        return {"name": name, "type": "int"}
    if isinstance(v, float):
        return {"name": name, "type": "float"}
    if isinstance(v, str):
        return {"name": name, "type": "str"}
    if hasattr(v, "dtype") and hasattr(v, "shape"):  # a tensor or numpy array
        dtype = str(v.dtype).replace("torch.", "")
        if len(v.shape) == 0:  # a 0-d tensor or numpy scalar: a scalar field
            kind = "bool" if dtype == "bool" else "float" if "float" in dtype else "int"
            return {"name": name, "type": kind}
        if dtype in DTYPES:
            return {"name": name, "type": "array", "dtype": dtype, "shape": [-1, *v.shape[1:]]
                    if len(v.shape) else [1]}
    if isinstance(v, (list, tuple)) and v:
        flat = _flatten(v, name)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
            dtype = "int64"
        elif all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat):
            dtype = "float32"
        else:
            return {"name": name, "type": "data"}
        inner = list(_shape_of(v)[1:])
        return {"name": name, "type": "array", "dtype": dtype, "shape": [-1, *inner]}
    if isinstance(v, (dict, list, tuple)) or v is None:
        return None if isinstance(v, (list, tuple)) else {"name": name, "type": "data"}
    return None


def _shape_of(v: Any) -> Tuple[int, ...]:
    if isinstance(v, (list, tuple)):
        return (len(v),) + (_shape_of(v[0]) if v else ())
    return ()
