"""Typed fields (packer.format.fields), the schema in the manifest (packer.format.validation), masks from COCO
segmentations (packer.reading.masks), and records that do not match their schema."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from array import array

import msgpack
import pytest
import torch

from packer import PackedDataset, build, verify, write
from packer.errors import FormatError, PackerError
from packer.format.fields import ArrayField, DataField, IntField, StrField, check_schema, data_problem, detection_problem, encode, field_of, field_problem, infer_field
from packer.format.manifest import read_manifest
from packer.reading.masks import decode_counts, masks_of

BOXES = ArrayField("boxes", "float32", (-1, 4))


# -- encode / decode ---------------------------------------------------------------------------

def test_arrays_round_trip_through_bytes():
    raw = encode([BOXES], {"boxes": [[1, 2, 3, 4], [5, 6, 7, 8.5]]})["boxes"]
    assert isinstance(raw, bytes) and len(raw) == 2 * 4 * 4
    assert BOXES.shape_of(len(raw)) == (2, 4)
    assert list(BOXES.values(raw)) == [1, 2, 3, 4, 5, 6, 7, 8.5]
    t = torch.tensor([[0.5, 1, 2, 3]], dtype=torch.float32)
    assert encode([BOXES], {"boxes": t})["boxes"] == array("f", [0.5, 1, 2, 3]).tobytes()
    assert encode([BOXES], {"boxes": []})["boxes"] == b""  # no objects


@pytest.mark.parametrize("value, message", [
    ([[1, 2, 3]], "no whole number"),          # 3 values: no whole row of 4
    ([[1, 2, 3, float("nan")]], "NaN or inf"),
    ([["a", 2, 3, 4]], "do not fit float32"),
])
def test_bad_arrays_name_the_field(value, message):
    with pytest.raises(ValueError, match=f"'boxes'.*{message}|{message}"):
        encode([BOXES], {"boxes": value})


@pytest.mark.parametrize("kind, value, ok", [
    ("int", 3, 3), ("int", torch.tensor(4), 4), ("int", 2.7, None), ("int", torch.tensor(2.7), None),
    ("int", True, None), ("int", 1 << 64, None), ("int", torch.tensor([1, 2]), None),
    ("float", 2, 2.0), ("float", torch.tensor(0.5), 0.5), ("float", float("inf"), None),
    ("float", "1.0", None), ("bool", True, True), ("bool", torch.tensor(False), False),
    ("bool", 1, None), ("str", "café", "café"), ("str", b"x", None), ("str", "\ud800", None),
])
def test_scalars_are_checked_not_coerced(kind, value, ok):
    f = field_of({"name": "x", "type": kind})
    if ok is None:
        with pytest.raises(ValueError, match="'x'"):
            encode([f], {"x": value})
    else:
        out = encode([f], {"x": value})["x"]
        assert out == ok and type(out) is type(ok)


def test_fields_must_match_the_schema_exactly():
    with pytest.raises(ValueError, match=r"missing \['b'\], unexpected \['c'\]"):
        encode([IntField("a"), StrField("b")], {"a": 1, "c": 2})


def test_data_fields_are_plain_data_only():
    assert data_problem({"counts": [1, 2], "size": [3, 4]}) == ""
    assert "not plain data" in data_problem({"x": object()})
    assert "not valid Unicode" in data_problem({"note": "\ud800"})  # JSON may hold lone surrogates
    assert "not a str" in data_problem({1: 2})
    assert "NaN" in data_problem([float("nan")])
    assert data_problem([[1, 2.5], [3, 4]]) == ""  # polygons
    for v in ([10 ** 400], [[1, 2], [10 ** 400]], [[1.0], [-2 ** 63 - 1]]):  # not a crash
        assert "does not fit in int64" in data_problem(v)
        assert len(data_problem(v)) < 80
    assert "NaN" in data_problem([[1, 2], [3, float("inf")]])
    assert "not plain data" in data_problem([[1, 2], [3, object()]])
    assert "not plain data" in data_problem([[1, 2], [3, [object()]]])
    deep: list = []
    for _ in range(40):
        deep = [deep]
    assert "deeper" in data_problem(deep)


def test_inference():
    def spec(v):
        return infer_field("a", v).spec()
    assert spec(3) == {"name": "a", "type": "int"}
    assert spec(0.5) == {"name": "a", "type": "float"}
    assert spec(True) == {"name": "a", "type": "bool"}
    assert spec("x") == {"name": "a", "type": "str"}
    assert spec([1, 2]) == {"name": "a", "type": "array", "dtype": "int64", "shape": [-1]}
    assert spec([[1.0, 2, 3, 4]])["shape"] == [-1, 4]
    assert spec(torch.zeros(3, 4, dtype=torch.int32))["dtype"] == "int32"
    assert spec(torch.zeros(3, 4))["shape"] == [-1, 4]
    assert spec(torch.tensor(True)) == {"name": "a", "type": "bool"}
    assert spec({"k": 1}) == {"name": "a", "type": "data"}
    assert infer_field("a", []) is None  # cannot tell: a schema is needed


@pytest.mark.parametrize("spec", [
    {"name": "n", "type": "int"}, {"name": "x", "type": "float"}, {"name": "b", "type": "bool"},
    {"name": "s", "type": "str"}, {"name": "d", "type": "data"},
    {"name": "boxes", "type": "array", "dtype": "float32", "shape": [-1, 4]},
    {"name": "m", "type": "array", "dtype": "uint8", "shape": [2, 3, 4]}])
def test_each_field_is_built_from_its_schema_entry_and_writes_it_back(spec):
    """The manifest's schema JSON stays what it was: a field class writes its entry back
    exactly, and the side table it gets is the one older datasets have."""
    f = field_of(spec)
    assert f.spec() == spec and check_schema([spec], "here") == [f]
    assert f.column == {"int": "int64", "float": "float64", "bool": "uint8"}.get(spec["type"])


@pytest.mark.parametrize("f, problem", [
    ({"name": "image", "type": "int"}, "reserved"),
    ({"name": "a b", "type": "int"}, "must match"),
    ({"name": "a", "type": "pickle"}, "must be one of"),
    ({"name": "a", "type": "array", "dtype": "object", "shape": [-1]}, "dtype"),
    ({"name": "a", "type": "array", "dtype": "int64", "shape": [4, -1]}, "shape"),
    ({"name": "a", "type": "array", "dtype": "int64", "shape": []}, "shape"),
    ({"name": "a", "type": ["int"]}, "must be one of"),  # unhashable: a TypeError before
    ({"name": "a", "type": {"x": 1}}, "must be one of"),
    ({"name": "a", "type": "array", "dtype": ["int64"], "shape": [-1]}, "dtype"),
    ({"name": "a", "type": "array", "dtype": "int64", "shape": [-1] + [1] * 8}, "1-8 sizes"),
])
def test_schema_entries_are_checked(f, problem):
    assert problem in field_problem(f)
    with pytest.raises(FormatError):
        check_schema([f], "here")


def test_a_schema_naming_a_field_twice_is_refused():
    with pytest.raises(FormatError, match="names field 'a' twice"):
        check_schema([{"name": "a", "type": "int"}, {"name": "a", "type": "str"}], "here")


def test_stored_arrays_that_fit_no_shape_are_named_not_crashed_on():
    """A stranger's schema may give a row of no size ([-1, 0]: no count of rows is known from
    the bytes, a ZeroDivisionError unchecked) or a fixed shape the bytes do not fill (read
    anyway, the values would be cut into the wrong shape)."""
    empty_rows = field_of({"name": "a", "type": "array", "dtype": "int64", "shape": [-1, 0]})
    assert "has no size" in empty_rows.check(b"")
    fixed = field_of({"name": "m", "type": "array", "dtype": "uint8", "shape": [2, 3, 4]})
    assert fixed.check(bytes(24)) == ""
    assert "23 values do not make shape [2, 3, 4]" in fixed.check(bytes(23))
    with pytest.raises(ValueError, match="do not make shape"):
        encode([fixed], {"m": [0] * 25})


def test_an_array_value_nested_too_deeply_is_a_value_error():
    """Flattened without a bound, 2000 nested lists would be a RecursionError."""
    deep: list = [1]
    for _ in range(2000):
        deep = [deep]
    with pytest.raises(ValueError, match="'a': nested too deeply"):
        encode([ArrayField("a", "int64", (-1,))], {"a": deep})


def test_detection_schema_needs_boxes_labels_image_id():
    assert detection_problem([BOXES]).startswith("needs a 'labels'")
    ok = [BOXES, ArrayField("labels", "int64", (-1,)), IntField("image_id")]
    assert detection_problem(ok) == ""
    assert "image_id" in detection_problem(ok[:2] + [StrField("image_id")])


def test_check_finds_damaged_values():
    assert BOXES.check(b"\0" * 15) != "" and BOXES.check([1.0]) != ""
    assert IntField("n").check(True) != "" and IntField("n").check(5) == ""
    assert DataField("d").check({"a": [1]}) == "" and "NaN" in DataField("d").check([math.nan])


# -- masks --------------------------------------------------------------------------------------

def test_compressed_rle_decodes_like_the_counts_it_encodes():
    # pycocotools' string for counts [3, 2, 5, 1, 9] (a 4x5 mask, column-major), by its rules:
    # each count after the second is stored as a difference from the one two before.
    def encode_counts(counts):
        out = []
        for i, x in enumerate(counts):
            if i > 2:
                x -= counts[i - 2]
            more = True
            while more:
                c = x & 0x1F
                x >>= 5
                more = not (x == 0 and not c & 0x10 or x == -1 and c & 0x10)
                if more:
                    c |= 0x20
                out.append(chr(c + 48))
        return "".join(out)
    counts = [3, 2, 5, 1, 9]
    assert decode_counts(encode_counts(counts)) == counts
    m = masks_of([{"counts": encode_counts(counts), "size": [4, 5]}], 4, 5)[0]
    flat = m.t().reshape(-1).tolist()  # back to column-major
    assert flat == [0] * 3 + [1] * 2 + [0] * 5 + [1] * 1 + [0] * 9


def test_polygon_masks_cover_their_polygon():
    m = masks_of([[[10, 10, 30, 10, 30, 20, 10, 20]], {"counts": [0, 4], "size": [40, 50]}], 40, 50)
    assert m.shape == (2, 40, 50) and m.dtype == torch.uint8
    assert int(m[0].sum()) == 20 * 10  # COCO's pixel-centre rule: 20 x 10 pixels
    assert m[0, 15, 20] == 1 and m[0, 5, 5] == 0
    assert int(m[1].sum()) == 4 and m[1, :4, 0].tolist() == [1, 1, 1, 1]  # column-major


@pytest.mark.parametrize("seg, h, w, problem", [
    ([{"counts": [1, 2], "size": [100000, 100000]}], 40, 50, "RLE of size"),
    ([{"counts": [1, 2], "size": [-1, -1]}], 40, 50, "RLE of size"),
    ([{"counts": "a", "size": [40, 50]}], 40, 50, "does not decode"),
    ([{"counts": [5000], "size": [40, 50]}], 40, 50, "within the image"),
    ([{"counts": [1500, 1500], "size": [40, 50]}], 40, 50, "within the image"),  # sum > h x w
    ([{"counts": [2.5, 3], "size": [40, 50]}], 40, 50, "within the image"),  # not cut to ints
    ([{"counts": [1 << 70], "size": [40, 50]}], 40, 50, "within the image"),  # no int64
    ([[["x"]]], 40, 50, "polygon"),
    ([], 10 ** 6, 10 ** 6, "image size"),
    ([], -5, 10, "image size"),
])
def test_hostile_segmentations_are_refused_before_allocating(seg, h, w, problem):
    with pytest.raises(ValueError, match=problem):
        masks_of(seg, h, w)


def test_a_compressed_rle_count_longer_than_60_bits_is_refused():
    """12 characters of 5 bits hold any count; a 13th would be shifted past 64 bits."""
    assert decode_counts("P" * 11 + "1") == [1 << 55]
    with pytest.raises(ValueError, match="count out of range"):
        decode_counts("P" * 12 + "1")


# -- records that do not match their schema ----------------------------------------------------

def test_a_record_not_matching_its_schema_is_a_format_error(tmp_path, photo_src):
    jpeg = next(photo_src.rglob("*.jpg")).read_bytes()
    dst = tmp_path / "d"
    write(dst, [{"image": jpeg, "boxes": [[1.0, 2, 3, 4]], "labels": [1], "image_id": 7}],
          progress=False)
    man = read_manifest(dst)
    assert man["schema"]["task"] == "detection"
    # The schema now says labels are int32: the one stored int64 label reads as two.
    labels = next(f for f in man["schema"]["fields"] if f["name"] == "labels")
    labels["dtype"] = "int32"
    (dst / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(FormatError, match="does not match its dataset's schema"):
        PackedDataset(dst)[0]
    rep = verify(dst, progress=False)
    assert not rep.ok and any("1 boxes but 2 labels" in p for p in rep.problems), rep.problems


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["schema"].update(task="detection", fields=[]), "says detection but needs"),
    (lambda m: m["columns"].pop("width") and m["columns"].update(zzz=dict(m["columns"]["height"])),
     "names no field"),
    (lambda m: m["columns"]["height"].update(dtype="object"), "dtype"),
    (lambda m: m["columns"]["height"].update(path="../x"), "plain file name"),
    (lambda m: m["schema"]["fields"].append({"name": "n", "type": "int"}), "a table for each scalar"),
])
def test_manifest_schema_and_columns_are_validated(tmp_path, photo_src, edit, message):
    dst = tmp_path / "d"
    build(photo_src, dst, progress=False, workers=0)
    man = json.loads((dst / "manifest.json").read_text())
    edit(man)
    (dst / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(FormatError, match=message):
        read_manifest(dst)


def test_writer_refuses_nan_and_names_sample(tmp_path, photo_src):
    jpeg = next(photo_src.rglob("*.jpg")).read_bytes()
    with pytest.raises(PackerError, match=r"sample 1: field 'score'.*not finite"):
        write(tmp_path / "d", [{"image": jpeg, "score": 1.0}, {"image": jpeg, "score": math.nan}],
              progress=False)
    assert not (tmp_path / "d" / "manifest.json").exists()
    assert msgpack  # plain msgpack is all a record is (see test_format)


@pytest.mark.parametrize("key, value", [("dropped", [{"path": 1, "reason": "x"}]),
                                        ("dropped_count", "\x1b[31m"),
                                        ("categories", [{"id": "1", "name": "a"}])])
def test_annotation_keys_of_the_manifest_are_validated(tmp_path, photo_src, key, value):
    dst = tmp_path / "d"
    build(photo_src, dst, progress=False, workers=0)
    man = json.loads((dst / "manifest.json").read_text())
    man[key] = value
    (dst / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(FormatError, match=key):
        read_manifest(dst)


ARRAY_MEMORY = """
import resource, sys
import torch
from packer.format.fields import ArrayField
from packer.reading.targets import array_tensor
for dtype in ("float32", "int64", "uint16"):  # imports and first allocations: not measured
    array_tensor(ArrayField("x", dtype, (-1, 4)), bytes(64))
raw = bytes(range(256)) * (32 << 12)  # a 32 MiB stored field
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (128 << 20), hard))
t = array_tensor(ArrayField("x", "float32", (-1, 4)), raw)
print(tuple(t.shape), t.dtype)
"""


@pytest.mark.parametrize("dtype", ["uint8", "int16", "uint16", "int32", "uint32", "int64",
                                   "float32", "float64"])
def test_array_fields_read_back_as_stored(dtype):
    from packer.reading.targets import array_tensor
    code = {"uint8": "B", "int16": "h", "uint16": "H", "int32": "i", "uint32": "I",
            "int64": "q", "float32": "f", "float64": "d"}[dtype]
    top = {"B": 255, "h": 32767, "H": 65535, "i": 2 ** 31 - 1, "I": 2 ** 32 - 1}.get(code, 7)
    values = [0, 1, top, 3, 4, 5] if code in "BHI" else [0, -1, top, 3, -4, 5]
    f = ArrayField("x", dtype, (-1, 2))
    t = array_tensor(f, f.encode(array(code, values)))
    assert t.shape == (3, 2) and t.flatten().tolist() == values
    assert array_tensor(f, b"").shape == (0, 2)


def test_a_large_array_field_costs_its_size_not_ten_times_it():
    # torch.tensor over the values took ~11x the field (843 MB for 76 MB) and seconds
    r = subprocess.run([sys.executable, "-c", ARRAY_MEMORY], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["(2097152,", "4)", "torch.float32"], \
        r.stderr[-2000:]
