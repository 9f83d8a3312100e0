"""Inputs that never end, numbers that drive allocations, links that multiply, records that
lie (issue 29, items 2, 3, 5, 6, 11, 13, 14): each is refused or reported with a clear
message, its limit set by the user, never by the data. Real FIFOs, devices, links to
/dev/zero, symlink trees and crafted records; packer in a real subprocess where a bug would
hang or exhaust memory (then under a timeout and an address-space limit)."""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import warnings
from array import array
from pathlib import Path

import msgpack
import pytest
from click.testing import CliRunner
from PIL import Image

import packer
from helpers import bomb_png, edit_manifest, packer_env, retable, rewrite_first_record
from packer import Checks, PackedDataset, build, verify, write
from packer.cli import Size, main
from packer.demo import make_image_folder
from packer.errors import FormatError, PackerError
from packer.sources import FileList, ImageFolder, Table, Yolo
from packer.sources.base import SymlinkLoopWarning


def cli(*args):
    """``packer ARGS`` through CliRunner: (exit code, output); a traceback fails the test."""
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), \
        f"an uncaught {res.exception!r}:\n{res.output}"
    assert "Traceback" not in res.output
    return res.exit_code, res.output


def quiet(src, dst, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 0)
    return build(src, dst, **kw)


def char_device(path: Path) -> None:
    """A character device named ``path``: /dev/null's own (as root), else a link to it."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        os.symlink("/dev/null", path)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("small") / "src", images=6, classes=2)


@pytest.fixture(scope="module")
def built(small, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("built") / "ds"
    quiet(small, dst)
    return dst


@pytest.fixture
def ds(built, tmp_path) -> Path:
    out = tmp_path / "ds"
    shutil.copytree(built, out)
    return out


# -- 3: only regular files, with a size bound --------------------------------------------------

# packer's CLI with at most 1 GiB more address space than after its imports: reading
# /dev/zero would fail at once instead of taking the machine's memory.
LIMITED = ("import resource, runpy\n"
           "import packer.cli, packer.writing.builder, packer.writing.worker, PIL.Image\n"
           "vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) << 10\n"
           "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))\n"
           "runpy.run_module('packer', run_name='__main__')\n")


def test_fifos_devices_and_links_to_dev_zero_are_skipped_by_the_workers(small, tmp_path):
    """A FIFO nobody writes, a link to /dev/zero and a character device, all named *.jpg,
    among real images: the build's worker processes skip each at once, saying what it is."""
    src = tmp_path / "src"
    shutil.copytree(small, src)
    os.mkfifo(src / "class_00" / "fifo.jpg")
    os.symlink("/dev/zero", src / "class_00" / "zero.jpg")
    char_device(src / "class_01" / "null.jpg")
    proc = subprocess.run([sys.executable, "-c", LIMITED, "build", str(src), str(tmp_path / "d"),
                           "--json", "-j", "2", "--shard-size", "1M"],
                          capture_output=True, text=True, env=packer_env(), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    reasons = {s["path"]: s["reason"] for s in out["skipped"]}
    assert out["count"] == 6
    assert reasons == {"class_00/fifo.jpg": "a FIFO, not a regular file: only regular files are read",
                       "class_00/zero.jpg": "a character device, not a regular file: only "
                                            "regular files are read",
                       "class_01/null.jpg": "a character device, not a regular file: only "
                                            "regular files are read"}


def big_jpeg(path: Path) -> int:
    Image.frombytes("RGB", (512, 512), os.urandom(512 * 512 * 3)).save(path, quality=95)
    return path.stat().st_size


def test_image_files_over_max_image_bytes_are_skipped(small, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(small, src)
    size = big_jpeg(src / "class_01" / "big.jpg")
    limit = 256 << 10
    assert size > limit > max(p.stat().st_size for p in small.glob("*/*.jpg"))
    m = quiet(src, tmp_path / "d", workers=2, checks=Checks(max_image_bytes=limit)).manifest
    assert m["count"] == 6 and m["options"]["max_image_bytes"] == limit
    assert m["skipped"] == [{"path": "class_01/big.jpg",
                             "reason": f"{size:,} bytes, more than max_image_bytes (262,144)"}]
    code, out = cli("build", src, tmp_path / "c", "--json", "-j", "0", "--max-image-bytes", "256K")
    assert code == 0 and [s["path"] for s in json.loads(out)["skipped"]] == ["class_01/big.jpg"]
    code, out = cli("build", src, tmp_path / "e", "-q", "--max-image-bytes", "0")
    assert code == 1 and "Error: --max-image-bytes must be a positive byte count, got 0" in out


def test_write_takes_only_regular_files_within_the_bound(small, tmp_path):
    dev = tmp_path / "x.jpg"
    char_device(dev)
    with pytest.raises(PackerError, match=r"sample 0: cannot read image .*x\.jpg: a character "
                                          r"device, not a regular file"):
        write(tmp_path / "w", [{"image": dev, "label": 0}], progress=False, workers=1)
    big = tmp_path / "big.jpg"
    size = big_jpeg(big)
    with pytest.raises(PackerError, match=f"{size:,} bytes, more than max_image_bytes"):
        write(tmp_path / "w2", [{"image": big, "label": 0}], progress=False, workers=1,
              checks=Checks(max_image_bytes=1000))


@contextlib.contextmanager
def unblocking(fifo: Path, after: float = 10):
    """A reader blocked on ``fifo`` (the bug) gets an end of file after ``after`` seconds, so
    the test fails instead of hanging."""
    def let_go():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # nobody reading: nothing to end
            pass
    timer = threading.Timer(after, let_go)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def test_a_fifo_as_the_list_file_is_refused_not_waited_on(small, tmp_path):
    fifo = tmp_path / "list.tsv"
    os.mkfifo(fifo)
    with unblocking(fifo), pytest.raises(PackerError, match="a FIFO, not a regular file"):
        FileList(fifo, root=small).read()
    with unblocking(fifo):
        code, out = cli("build", small, tmp_path / "d", "-q", "--list", fifo)
    assert code == 1 and out.startswith("Error: ") and "a FIFO, not a regular file" in out


def test_a_fifo_as_a_yolo_label_file_leaves_its_image_out(small, tmp_path):
    images, labels, names = tmp_path / "images", tmp_path / "labels", tmp_path / "names.txt"
    images.mkdir()
    labels.mkdir()
    for name in ("a.jpg", "b.jpg"):
        shutil.copy(small / "class_00" / "img_00000.jpg", images / name)
    (labels / "b.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    os.mkfifo(labels / "a.txt")
    names.write_text("thing\n")
    with unblocking(labels / "a.txt"):
        rows = Yolo(images, labels, names).read().annotations.rows
    assert rows[0]["reject"] == ("cannot read labels/a.txt (a FIFO, not a regular file: only "
                                 "regular files are read), so the image is not packed")
    assert rows[1]["labels"] == [0]


# -- the build's options: one Checks object ------------------------------------------------------

def test_checks_are_one_option_and_validated():
    assert len([p for p in inspect.signature(packer.build).parameters.values()
                if p.kind is p.KEYWORD_ONLY]) <= 10
    for fn in (packer.build, packer.write, packer.DatasetWriter):
        names = inspect.signature(fn).parameters
        assert "checks" in names and not {"strict", "max_pixels", "max_image_bytes"} & set(names)
    for kw, msg in (({"max_pixels": 0}, "max_pixels must be a positive pixel count, got 0"),
                    ({"max_image_bytes": -1}, "max_image_bytes must be a positive byte count"),
                    ({"max_pixels": 2.5}, "max_pixels must be a positive pixel count, got 2.5"),
                    ({"strict": "yes"}, r"Checks\(strict\): True or False")):
        with pytest.raises(PackerError, match=msg):
            Checks(**kw)
    with pytest.raises(PackerError, match="checks must be packer.Checks"):
        build("nowhere", "/nonexistent/dst", checks={"strict": True})


# -- 5: integer labels are bounded -------------------------------------------------------------

def test_a_huge_list_label_is_refused_naming_max_classes(small, tmp_path):
    lst = tmp_path / "list.tsv"
    lst.write_text("class_00/img_00000.jpg\t0\nclass_01/img_00001.jpg\t2000000\n")
    with pytest.raises(PackerError, match=r"list.tsv:2: label 2000000 would make 2,000,001 "
                                          r"classes .* more than max_classes \(1,000,000\)"):
        FileList(lst, root=small).read()
    lst.write_text("class_00/img_00000.jpg\t0\nclass_01/img_00001.jpg\t7\n")
    assert len(FileList(lst, root=small, max_classes=8).read().classes) == 8
    code, out = cli("build", small, tmp_path / "d", "-q", "--list", lst, "--max-classes", "5")
    assert code == 1 and "label 7 would make 8 classes" in out and "raise --max-classes" in out


def test_a_huge_table_label_is_refused(small, tmp_path):
    meta = tmp_path / "meta.jsonl"
    meta.write_text('{"path": "class_00/img_00000.jpg", "y": 1}\n'
                    '{"path": "class_01/img_00001.jpg", "y": 9223372036854775807}\n')
    with pytest.raises(PackerError, match="meta.jsonl:2: the label column 'y': label "
                                          "9223372036854775807 is beyond the 32-bit labels"):
        Table(small, meta, label="y").read()
    meta.write_text('{"path": "class_00/img_00000.jpg", "y": 1}\n'
                    '{"path": "class_01/img_00001.jpg", "y": 2000000}\n')
    with pytest.raises(PackerError, match="more than max_classes"):
        Table(small, meta, label="y").read()


def test_write_refuses_a_huge_label_without_class_names(tmp_path, small):
    jpeg = (small / "class_00" / "img_00000.jpg").read_bytes()
    with pytest.raises(PackerError, match=r"sample 0: label 2000000 would make 2,000,001 classes"):
        write(tmp_path / "w", [{"image": jpeg, "label": 2_000_000}], progress=False, workers=1)


# -- 6: symlink fan-out: each real folder walked once --------------------------------------------

def test_links_that_branch_are_walked_once(small, tmp_path):
    """Each level holds two links to the next: 2**14 paths to one image without the rule."""
    src, real = tmp_path / "src", tmp_path / "real"
    depth = 14
    for k in range(depth + 1):
        (real / f"r{k}").mkdir(parents=True)
    for k in range(depth):
        for name in ("a", "b"):
            os.symlink(real / f"r{k + 1}", real / f"r{k}" / name)
    shutil.copy(small / "class_00" / "img_00000.jpg", real / f"r{depth}" / "deep.jpg")
    (src / "cls").mkdir(parents=True)
    os.symlink(real / "r0", src / "cls" / "start")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        entries = ImageFolder(src).read().entries
    assert entries == [("cls/start/a/" + "a/" * (depth - 1) + "deep.jpg", 0)]
    again = [w for w in seen if issubclass(w.category, SymlinkLoopWarning)]
    assert len(again) == depth and "each folder is walked once" in str(again[0].message)


def test_classes_linking_to_each_other_keep_imagefolder_samples(small, tmp_path):
    """The once-per-folder rule holds within a class: a class folder that is a link to
    another class's folder still lists its images, as torchvision's ImageFolder does."""
    src = tmp_path / "src"
    shutil.copytree(small, src)
    os.symlink(src / "class_00", src / "class_02")
    entries = ImageFolder(src).read().entries
    assert [p for p, c in entries if c == 2] == [p.replace("class_00", "class_02")
                                                 for p, c in entries if c == 0]


# -- 2: verify's pixel limit is the user's ----------------------------------------------------------

def test_verify_takes_its_pixel_limit_from_the_user_not_the_manifest(small, tmp_path):
    """A 9-megapixel PNG bomb (a few KB) in a dataset whose manifest names a limit of 10**15:
    verify with the user's 1,000,000 reports it; the manifest's number is not used."""
    src = tmp_path / "src"
    shutil.copytree(small, src)
    (src / "class_00" / "bomb.png").write_bytes(bomb_png(3000, 3000))
    dst = tmp_path / "d"
    quiet(src, dst, checks=Checks(max_pixels=10_000_000))
    edit_manifest(dst, lambda m: m["options"].update(max_pixels=10 ** 15))
    rep = verify(dst, progress=False, max_pixels=1_000_000)
    assert not rep.ok and len(rep.problems) == 1
    assert "class_00/bomb.png: does not decode: decompression bomb: 3000x3000 = 9000000 " \
           "pixels exceeds max_pixels=1000000" in rep.problems[0]
    code, out = cli("verify", dst, "-q", "--max-pixels", "1000000")
    assert code == 1 and "decompression bomb" in out and "Error: 1 problem(s)" in out
    edit_manifest(dst, lambda m: m["options"].update(max_pixels=10))  # nor a low one
    assert verify(dst, progress=False).ok
    with pytest.raises(PackerError, match=r"verify\(max_pixels\): a positive pixel count"):
        verify(dst, progress=False, max_pixels=0)


# -- 11: the stored width and height are the image's --------------------------------------------

def test_verify_reports_a_record_that_lies_about_its_size(ds):
    rec = PackedDataset(ds).load(0)
    w, h = rec["width"], rec["height"]
    rec.update(width=10, height=5000)
    rewrite_first_record(ds, msgpack.packb(rec, use_bin_type=True))
    for name, value in (("width", 10), ("height", 5000)):  # the columns agree with the lie
        table = array("i", (ds / f"column-{name}.i32").read_bytes())
        table[0] = value
        retable(ds, f"columns.{name}", f"column-{name}.i32", table)
    rep = verify(ds, progress=False)
    assert not rep.ok
    assert rep.problems == [f"record 0 (shard-00000.lmdb) {rec['path']}: the image is {w}x{h} "
                            f"pixels, its record says 10x5000"]


# -- 13: records of the wrong shape are FormatErrors everywhere ------------------------------------

@pytest.mark.parametrize("change, problem", [
    ({"path": 7}, "field 'path' is int, not str"),
    ({"path": None}, "field 'path' is NoneType, not str"),
    ({"path": ...}, "field 'path' is missing"),
    ({"image": "not bytes"}, "field 'image' is str, not bytes")])
def test_records_with_wrong_keys_are_clear_errors(ds, change, problem):
    rec = PackedDataset(ds).load(0)
    for k, v in change.items():
        if v is ...:
            del rec[k]
        else:
            rec[k] = v
    rewrite_first_record(ds, msgpack.packb(rec, use_bin_type=True))
    with pytest.raises(FormatError, match=f"record is not a packer record: {problem}"):
        PackedDataset(ds)[0]
    for args in (["ls"], ["ls", "--json"], ["cat"]):
        code, out = cli(*args, ds, *(["0"] if args == ["cat"] else []))
        assert code == 1 and out.startswith("Error: ") and problem in out, (args, out)
    rep = verify(ds, progress=False)
    assert not rep.ok and problem in rep.problems[0]


# -- 14: sizes are digits and a unit ---------------------------------------------------------------

@pytest.mark.parametrize("text", ["inf", "nan", "1e400", "-1G", "1e3", "0x10", "G", "1.5.1G"])
def test_shard_sizes_that_are_not_sizes_are_usage_errors(tmp_path, text):
    code, out = cli("build", tmp_path, tmp_path / "d", "--shard-size", text)
    assert code == 2 and f"{text!r} is not a size" in out


def test_sizes_keep_their_forms():
    assert [Size().convert(t, None, None) for t in ("512M", "1.5G", "1073741824", "2 KiB", ".5K")] \
        == [512 << 20, 3 << 29, 1 << 30, 2048, 512]
