"""Guarantees of docs/security.md that had no test of their own: a file holding more than its
size (``/proc``), a name swapped after the walk, annotation files that are FIFOs, a YOLO tree
with a link loop, a record's keys in the iterable dataset, masks for an image over 2^28
pixels, control characters in warnings and error lines. Each fails if its guard is removed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import msgpack
import pytest
from PIL import Image

import packer.writing.builder as builder
from helpers import packer_env, rewrite_first_record
from test_hostile_inputs import unblocking
from packer import PackedDataset, PackedIterableDataset, build, verify, write
from packer.demo import make_image_folder
from packer.errors import FormatError, PackerError
from packer.sources import Coco, FileList, Table, Yolo
from packer.sources.base import SymlinkLoopWarning

NOT_REGULAR = "a FIFO, not a regular file"
MORE_THAN_ITS_SIZE = "it holds more bytes than its size says"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("small") / "src", images=6, classes=2)


@pytest.fixture
def src(small, tmp_path) -> Path:
    out = tmp_path / "src"
    shutil.copytree(small, out)
    return out


# -- "A file is read up to the size fstat gave plus one byte" ------------------------------------

def test_a_file_holding_more_than_its_size_is_refused(src, tmp_path):
    """/proc files say size 0 and hold more: an image is skipped, a list file is an error."""
    os.symlink("/proc/self/status", src / "class_00" / "status.jpg")
    m = build(src, tmp_path / "d", workers=0, progress=False).manifest
    assert m["count"] == 6
    assert [(s["path"], s["reason"].split(" (")[0]) for s in m["skipped"]] == \
        [("class_00/status.jpg", MORE_THAN_ITS_SIZE)]
    with pytest.raises(PackerError, match=MORE_THAN_ITS_SIZE):
        FileList("/proc/self/status", root=src).read()


# -- "checked on the opened descriptor (fstat, so a name swapped after the walk cannot ...)" -----

def test_a_name_swapped_after_the_walk_is_checked_when_opened(src, tmp_path, monkeypatch):
    """The build lists and sizes a regular file; it becomes a FIFO before its worker reads it:
    the worker sees a FIFO (not the walk's regular file) and skips it, without waiting."""
    victim = src / "class_01" / sorted(os.listdir(src / "class_01"))[0]
    real_sizes = builder.file_sizes

    def sizes_then_swap(source):
        sizes = real_sizes(source)
        victim.unlink()
        os.mkfifo(victim)
        return sizes
    monkeypatch.setattr(builder, "file_sizes", sizes_then_swap)
    with unblocking(victim):
        m = build(src, tmp_path / "d", workers=0, progress=False).manifest
    assert m["count"] == 5
    assert [(s["path"], s["reason"].split(":")[0]) for s in m["skipped"]] == \
        [(f"class_01/{victim.name}", NOT_REGULAR)]


# -- "an annotation or list file ... is a PackerError" --------------------------------------------

@pytest.mark.parametrize("kind", ["coco", "meta", "yolo names"])
def test_annotation_files_that_are_fifos_are_refused_not_waited_on(src, tmp_path, kind):
    fifo = tmp_path / {"coco": "a.json", "meta": "m.jsonl", "yolo names": "names.txt"}[kind]
    os.mkfifo(fifo)
    (tmp_path / "labels").mkdir()
    source = {"coco": lambda: Coco(src, fifo),
              "meta": lambda: Table(src, fifo),
              "yolo names": lambda: Yolo(src, tmp_path / "labels", fifo)}[kind]()
    with unblocking(fifo), pytest.raises(PackerError, match=NOT_REGULAR):
        source.read()


# -- "Folder walks (ImageFolder, YOLO) ... within one YOLO tree" -----------------------------------

def test_a_link_loop_in_a_yolo_tree_is_walked_once(small, tmp_path):
    images, labels = tmp_path / "images", tmp_path / "labels"
    (images / "sub").mkdir(parents=True)
    labels.mkdir()
    shutil.copy(small / "class_00" / "img_00000.jpg", images / "sub" / "a.jpg")
    (labels / "sub").mkdir()
    (labels / "sub" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    os.symlink(images, images / "sub" / "back")   # a link to an ancestor: a loop
    os.symlink(labels, labels / "sub" / "back")
    (tmp_path / "names.txt").write_text("thing\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        entries = Yolo(images, labels, tmp_path / "names.txt").read().entries
    assert [p for p, _ in entries] == ["sub/a.jpg"]
    assert any(issubclass(w.category, SymlinkLoopWarning) for w in seen)


# -- "a record whose path is an int ... is a FormatError ... in the iterable dataset" -------------

@pytest.fixture
def ds(small, tmp_path) -> Path:
    dst = tmp_path / "ds"
    build(small, dst, workers=0, progress=False)
    return dst


@pytest.mark.parametrize("change, problem", [
    ({"path": 7}, "field 'path' is int, not str"),
    ({"image": "not bytes"}, "field 'image' is str, not bytes")])
def test_the_iterable_dataset_refuses_records_with_wrong_keys(ds, change, problem):
    rec = PackedDataset(ds).load(0)
    rec.update(change)
    rewrite_first_record(ds, msgpack.packb(rec, use_bin_type=True))
    with pytest.raises(FormatError, match=f"record is not a packer record: {problem}"):
        list(PackedIterableDataset(ds, shuffle_buffer=0))


# -- masks: "an image of at most 2^28 pixels (268,435,456)" ---------------------------------------

MASKS_CHILD = """
import resource, sys
from packer import PackedDataset
from packer.reading.masks import masks_of
masks_of([[[0.0, 0, 10, 0, 10, 10]]], 48, 64)  # imports and first allocations: not measured
PackedDataset(sys.argv[1])[0]                    # the record read without masks: fine
ds = PackedDataset(sys.argv[1], masks=True)
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    ds[0]
    print("read")
except Exception as e:
    print(type(e).__name__, e)
"""


def test_masks_for_a_record_claiming_over_2_28_pixels_are_refused(tmp_path):
    """A record whose width x height is 16,385 x 16,384 (2^28 + 16,384 pixels) and a small
    polygon: masks would be that many bytes. Refused before any allocation (the child may
    allocate 256 MB more), and reported by verify."""
    path = tmp_path / "a.png"
    Image.new("RGB", (64, 48), (10, 20, 30)).save(path)
    schema = [{"name": "image_id", "type": "int"},
              {"name": "boxes", "type": "array", "dtype": "float32", "shape": [-1, 4]},
              {"name": "labels", "type": "array", "dtype": "int64", "shape": [-1]},
              {"name": "segmentation", "type": "data"}]
    dst = tmp_path / "ds"
    write(dst, [{"image": path, "image_id": 1, "boxes": [[0.0, 0, 10, 10]], "labels": [1],
                 "segmentation": [[[0.0, 0, 10, 0, 10, 10]]]}], schema=schema, progress=False)
    rec = PackedDataset(dst).load(0)
    rec.update(width=16_385, height=16_384)
    rewrite_first_record(dst, msgpack.packb(rec, use_bin_type=True))
    out = subprocess.run([sys.executable, "-c", MASKS_CHILD, str(dst)], capture_output=True,
                         text=True, env=packer_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("FormatError") and \
        "image size 16385x16384 is not a size masks can be made for" in out.stdout, out.stdout
    assert any("image size 16385x16384 is not a size masks can be made for" in p
               for p in verify(dst, progress=False).problems)


# -- "warnings and error messages show them as \\xNN escapes" ---------------------------------------

def raw_controls(text: str):
    return sorted({hex(ord(ch)) for ch in text
                   if (ord(ch) < 0x20 and ch not in "\n\t") or 0x7F <= ord(ch) <= 0x9F})


def test_warnings_and_error_lines_carry_no_raw_control_characters(src, tmp_path):
    os.symlink(src / "class_00", src / "class_00" / "\x1b[31mloop\x9b2J")  # a warning naming it
    run = lambda *a: subprocess.run([sys.executable, "-m", "packer", *map(str, a)],  # noqa: E731
                                    capture_output=True, env=packer_env(), timeout=120)
    warned = run("build", src, tmp_path / "d", "-q", "-j", "0")
    assert warned.returncode == 0, warned.stderr
    err = warned.stderr.decode()
    assert err.startswith("Warning: skipping ") and "\\x1b[31mloop\\x9b2J" in err
    assert not raw_controls(err), err
    lst = tmp_path / "list.tsv"
    lst.write_text("class_00/\x1b]0;title\x07gone.jpg\t0\n")
    failed = run("build", src, tmp_path / "e", "-q", "--list", lst)
    err = failed.stderr.decode()
    assert failed.returncode == 1 and err.startswith("Error: ")
    assert "\\x1b]0;title\\x07gone.jpg" in err and not raw_controls(err), err
