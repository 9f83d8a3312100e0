"""packer/format.py: records, keys, checksums, versions, the manifest and atomic JSON writes."""
from __future__ import annotations

import hashlib
import json
import os
import random
import warnings
import zlib

import msgpack
import pytest

import packer
from packer.demo import load_photos, make_image, make_image_folder
from packer.errors import FormatError, PackerError
import msgspec
from packer.format.manifest import FORMAT_NAME, FORMAT_VERSION, HASH_CHUNK, MANIFEST, check_version, file_sha256, read_manifest
from packer.format.fields import IntField
from packer.format.records import PACK, RECORD_FIELDS, crc32, key, pack_record, record_problem, unpack_record
from packer._util.fsio import write_json_atomic
from packer.writing.shard import ShardWriter


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return make_image(random.Random(3), load_photos())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A real (small) dataset; read-only."""
    base = tmp_path_factory.mktemp("format")
    src = make_image_folder(base / "src", images=6, classes=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packer.build(src, base / "dst", progress=False, workers=0)
    return base / "dst"


def real_manifest(built) -> dict:
    return json.loads((built / MANIFEST).read_text("utf-8"))


# -- records -----------------------------------------------------------------------------------

def test_pack_unpack_round_trip(jpeg):
    data = pack_record(jpeg, fields={"label": 7}, path="class_01/café ü.jpg", width=500, height=375,
                       format="JPEG", mode="RGB")
    rec = unpack_record(data)
    assert set(rec) == set(RECORD_FIELDS) | {"label"}
    assert rec["image"] == jpeg and isinstance(rec["image"], bytes)
    assert rec["label"] == 7 and rec["path"] == "class_01/café ü.jpg"
    assert (rec["width"], rec["height"], rec["format"], rec["mode"]) == (500, 375, "JPEG", "RGB")
    assert rec["crc32"] == zlib.crc32(jpeg) & 0xFFFFFFFF
    # Plain msgpack, readable with no packer code: bin for the image, str for the path.
    raw = msgpack.unpackb(data, raw=True)
    assert raw[b"image"] == jpeg and raw[b"path"] == "class_01/café ü.jpg".encode()


def test_pack_record_stores_plain_ints(jpeg):
    class Int(int):  # e.g. a numpy or torch integer: must not reach msgpack as a custom type
        pass

    class Text(str):
        pass
    rec = unpack_record(pack_record(jpeg, fields={"label": Int(2), "n": [Text("t"), 1.5]},
                                    path="a", width=Int(3), height=Int(4), format="JPEG", mode="L"))
    assert (rec["label"], rec["width"], rec["height"], rec["n"]) == (2, 3, 4, ["t", 1.5])
    assert type(rec["label"]) is int
    with pytest.raises(TypeError, match="a object cannot be stored"):
        pack_record(jpeg, fields={"x": object()}, path="a", width=1, height=1, format="JPEG",
                    mode="L")


def test_unpack_record_refuses_non_records(jpeg):
    for obj in ([jpeg, 1], "image", 3, {"label": 1, "path": "a"}, None):
        with pytest.raises(FormatError, match="not a packer record"):
            unpack_record(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("change, problem", [
    (lambda r: r.pop("path"), "field 'path' is missing"),
    (lambda r: r.update(width="500"), "field 'width' is str, not int"),
    (lambda r: r.update(height=True), "field 'height' is bool, not int"),
    (lambda r: r.update(crc32=None), "field 'crc32' is NoneType, not int"),
])
def test_unpack_record_refuses_records_whose_own_keys_are_wrong(jpeg, change, problem):
    """A record with an image but a missing or mistyped key of its own (a bool is no int)."""
    rec = msgpack.unpackb(pack_record(jpeg, path="a.jpg", width=5, height=4, format="JPEG",
                                      mode="RGB"))
    change(rec)
    with pytest.raises(FormatError, match=f"not a packer record: {problem}"):
        unpack_record(msgpack.packb(rec, use_bin_type=True))


def test_record_problem_checks_the_schema_fields(jpeg):
    rec = unpack_record(pack_record(jpeg, fields={"label": "3"}, path="a", width=1, height=1,
                                    format="JPEG", mode="L"))
    assert record_problem(rec, (IntField("n"),)) == "field 'n' is missing"
    assert "'label'" in record_problem(rec, (IntField("label"),))
    assert record_problem(dict(rec, label=3), (IntField("label"),)) == ""


def test_unpack_record_refuses_non_string_map_keys():
    with pytest.raises(FormatError, match="not valid msgpack .*not allowed for map key"):
        unpack_record(msgpack.packb({1: b"x", "image": b"y"}))


def test_unpack_record_refuses_ext_types(jpeg):
    for value in (msgpack.ExtType(42, b"payload"), [1, {"nested": msgpack.ExtType(0, b"")}]):
        for rec in ({"image": value, "label": 0}, {"image": jpeg, "extra": value}):
            with pytest.raises(FormatError, match=r"msgpack extension type \(\d+\)"):
                unpack_record(msgpack.packb(rec, use_bin_type=True))


def test_keys_sort_like_their_numbers():
    assert key(0) == bytes(8) and key(1) == bytes(7) + b"\x01" and key(256) == bytes(6) + b"\x01\x00"
    numbers = [0, 1, 2, 255, 256, 257, 65535, 65536, 2**32 - 1, 2**32, 2**40 + 5, 2**64 - 1]
    shuffled = random.Random(0).sample(numbers, len(numbers))
    assert sorted(shuffled, key=key) == numbers
    assert all(len(key(n)) == 8 for n in numbers)
    with pytest.raises(Exception):
        key(-1)


def test_crc32(jpeg):
    assert crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value
    assert crc32(b"") == 0
    assert crc32(jpeg) == zlib.crc32(jpeg) & 0xFFFFFFFF
    assert 0 <= crc32(jpeg[:-1] + bytes([jpeg[-1] ^ 1])) != crc32(jpeg)


def test_file_sha256_reports_progress(tmp_path):
    data = os.urandom(HASH_CHUNK + 1000)
    f = tmp_path / "blob"
    f.write_bytes(data)
    seen = []
    assert file_sha256(f, progress=seen.append) == hashlib.sha256(data).hexdigest()
    assert seen == [HASH_CHUNK, 1000]
    assert file_sha256(f) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    seen.clear()
    assert file_sha256(tmp_path / "empty", progress=seen.append) == hashlib.sha256().hexdigest()
    assert seen == []


# -- versions ----------------------------------------------------------------------------------

def test_check_version(tmp_path):
    major, minor = (int(x) for x in FORMAT_VERSION.split("."))
    for ok in (FORMAT_VERSION, f"{major}.{minor + 1}", f"{major}.99", f"{major}", "0.9"):
        check_version(ok, tmp_path)  # no error
    with pytest.raises(FormatError, match=rf"packer format {major + 1}\.0, newer than this packer"):
        check_version(f"{major + 1}.0", tmp_path)
    for bad in ("?", "", "one.zero", None):
        with pytest.raises(FormatError, match="unreadable format_version"):
            check_version(bad, tmp_path)


# -- the manifest ------------------------------------------------------------------------------

def test_read_manifest_of_a_real_dataset(built):
    man = read_manifest(built)
    assert man == real_manifest(built)
    assert man["format"] == FORMAT_NAME and man["format_version"] == FORMAT_VERSION
    assert man["count"] == 6 and len(man["classes"]) == 2


def test_read_manifest_missing(tmp_path):
    with pytest.raises(FormatError, match="is not a packer dataset: .* not found"):
        read_manifest(tmp_path)
    with pytest.raises(FormatError, match="nowhere does not exist"):
        read_manifest(tmp_path / "nowhere")
    assert issubclass(FormatError, PackerError)


def test_read_manifest_unfinished_build_partial_shard(tmp_path, jpeg):
    w = ShardWriter(tmp_path / "shard-00000.lmdb", expected_bytes=1 << 20)
    w.append(pack_record(jpeg, fields={"label": 0}, path="a.jpg", width=1, height=1, format="JPEG", mode="RGB"))
    w.flush()  # a build that died here leaves a .partial shard and no manifest
    try:
        assert list(tmp_path.glob("*.partial"))
        with pytest.raises(FormatError, match="unfinished build .*re-run the same `packer build`"):
            read_manifest(tmp_path)
    finally:
        w.abort()
    with pytest.raises(FormatError, match="not a packer dataset"):
        read_manifest(tmp_path)


def test_read_manifest_unfinished_build_journal(tmp_path):
    (tmp_path / ".packer-build.json").write_text("{}")
    with pytest.raises(FormatError, match="unfinished build"):
        read_manifest(tmp_path)


def test_read_manifest_damaged(built, tmp_path):
    text = (built / MANIFEST).read_bytes()
    for damaged in (text[:len(text) // 2], b"\xff\xfe" + text, b""):
        (tmp_path / MANIFEST).write_bytes(damaged)
        with pytest.raises(FormatError, match="is damaged .*rebuild or re-stage"):
            read_manifest(tmp_path)


def test_read_manifest_not_a_packer_manifest(built, tmp_path):
    other = dict(real_manifest(built), format="webdataset")
    no_format = {k: v for k, v in real_manifest(built).items() if k != "format"}
    for obj in ([1, 2], "packer", other, no_format):
        (tmp_path / MANIFEST).write_text(json.dumps(obj))
        with pytest.raises(FormatError, match="is not a packer manifest"):
            read_manifest(tmp_path)


def test_read_manifest_versions(built, tmp_path):
    man = real_manifest(built)
    major = int(FORMAT_VERSION.split(".")[0])
    write_json_atomic(tmp_path / MANIFEST, dict(man, format_version=f"{major}.42"))
    assert read_manifest(tmp_path)["format_version"] == f"{major}.42"
    write_json_atomic(tmp_path / MANIFEST, dict(man, format_version=f"{major + 1}.0"))
    with pytest.raises(FormatError, match="newer than this packer understands"):
        read_manifest(tmp_path)
    write_json_atomic(tmp_path / MANIFEST, {k: v for k, v in man.items() if k != "format_version"})
    with pytest.raises(FormatError, match="unreadable format_version"):
        read_manifest(tmp_path)


# -- atomic JSON -------------------------------------------------------------------------------

def test_write_json_atomic(tmp_path):
    path = tmp_path / "m.json"
    obj = {"name": "café 日本", "n": [1, 2, 3], "nested": {"x": None}}
    write_json_atomic(path, obj)
    assert json.loads(path.read_text("utf-8")) == obj
    assert "café 日本" in path.read_text("utf-8")  # UTF-8, not \u escapes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]  # no .tmp left


def test_write_json_atomic_replaces_the_file_not_its_bytes(tmp_path):
    path = tmp_path / "m.json"
    write_json_atomic(path, {"v": "old" * 1000})
    with open(path, encoding="utf-8") as before:  # a reader that opened the old version
        inode = os.fstat(before.fileno()).st_ino
        write_json_atomic(path, {"v": "new"})
        assert json.load(before) == {"v": "old" * 1000}  # still whole: the file was renamed over
    assert os.stat(path).st_ino != inode
    assert json.loads(path.read_text("utf-8")) == {"v": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_write_json_atomic_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "m.json"
    write_json_atomic(path, {"v": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"v": object()})  # not JSON: fails half way through
    assert json.loads(path.read_text("utf-8")) == {"v": 1}


def test_first_mistakes_name_the_next_step(tmp_path, photo_src):
    with pytest.raises(FormatError, match=r"nope does not exist"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(FormatError, match="is a file, not a packer dataset folder"):
        read_manifest(tmp_path / "f")
    with pytest.raises(FormatError, match=r"is an image folder, not a packed dataset: pack it first "
                                          r"with `packer build .* DST`"):
        read_manifest(photo_src)


def test_values_pack_as_msgpack_packs_them_with_raw_items_spliced_in():
    """Records are packed with msgspec: byte for byte what ``msgpack.packb`` gives for plain
    data (ints, floats, str, bin and containers at every size boundary), with a
    ``msgspec.Raw`` item (a source's msgpack, COCO segmentations) spliced in as it is."""
    for n in (0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536):
        items = [[1.5, 2]] * n
        mixed = [msgspec.Raw(msgpack.packb(x)) if k % 2 else x for k, x in enumerate(items)]
        assert PACK(mixed) == msgpack.packb(items)
        for v in ("x" * n, b"x" * n, {f"k{i}": i for i in range(min(n, 300))}):
            assert PACK(v) == msgpack.packb(v, use_bin_type=True)
    rng = random.Random(5)
    ints = [0, 127, 128, 255, 256, 65535, 65536, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 64 - 1,
            -1, -32, -33, -128, -129, -32768, -32769, -2 ** 31, -2 ** 31 - 1, -2 ** 63]
    values = ints + [rng.uniform(-1e300, 1e300) for _ in range(100)] + [-0.0, 0.0, True, None]
    for v in values + [values, {"a": values}]:
        assert PACK(v) == msgpack.packb(v, use_bin_type=True), v
