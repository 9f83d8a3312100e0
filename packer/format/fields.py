"""Typed record fields, one class per schema type, made from the manifest's ``schema`` entries
(``field_of``) and written back unchanged (``Field.spec``); docs/format.md."""
from __future__ import annotations

import math
import re
import sys
from array import array
from dataclasses import dataclass
from itertools import chain
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from ..errors import FormatError
from .._util.text import is_utf8

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# The record's own keys: no field may take them.
RESERVED = frozenset({"image", "path", "width", "height", "format", "mode", "crc32"})
# dtype name -> array typecode (all fixed-width on every platform packer runs on).
DTYPES = {"uint8": "B", "int8": "b", "int16": "h", "uint16": "H", "int32": "i", "uint32": "I",
          "int64": "q", "float32": "f", "float64": "d"}
INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_DEPTH = 32  # nesting of ``data`` values


@dataclass(frozen=True)
class Field:
    """A schema entry: ``encode`` gives a value's stored form, ``check`` why a stored value is
    not this field's, or ""; ``column``: its side-table dtype, if any. Default: any plain data."""
    name: str
    type: ClassVar[str] = ""
    column: ClassVar[Optional[str]] = None

    def spec(self) -> Dict[str, Any]:
        return {"name": self.name, "type": self.type}

    def encode(self, v: Any) -> Any:
        problem = data_problem(v)
        if problem:
            raise ValueError(f"field {self.name!r}: {problem}")
        return v

    def check(self, v: Any) -> str:
        problem = data_problem(v)
        return f"field {self.name!r}: {problem}" if problem else ""


class Scalar(Field):
    """A value of ``want`` (or of ``takes``: a float takes ints); a 0-d tensor or numpy value by
    its own dtype (2.7 stays a float, refused for int)."""
    want: ClassVar[type] = object
    takes: ClassVar[tuple] = ()
    noun: ClassVar[str] = ""

    def encode(self, v: Any) -> Any:
        if hasattr(v, "dtype") and hasattr(v, "shape"):
            if tuple(v.shape) != ():  # a tensor or numpy array: only a 0-d one is a scalar
                raise ValueError(f"field {self.name!r} is a {self.type}, got an array of shape "
                                 f"{tuple(v.shape)}")
            v = v.item()
        if isinstance(v, bool) != (self.want is bool) or not isinstance(v, self.takes or self.want):
            raise ValueError(f"field {self.name!r}: {v!r:.60} is not {self.noun}")
        try:
            v = self.want(v)  # an IntEnum as int, an int as float
        except OverflowError:
            raise ValueError(f"field {self.name!r}: a {v.bit_length()}-bit integer does not fit "
                             f"a {self.type}") from None
        return super().encode(v)

    def check(self, v: Any) -> str:
        if not isinstance(v, self.want) or self.want is int and isinstance(v, bool):
            return f"field {self.name!r} is {type(v).__name__}, not {self.type}"
        return ""


class IntField(Scalar):
    type, column, want, noun = "int", "int64", int, "an int"


class FloatField(Scalar):
    type, column, want, noun, takes = "float", "float64", float, "a number", (int, float)


class BoolField(Scalar):
    type, column, want, noun = "bool", "uint8", bool, "a bool"


class StrField(Scalar):
    type, want, noun = "str", str, "a str"  # no side table: variable width


@dataclass(frozen=True)
class ArrayField(Field):
    """Numbers of ``dtype`` in ``shape`` (``-1`` first: any count), stored little-endian."""
    dtype: str = "float32"
    shape: Tuple[int, ...] = (-1,)
    type: ClassVar[str] = "array"

    def spec(self) -> Dict[str, Any]:
        return {"name": self.name, "type": "array", "dtype": self.dtype, "shape": list(self.shape)}

    def encode(self, v: Any) -> bytes:
        """Nested lists, an ``array.array``, a tensor or a numpy array -> little-endian bytes."""
        code, rows = DTYPES[self.dtype], self.shape[1:]
        nested = isinstance(v, list) and v and isinstance(v[0], (list, tuple))
        try:  # boxes or a flat list straight into the array, in C; the general path judges the rest
            if len(rows) == 1 and nested and set(map(len, v)) == {rows[0]}:
                v = array(code, chain.from_iterable(v))
            elif not rows and type(v) is list and not nested:
                v = array(code, v)
        except (TypeError, OverflowError):
            pass
        if hasattr(v, "detach"):  # a torch tensor: no torch import needed here
            v = v.detach().cpu().reshape(-1).tolist()
        elif hasattr(v, "tolist") and not isinstance(v, array):  # numpy
            v = v.reshape(-1).tolist() if hasattr(v, "reshape") else v.tolist()
        if not isinstance(v, array) or v.typecode != code:
            try:
                v = array(code, v if isinstance(v, array) else flatten(v, self.name))
            except (TypeError, OverflowError) as e:
                raise ValueError(f"field {self.name!r}: values do not fit {self.dtype} ({e})") \
                    from None
        if code in "fd" and not all(map(math.isfinite, v)):
            raise ValueError(f"field {self.name!r}: holds NaN or inf (refused)")
        self.shape_of(len(v) * v.itemsize)  # checks the element count against the shape
        return little_endian(v).tobytes()

    def check(self, v: Any) -> str:
        if not isinstance(v, bytes):
            return f"field {self.name!r} is {type(v).__name__}, not array bytes"
        try:
            self.shape_of(len(v))
        except ValueError as e:
            return str(e)
        return ""

    def shape_of(self, nbytes: int) -> Tuple[int, ...]:
        """The shape of a value stored in ``nbytes`` bytes (ValueError if impossible)."""
        size = array(DTYPES[self.dtype]).itemsize
        shape, inner = list(self.shape), math.prod(self.shape[1:])
        if shape[0] == -1:
            if inner == 0:
                raise ValueError(f"field {self.name!r}: shape {shape} has no size")
            if nbytes % (inner * size):
                raise ValueError(f"field {self.name!r}: {nbytes} bytes is no whole number of "
                                 f"{self.dtype} rows of shape {shape[1:]}")
            shape[0] = nbytes // (inner * size)
        elif nbytes != inner * shape[0] * size:
            raise ValueError(f"field {self.name!r}: {nbytes // size} values do not make shape "
                             f"{shape}")
        return tuple(shape)

    def values(self, raw: bytes) -> array:
        """A stored value as a flat ``array.array`` in native byte order (shape: ``shape_of``)."""
        out = array(DTYPES[self.dtype])
        out.frombytes(raw)
        return little_endian(out)


class DataField(Field):
    """Any plain nested data: lists, maps, str, numbers, bool, None."""
    type = "data"


FIELD_TYPES = {c.type: c for c in (IntField, FloatField, BoolField, StrField, ArrayField,
                                   DataField)}


def little_endian(a: array) -> array:
    """``a`` as stored (little-endian), or stored ``a`` as native: ``a`` itself on little-endian."""
    if sys.byteorder == "little":
        return a
    swapped = array(a.typecode, a)
    swapped.byteswap()
    return swapped


def field_of(spec: Dict[str, Any]) -> Field:
    """The field a valid schema entry (``field_problem`` finds nothing) describes."""
    if spec["type"] == "array":
        return ArrayField(spec["name"], spec["dtype"], tuple(spec["shape"]))
    return FIELD_TYPES[spec["type"]](spec["name"])


def field_problem(f: Any) -> str:
    """Why ``f`` is not a valid schema entry, or ""."""
    if not isinstance(f, dict):
        return "must be an object"
    name, kind = f.get("name"), f.get("type")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return f"name {name!r} must match {NAME.pattern}"
    if name in RESERVED:
        return f"name {name!r} is reserved for the record's own data"
    if not isinstance(kind, str) or kind not in FIELD_TYPES:
        return f"type {kind!r:.60} must be one of {', '.join(FIELD_TYPES)}"
    if kind == "array":
        if not isinstance(f.get("dtype"), str) or f.get("dtype") not in DTYPES:
            return f"dtype {f.get('dtype')!r} must be one of {', '.join(DTYPES)}"
        shape = f.get("shape")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 8
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
                or any(d < 0 for d in shape[1:]) or shape[0] < -1):
            return f"shape {shape!r} must list 1-8 sizes >= 0 (the first may be -1: any count)"
    return ""


def check_schema(specs: Any, where: str) -> List[Field]:
    """The fields of ``specs``, a list of valid, uniquely named entries, or FormatError."""
    if not isinstance(specs, list):
        raise FormatError(f"{where}: schema fields must be a list")
    seen = set()
    for f in specs:
        problem = field_problem(f)
        if problem:
            raise FormatError(f"{where}: schema field {str(f)[:80]}: {problem}")
        if f["name"] in seen:
            raise FormatError(f"{where}: schema names field {f['name']!r} twice")
        seen.add(f["name"])
    return [field_of(f) for f in specs]


def detection_problem(fields: List[Field]) -> str:
    """Why ``fields`` cannot be a detection dataset's (boxes, labels, image_id), or ""."""
    by = {f.name: f for f in fields}
    b, lab, iid = by.get("boxes"), by.get("labels"), by.get("image_id")
    if (not isinstance(b, ArrayField) or b.shape != (-1, 4)
            or b.dtype not in ("float32", "float64")):
        return "needs a 'boxes' field: array float32 [-1, 4] (XYXY pixels)"
    if not isinstance(lab, ArrayField) or lab.shape != (-1,) or lab.dtype[0] not in "iu":
        return "needs a 'labels' field: array int64 [-1] (one per box)"
    if not isinstance(iid, IntField):
        return "needs an 'image_id' field: int"
    return ""


# One entry per box, cut with them; any other key is the image's (a name, not a shape, decides).
PER_OBJECT = ("labels", "area", "iscrowd", "keypoints", "ann_ids", "segmentation")


def object_count_problem(fields: Dict[str, Field], stored: Dict[str, Any]) -> str:
    """Why the encoded per-object values of a detection record are not one per box, or ""."""
    def count(name):
        f, v = fields[name], stored[name]
        return (f.shape_of(len(v))[0] if isinstance(f, ArrayField) else
                len(v) if isinstance(v, list) else None)
    n = count("boxes")
    for name in (k for k in PER_OBJECT if k in fields):
        if count(name) is None:
            return (f"{name} must hold one entry per box (an array or a list), not a "
                    f"{fields[name].type}")
        if count(name) != n:
            return f"{n} boxes but {count(name)} {name}"
    return ""


def encode(fields: List[Field], values: Dict[str, Any]) -> Dict[str, Any]:
    """The stored form of a sample's ``values`` (a ValueError names what does not fit)."""
    missing = [f.name for f in fields if f.name not in values]
    extra = sorted(set(values) - {f.name for f in fields})
    if missing or extra:
        raise ValueError(f"fields do not match the schema: missing {missing}, unexpected {extra}")
    return {f.name: f.encode(values[f.name]) for f in fields}


def flatten(v: Any, name: str, depth: int = 0) -> List[Any]:
    if not isinstance(v, (list, tuple)):
        return [v]
    if depth > 8:
        raise ValueError(f"field {name!r}: nested too deeply for an array")
    return [y for x in v for y in flatten(x, name, depth + 1)]


def numbers_fit(values) -> bool:
    """All numbers, finite, ints within int64 (one pass in C); False: ``data_problem`` says why."""
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
        if INT64[0] <= v <= INT64[1]:
            return ""
        bits = v.bit_length()
        return f"{v if bits <= 128 else f'a {bits}-bit integer'} does not fit in int64"
    if isinstance(v, float):
        return "" if math.isfinite(v) else f"{v} is not finite (NaN and inf are refused)"
    if isinstance(v, (list, tuple)):
        if v and type(v[0]) is list and set(map(type, v)) == {list}:
            if numbers_fit(chain.from_iterable(v)):  # lists of numbers (polygons)
                return ""
        elif v and not isinstance(v[0], (list, tuple, dict, str)) and numbers_fit(v):
            return ""
        return next((p for p in (data_problem(x, depth + 1) for x in v) if p), "")
    if isinstance(v, dict):
        found = (data_problem(x, depth + 1) if isinstance(k, str) else f"map key {k!r} is not a str"
                 for k, x in v.items())
        return next((p for p in found if p), "")
    return f"{type(v).__name__} is not plain data (lists, maps, str, numbers, bool, None)"


def infer_field(name: str, v: Any) -> Optional[Field]:
    """The field one example value asks for (lists of ints: int64, of floats: float32), or None."""
    for kind, cls in ((bool, BoolField), (int, IntField), (float, FloatField), (str, StrField)):
        if isinstance(v, kind):
            return cls(name)
    if hasattr(v, "dtype") and hasattr(v, "shape"):  # a tensor or numpy array
        dtype = str(v.dtype).replace("torch.", "")
        if len(v.shape) == 0:  # a 0-d tensor or numpy scalar: a scalar field
            return (BoolField if dtype == "bool" else FloatField if "float" in dtype
                    else IntField)(name)
        if dtype in DTYPES:
            return ArrayField(name, dtype, (-1, *v.shape[1:]))
    if isinstance(v, (list, tuple)) and v:
        flat = flatten(v, name)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
            dtype = "int64"
        elif all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat):
            dtype = "float32"
        else:
            return DataField(name)
        return ArrayField(name, dtype, (-1, *shape_of_value(v)[1:]))
    if isinstance(v, dict) or v is None:
        return DataField(name)
    return None


def shape_of_value(v: Any) -> Tuple[int, ...]:
    if isinstance(v, (list, tuple)):
        return (len(v),) + (shape_of_value(v[0]) if v else ())
    return ()
