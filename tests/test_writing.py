"""``packer.write`` / ``DatasetWriter``: samples from Python into a dataset, with the build's
checks (images, typed fields), crash safety (resume by input digest) and folder lock."""
from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import packer_env
from packer import Checks, PackedDataset
from packer.demo.images import load_photos, make_image
from packer.errors import FormatError, PackerError
from packer.format.manifest import read_manifest
from packer.info import verify
from packer.writing.journal import JOURNAL
from packer.reading.reader import ShardReader
from packer.writing.python import DatasetWriter, write

MiB = 1 << 20
N = 48  # ~2.8 MB of photo-like JPEGs: three shards at shard_size=1 MiB


def quiet_write(dst, samples, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 2)
    return write(dst, samples, **kw)


def records(root):
    r = ShardReader(root)
    try:
        return [r.record(i) for i in range(len(r))]
    finally:
        r.close()


def assert_not_finished(dst: Path) -> None:
    assert not (dst / "manifest.json").exists()
    with pytest.raises(FormatError):
        read_manifest(dst)


@pytest.fixture(scope="module")
def jpegs():
    """N realistic JPEGs (ImageNet-like sizes, quality 75-95), ~65 KB each."""
    rng = random.Random(7)
    photos = load_photos()
    return [make_image(rng, photos) for _ in range(N)]


@pytest.fixture(scope="module")
def pil_image(jpegs):
    """A photo crop as a PIL RGB image, not from a file."""
    im = Image.open(io.BytesIO(jpegs[5])).convert("RGB")
    return im.crop((10, 20, 170, 140))


# -- images ---------------------------------------------------------------------------------

def test_images_as_bytes_paths_and_pil(jpegs, pil_image, tmp_path):
    f = tmp_path / "photo.jpg"
    f.write_bytes(jpegs[1])
    gray = pil_image.convert("L")
    samples = [{"image": jpegs[0]}, {"image": f}, {"image": str(f), "path": "given/name.jpg"},
               {"image": pil_image}, {"image": gray}, {"image": bytearray(jpegs[2])}]
    m = quiet_write(tmp_path / "d", samples).manifest
    assert m["count"] == len(samples) and m["skipped"] == []
    assert m["schema"] == {"task": "generic", "fields": []}
    recs = records(tmp_path / "d")
    assert recs[0]["image"] == jpegs[0] and recs[0]["path"] == "00000000"
    assert recs[1]["image"] == jpegs[1] and recs[1]["path"] == str(f)
    assert recs[2]["image"] == jpegs[1] and recs[2]["path"] == "given/name.jpg"
    assert recs[5]["image"] == jpegs[2] and recs[5]["format"] == "JPEG"
    ds = PackedDataset(tmp_path / "d")
    for k, im in ((3, pil_image), (4, gray)):
        rec = recs[k]
        assert rec["format"] == "PNG" and rec["path"] == f"{k:08d}"
        assert (rec["width"], rec["height"]) == im.size and rec["mode"] == im.mode
        stored = Image.open(io.BytesIO(rec["image"]))
        assert stored.mode == im.mode and stored.tobytes() == im.tobytes()  # lossless
        sample, target = ds[k]
        assert sample.tobytes() == im.convert("RGB").tobytes() and target == {}
    assert verify(tmp_path / "d", progress=False).ok


@pytest.mark.parametrize("image, match", [
    (12345, "'image' must be bytes, a path or a PIL image"),
    ("/nonexistent/dir/x.jpg", "cannot read image"),
])
def test_an_image_packer_cannot_take(jpegs, tmp_path, image, match):
    with pytest.raises(PackerError, match=match):
        quiet_write(tmp_path / "d", [{"image": jpegs[0]}, {"image": image}])
    with pytest.raises(PackerError, match="must be a dict with an 'image'"):
        quiet_write(tmp_path / "e", [{"picture": jpegs[0]}])
    assert_not_finished(tmp_path / "d")


def test_bad_images_are_skipped_with_reasons(jpegs, tmp_path):
    truncated = jpegs[1][:len(jpegs[1]) // 2]
    web_page = b"<html>this is a web page, not a JPEG</html>\n" * 20
    samples = [{"image": jpegs[0], "k": 0}, {"image": truncated, "k": 1},
               {"image": web_page, "k": 2}, {"image": b"", "k": 3}, {"image": jpegs[2], "k": 4}]
    m = quiet_write(tmp_path / "d", samples).manifest
    assert m["count"] == 2
    assert [s["path"] for s in m["skipped"]] == ["00000001", "00000002", "00000003"]
    reasons = [s["reason"] for s in m["skipped"]]
    assert reasons[0].startswith("truncated") and reasons[1].startswith("not an image")
    assert reasons[2] == "empty file"
    ds = PackedDataset(tmp_path / "d")
    assert [ds[i][1]["k"] for i in range(len(ds))] == [0, 4]
    assert ds.column("k").tolist() == [0, 4]
    assert verify(tmp_path / "d", progress=False).ok
    with pytest.raises(PackerError, match="strict: 00000001: truncated"):
        quiet_write(tmp_path / "s", samples, checks=Checks(strict=True))
    assert_not_finished(tmp_path / "s")
    with pytest.raises(PackerError, match="all 2 images were skipped"):
        quiet_write(tmp_path / "e", [{"image": web_page}, {"image": truncated}])
    assert_not_finished(tmp_path / "e")


# -- fields: inferred or given schema, every value checked ------------------------------------

def typed_sample(image, k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"image": image, "n": k, "x": k + 0.5, "flag": k % 2 == 0, "caption": f"photo {k} é",
            "ids": list(range(k + 1)), "weights": [k / 4, 1.0], "step": torch.tensor(10 * k),
            "lr": torch.tensor(0.125 * k), "boxes": torch.rand(k % 3, 4, generator=g) * 100}


def test_inferred_schema(jpegs, tmp_path):
    samples = [typed_sample(jpegs[k], k) for k in range(5)]
    m = quiet_write(tmp_path / "d", samples).manifest
    assert m["schema"] == {"task": "generic", "fields": [
        {"name": "n", "type": "int"},
        {"name": "x", "type": "float"},
        {"name": "flag", "type": "bool"},
        {"name": "caption", "type": "str"},
        {"name": "ids", "type": "array", "dtype": "int64", "shape": [-1]},
        {"name": "weights", "type": "array", "dtype": "float32", "shape": [-1]},
        {"name": "step", "type": "int"},
        {"name": "lr", "type": "float"},
        {"name": "boxes", "type": "array", "dtype": "float32", "shape": [-1, 4]}]}
    assert set(m["columns"]) == {"width", "height", "n", "x", "flag", "step", "lr"}
    assert m["columns"]["n"]["dtype"] == "int64" and m["columns"]["flag"]["dtype"] == "uint8"
    ds = PackedDataset(tmp_path / "d")
    for k, s in enumerate(samples):
        _, t = ds[k]
        assert set(t) == set(s) - {"image"}
        assert t["n"] == k and type(t["n"]) is int
        assert t["x"] == k + 0.5 and t["flag"] is (k % 2 == 0) and t["caption"] == s["caption"]
        assert t["ids"].dtype == torch.int64 and t["ids"].tolist() == s["ids"]
        assert t["weights"].dtype == torch.float32 and t["weights"].tolist() == s["weights"]
        assert t["step"] == 10 * k and type(t["step"]) is int
        assert t["lr"] == 0.125 * k and type(t["lr"]) is float
        assert t["boxes"].shape == (k % 3, 4) and torch.equal(t["boxes"], s["boxes"])
    assert ds.column("x").tolist() == [k + 0.5 for k in range(5)]
    assert ds.column("flag").tolist() == [1, 0, 1, 0, 1]
    assert ds.column("step").tolist() == [10 * k for k in range(5)]
    assert verify(tmp_path / "d", progress=False).ok


def test_explicit_schema(jpegs, tmp_path):
    schema = [{"name": "emb", "type": "array", "dtype": "float64", "shape": [3]},
              {"name": "small", "type": "array", "dtype": "int16", "shape": [-1, 2]},
              {"name": "meta", "type": "data"},
              {"name": "score", "type": "float"}]
    samples = [{"image": jpegs[k], "emb": [k / 3, 1e-300, -2.0], "small": [[k, -k]] * k,
                "meta": {"source": "web", "tags": ["a", k], "ok": None}, "score": k}
               for k in range(3)]
    m = quiet_write(tmp_path / "d", samples, schema=schema).manifest
    assert m["schema"] == {"task": "generic", "fields": schema}
    ds = PackedDataset(tmp_path / "d")
    for k, s in enumerate(samples):
        _, t = ds[k]
        assert t["emb"].dtype == torch.float64 and t["emb"].tolist() == s["emb"]  # exact
        assert t["small"].dtype == torch.int16 and t["small"].shape == (k, 2)
        assert t["small"].tolist() == s["small"]
        assert t["meta"] == s["meta"]
        assert t["score"] == float(k) and type(t["score"]) is float  # an int in a float field
    with pytest.raises((PackerError, ValueError), match="'emb'"):  # 2 values for shape [3]
        quiet_write(tmp_path / "e", [dict(samples[0], emb=[1.0, 2.0])], schema=schema)
    with pytest.raises((PackerError, ValueError), match="missing \\['meta'\\]"):
        quiet_write(tmp_path / "e", [{k: v for k, v in samples[0].items() if k != "meta"}],
                    schema=schema)
    with pytest.raises(PackerError, match="'bad name'"):
        quiet_write(tmp_path / "e", samples, schema=[{"name": "bad name", "type": "int"}])
    with pytest.raises(PackerError, match="reserved"):
        quiet_write(tmp_path / "e", samples, schema=[{"name": "width", "type": "int"}])
    assert_not_finished(tmp_path / "e")


@pytest.mark.parametrize("name, value, match", [
    ("x", float("nan"), "not finite"),
    ("x", float("inf"), "not finite"),
    ("x", "1.5", "not a number"),
    ("n", 2.0, "not an int"),
    ("n", "3", "not an int"),
    ("n", 1 << 63, "int64"),
    ("flag", 1, "not a bool"),
    ("caption", 7, "not a str"),
    ("ids", [1, 2.5], "int64"),
    ("weights", [1.0, float("nan")], "NaN or inf"),
    ("boxes", torch.full((1, 4), float("inf")), "NaN or inf"),
    ("boxes", torch.zeros(2, 3), "rows of shape \\[4\\]"),
    ("extra", 1, "unexpected \\['extra'\\]"),
    ("x", 10 ** 400, "a 1329-bit integer does not fit a float"),
])
def test_a_bad_value_names_its_field(jpegs, tmp_path, name, value, match):
    good = typed_sample(jpegs[0], 1)
    bad = dict(typed_sample(jpegs[1], 2), **{name: value})
    with pytest.raises((PackerError, ValueError), match=match) as e:
        quiet_write(tmp_path / "d", [good, bad])
    assert f"'{name}'" in str(e.value) and "sample 1" in str(e.value)
    assert_not_finished(tmp_path / "d")


@pytest.mark.parametrize("value, match", [
    ({"a": [np.float32(1.0), 2.0]}, "can not serialize 'numpy.float32' object"),
    ({"a": [np.int64(1), np.int64(2)]}, "can not serialize 'numpy.int64' object"),
    ({"a": [1, 2 + 3j]}, "can not serialize 'complex' object"),
    ({"a": [np.bool_(True)]}, "can not serialize 'numpy.bool_?' object"),
])
def test_a_value_msgpack_cannot_store_is_refused_naming_its_field(jpegs, tmp_path, value,
                                                                   match):
    samples = [{"image": jpegs[0], "meta": {"a": [1.5]}}, {"image": jpegs[1], "meta": value}]
    with pytest.raises(PackerError, match=f"sample 1: field 'meta': {match}"):
        quiet_write(tmp_path / "d", samples)
    assert_not_finished(tmp_path / "d")


@pytest.mark.parametrize("kwargs, sample, match", [
    ({}, {"label": "cat"}, "field 'label' is a class index: an int .*not str"),
    ({}, {"label": True}, "field 'label' is a class index: an int .*not bool"),
    ({"schema": [{"name": "label", "type": "float"}]}, {"label": 1.0}, "not float"),
    ({"classes": ["a", "a"]}, {"label": 0}, "classes names 'a' twice"),
    ({"classes": [1, 2]}, {"label": 0}, "classes must be a list of strings"),
    ({}, {"path": "a\udcff"}, "sample 0: 'path' a\\\\xff is not valid Unicode"),
    ({}, {"boxes": [[0.0, 0, 1, 1], [0, 0, 2, 2]], "labels": [1], "image_id": 1},
     "sample 0: 2 boxes but 1 labels"),
    ({}, {"boxes": [[0.0, 0, 1, 1]], "labels": [1], "image_id": 1, "area": [1.0, 2.0]},
     "sample 0: 1 boxes but 2 area"),
    ({}, {"boxes": [[0.0, 0, 1, 1]], "labels": [1], "image_id": 1, "area": 1.0},
     "sample 0: area must hold one entry per box .*not a float"),
    ({}, {"boxes": [[0.0, 0, 1, 1]], "labels": [1], "image_id": 1, "segmentation": None},
     "sample 0: segmentation must hold one entry per box"),
])
def test_what_no_reader_could_read_is_refused_before_it_is_written(jpegs, tmp_path, kwargs,
                                                                    sample, match):
    # each of these once finished a dataset that every reader, and overwrite=True, refused
    with pytest.raises(PackerError, match=match):
        quiet_write(tmp_path / "d", [dict(sample, image=jpegs[0])], **kwargs)
    assert_not_finished(tmp_path / "d")


def test_many_classes_are_checked_for_repeats_in_linear_time():
    # each name was looked for among those before it: 100,000 classes took minutes
    code = ("from packer.errors import PackerError\n"
            "from packer.writing.python import check_classes\n"
            "names = [f'c{i}' for i in range(200_000)]\n"
            "assert check_classes(names) == names\n"
            "try:\n check_classes(names + ['c7'])\nexcept PackerError as e:\n print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=packer_env())
    assert "classes names 'c7' twice" in out.stdout, out.stderr[-2000:]
@pytest.mark.parametrize("mode", ["F", "CMYK"])
def test_a_pil_image_png_cannot_hold_is_a_clear_error(tmp_path, mode):
    with pytest.raises(PackerError, match=f"sample 0: a PIL image of mode {mode} cannot be "
                                          f"stored .*convert"):
        quiet_write(tmp_path / "d", [{"image": Image.new(mode, (16, 16))}])


def test_a_missing_field_is_named(jpegs, tmp_path):
    bad = typed_sample(jpegs[1], 2)
    del bad["caption"]
    with pytest.raises(PackerError, match="sample 1: .*missing \\['caption'\\]"):
        quiet_write(tmp_path / "d", [typed_sample(jpegs[0], 1), bad])
    assert_not_finished(tmp_path / "d")


def test_nan_in_the_first_sample_is_refused_too(jpegs, tmp_path):
    with pytest.raises(PackerError, match="sample 0: field 'x'.*not finite"):
        quiet_write(tmp_path / "d", [dict(typed_sample(jpegs[0], 1), x=float("nan"))])
    with pytest.raises(PackerError, match="'tags'.*empty list"):  # no type to infer
        quiet_write(tmp_path / "d", [{"image": jpegs[0], "tags": []}])
    assert_not_finished(tmp_path / "d")


def test_a_float_tensor_is_not_silently_truncated_into_an_int_field(jpegs, tmp_path):
    samples = [{"image": jpegs[0], "step": torch.tensor(3)},
               {"image": jpegs[1], "step": torch.tensor(2.7)}]
    with pytest.raises((PackerError, ValueError), match="'step'"):
        quiet_write(tmp_path / "d", samples)


def test_a_bool_tensor_scalar_is_a_bool_field(jpegs, tmp_path):
    samples = [{"image": jpegs[0], "keep": torch.tensor(True)},
               {"image": jpegs[1], "keep": torch.tensor(False)}]
    m = quiet_write(tmp_path / "d", samples).manifest
    assert m["schema"]["fields"] == [{"name": "keep", "type": "bool"}]
    assert PackedDataset(tmp_path / "d").column("keep").tolist() == [1, 0]


def test_a_tensor_of_several_values_in_a_scalar_field_names_the_field(jpegs, tmp_path):
    samples = [{"image": jpegs[0], "step": 3}, {"image": jpegs[1], "step": torch.tensor([2, 5])}]
    with pytest.raises((PackerError, ValueError), match="'step'"):
        quiet_write(tmp_path / "d", samples)


# -- tasks ----------------------------------------------------------------------------------

def test_classification_via_a_label_field(jpegs, tmp_path):
    labels = [0, 2, 1, 2, 0, 2]
    samples = [{"image": jpegs[k], "label": lab} for k, lab in enumerate(labels)]
    m = quiet_write(tmp_path / "d", samples).manifest
    ds = PackedDataset(tmp_path / "d")
    assert ds.task == "classification" and m["labels"]["path"] == "labels.i32"
    assert ds.classes == ["0", "1", "2"] and ds.class_to_idx == {"0": 0, "1": 1, "2": 2}
    assert ds.targets == labels and [ds[i][1] for i in range(len(ds))] == labels
    assert m["class_counts"] == [2, 1, 3]
    assert verify(tmp_path / "d", progress=False).ok
    names = ["cat", "dog", "eel", "fox"]
    m = quiet_write(tmp_path / "n", samples, classes=names).manifest
    ds = PackedDataset(tmp_path / "n")
    assert ds.classes == names and ds.targets == labels and m["class_counts"] == [2, 1, 3, 0]


@pytest.mark.parametrize("bad, classes", [(2, ["a", "b"]), (-1, None), (-1, ["a", "b"])])
def test_a_label_outside_the_classes_writes_nothing(jpegs, tmp_path, bad, classes):
    samples = [{"image": jpegs[0], "label": 1}, {"image": jpegs[1], "label": bad}]
    with pytest.raises(PackerError, match=f"label {bad} is outside"):
        quiet_write(tmp_path / "d", samples, classes=classes)
    assert_not_finished(tmp_path / "d")


def test_detection_via_write(jpegs, tmp_path):
    g = torch.Generator().manual_seed(3)
    samples = []
    for k in range(6):
        n = (k + 1) % 4  # one image without objects (not the first: its types are inferred)
        xy = torch.rand(n, 2, generator=g) * 200
        boxes = torch.cat([xy, xy + 10 + torch.rand(n, 2, generator=g) * 90], 1)
        samples.append({"image": jpegs[k], "boxes": boxes,
                        "labels": [2 * j + 1 for j in range(n)], "image_id": 5000 + 13 * k})
    m = quiet_write(tmp_path / "d", samples).manifest
    assert m["schema"]["task"] == "detection"
    ds = PackedDataset(tmp_path / "d", target_keys="all")  # area, iscrowd: zeros
    assert ds.task == "detection"
    for k, s in enumerate(samples):
        _, t = ds[k]
        n = len(s["labels"])
        assert set(t) == {"boxes", "labels", "image_id", "area", "iscrowd"}
        boxes = t["boxes"].as_subclass(torch.Tensor)
        assert boxes.dtype == torch.float32 and torch.equal(boxes, s["boxes"])
        assert t["labels"].dtype == torch.int64 and t["labels"].tolist() == s["labels"]
        assert t["image_id"] == s["image_id"]
        assert t["area"].shape == (n,) and t["iscrowd"].tolist() == [0] * n
    assert ds.column("image_id").tolist() == [s["image_id"] for s in samples]
    assert verify(tmp_path / "d", progress=False).ok
    with pytest.raises(PackerError, match="image_id"):  # detection needs all three
        quiet_write(tmp_path / "e", [{k: v for k, v in s.items() if k != "image_id"}
                                     for s in samples], task="detection")
    assert_not_finished(tmp_path / "e")


# -- crash, resume, overwrite, lock -----------------------------------------------------------

class Crash(Exception):
    pass


def samples_of(jpegs, offset=0):
    return [{"image": j, "idx": k + offset, "name": f"s{k}"} for k, j in enumerate(jpegs)]


def crashing(samples, after: int):
    for k, s in enumerate(samples):
        if k == after:
            raise Crash(f"the source failed at sample {k}")
        yield s


def crash_write(dst, samples, after=N - 2):
    """A write whose source fails in its third shard. One thread checks images, so at most
    4 samples are queued unstored when it fails: the first two shards (~40 samples) are done."""
    with pytest.raises(Crash):
        quiet_write(dst, crashing(samples, after), shard_size=MiB, workers=1)
    assert_not_finished(dst)
    assert (dst / JOURNAL).exists() and list(dst.glob("shard-*.lmdb"))


def test_crash_then_resume_gives_the_clean_dataset(jpegs, tmp_path):
    samples = samples_of(jpegs)
    clean = quiet_write(tmp_path / "clean", samples, shard_size=MiB).manifest
    assert len(clean["shards"]) >= 3
    dst = tmp_path / "d"
    crash_write(dst, samples)
    finished = sorted(p.name for p in dst.glob("shard-*.lmdb"))
    r = quiet_write(dst, samples, shard_size=MiB)
    assert r.resumed_shards == len(finished) >= 2
    assert records(dst) == records(tmp_path / "clean")  # same records, in order
    assert [s["sha256"] for s in r.manifest["shards"]] == [s["sha256"] for s in clean["shards"]]
    assert r.manifest["columns"] == clean["columns"]
    assert not (dst / JOURNAL).exists()
    assert verify(dst, progress=False).ok


@pytest.mark.parametrize("change", ["values", "images"])
def test_resume_with_other_samples_is_refused(jpegs, tmp_path, change):
    dst = tmp_path / "d"
    samples = samples_of(jpegs)
    crash_write(dst, samples)
    shards = sorted(p.name for p in dst.glob("shard-*.lmdb"))
    other = samples_of(jpegs, offset=100) if change == "values" else samples_of(jpegs[::-1])
    with pytest.raises(PackerError, match="overwrite=True"):
        quiet_write(dst, other, shard_size=MiB)
    assert_not_finished(dst)
    assert sorted(p.name for p in dst.glob("shard-*.lmdb")) == shards  # nothing lost either
    r = quiet_write(dst, samples, shard_size=MiB)  # the same samples still resume
    assert r.resumed_shards == len(shards)
    assert [rec["idx"] for rec in records(dst)] == list(range(N))


def test_overwrite_restarts_an_interrupted_write(jpegs, tmp_path):
    dst = tmp_path / "d"
    crash_write(dst, samples_of(jpegs))
    other = samples_of(jpegs, offset=100)
    r = quiet_write(dst, other, shard_size=MiB, overwrite=True)
    assert r.resumed_shards == 0
    assert [rec["idx"] for rec in records(dst)] == [100 + k for k in range(N)]
    assert verify(dst, progress=False).ok


def test_a_finished_dataset_needs_overwrite(jpegs, tmp_path):
    dst = tmp_path / "d"
    first = quiet_write(dst, samples_of(jpegs[:4])).manifest
    with pytest.raises(PackerError, match="already holds a finished dataset.*overwrite=True"):
        quiet_write(dst, samples_of(jpegs[:4], offset=10))
    with pytest.raises(PackerError, match="already holds a finished dataset.*overwrite=True"):
        quiet_write(dst, samples_of(jpegs[:3]))  # the same write's options, fewer samples
    assert quiet_write(dst, samples_of(jpegs[:4])).manifest == first  # the same write: done
    assert read_manifest(dst)["build_id"] == first["build_id"]  # untouched
    assert [r["idx"] for r in records(dst)] == [0, 1, 2, 3]
    second = quiet_write(dst, samples_of(jpegs[:3], offset=10), overwrite=True).manifest
    assert second["build_id"] != first["build_id"]
    assert [r["idx"] for r in records(dst)] == [10, 11, 12]
    assert verify(dst, progress=False).ok


LOCKED_CHILD = """
import sys
from packer.errors import PackerError
from packer.writing.python import DatasetWriter
try:
    DatasetWriter(sys.argv[1])
except PackerError as e:
    print(e)
    sys.exit(3)
"""


def test_a_second_writer_is_refused_while_one_is_open(jpegs, tmp_path):
    dst = tmp_path / "d"
    w = DatasetWriter(dst, workers=1)
    try:
        w.add({"image": jpegs[0], "idx": 0})
        with pytest.raises(PackerError, match="being written by another packer process"):
            DatasetWriter(dst)
        with pytest.raises(PackerError, match="being written by another packer process"):
            quiet_write(dst, samples_of(jpegs[:2]))
        proc = subprocess.run([sys.executable, "-c", LOCKED_CHILD, str(dst)], env=packer_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3, proc.stderr
        assert "being written by another packer process" in proc.stdout
    finally:
        w.close()
    assert_not_finished(dst)
    m = quiet_write(dst, samples_of(jpegs[:2])).manifest  # free again once closed
    assert m["count"] == 2


def test_dataset_writer_by_hand(jpegs, tmp_path):
    with DatasetWriter(tmp_path / "d", workers=1, task="generic") as w:
        for s in samples_of(jpegs[:3]):
            w.add(s)
        m = w.finish()
    assert m["count"] == 3 and m["source"] == "packer.write"
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["build_id"] == m["build_id"]
    col = PackedDataset(tmp_path / "d").column("idx")
    assert isinstance(col, array) and col.tolist() == [0, 1, 2]
    empty = DatasetWriter(tmp_path / "e")
    with pytest.raises(PackerError, match="no samples"):
        empty.finish()
    empty.close()
    assert_not_finished(tmp_path / "e")
    with pytest.raises(PackerError, match="task must be one of"):
        DatasetWriter(tmp_path / "e", task="segmentation")


def test_a_with_block_that_ends_without_finish_finishes_and_unlocks(jpegs, tmp_path):
    """``DatasetWriter``'s contract: "as a context manager: finished on success". A body that
    only added used to leave an unfinished folder, still locked by this process (a second
    writer was refused naming our own pid); now it is finished, and the folder free."""
    dst = tmp_path / "d"
    with DatasetWriter(dst, workers=1, task="generic") as w:
        for s in samples_of(jpegs[:3]):
            w.add(s)
    assert read_manifest(dst)["count"] == 3 and not (dst / ".packer-lock").exists()
    with pytest.raises(PackerError, match="no samples"):
        with DatasetWriter(tmp_path / "e", workers=1):
            pass
    assert not (tmp_path / "e" / ".packer-lock").exists()  # finish() raised: unlocked all the same
    assert quiet_write(dst, samples_of(jpegs[:2]), overwrite=True).manifest["count"] == 2
