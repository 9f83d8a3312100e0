"""Validation at build time: broken files are skipped and reported; ``--strict`` fails."""
from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from helpers import bomb_png, corrupt_header_jpeg, corrupt_png, encode, quiet_build, small_photo
from packer.errors import FormatError, PackerError
from packer.format.manifest import read_manifest
from packer.writing.check import DEFAULT_MAX_PIXELS, BadImage, Checks, check_image
from packer.info import verify
from packer.reading.reader import ShardReader
from packer.sources import FileList

REASON_PREFIX = {  # what each kind of broken file is reported as
    "empty file": "empty file",
    "truncated": "truncated: image file is truncated",
    "corrupt": "corrupt (",
    "not an image": "not an image packer opens (formats: JPEG, PNG, WEBP, GIF, BMP, TIFF, PPM)",
    "decompression bomb": "decompression bomb: ",
    "unreadable": "unreadable: No such file or directory",
}


def test_every_broken_file_is_skipped_with_its_reason(odd_tree, odd_built):
    m = read_manifest(odd_built)
    got = {s["path"]: s["reason"] for s in m["skipped"]}
    assert set(got) == set(odd_tree.bad)
    for rel, kind in odd_tree.bad.items():
        assert got[rel].startswith(REASON_PREFIX[kind]), (rel, got[rel])
    stored = {ShardReader(odd_built).record(i)["path"] for i in range(m["count"])}
    assert stored == set(odd_tree.good)
    assert not stored & set(odd_tree.ignored)  # not images by name: neither packed nor reported
    assert not set(got) & set(odd_tree.ignored)


@pytest.fixture(scope="module")
def samples(photos):
    import random
    rng = random.Random(5)
    im = small_photo(rng, photos, (120, 90))
    jpg = encode(im, "JPEG", quality=90)
    prog = encode(im, "JPEG", quality=90, progressive=True)
    return {"im": im, "jpg": jpg, "prog": prog, "png": encode(im, "PNG")}


@pytest.mark.parametrize("make, prefix", [
    (lambda s: b"", "empty file"),
    (lambda s: s["jpg"][: len(s["jpg"]) // 2], "truncated: "),
    (lambda s: s["jpg"][:-2], "truncated: "),  # only the end marker missing: PIL refuses it too
    (lambda s: s["prog"][: len(s["prog"]) * 2 // 3], "truncated: "),
    (lambda s: s["png"][: len(s["png"]) // 2], "truncated: "),
    (lambda s: corrupt_png(s["im"]), "corrupt (OSError): broken data stream"),
    (lambda s: corrupt_header_jpeg(s["im"]), "not an image"),
    (lambda s: b"GIF89a not really" * 10, "not an image"),
    (lambda s: b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "not an image"),
    (lambda s: bomb_png(), "decompression bomb: "),
    (lambda s: bomb_png(20000, 20000), "decompression bomb: "),  # above PIL's hard limit too
])
def test_check_image_reasons(samples, make, prefix):
    with pytest.raises(BadImage) as e:
        check_image(make(samples))
    assert str(e.value).startswith(prefix), str(e.value)


def test_training_decode_agrees_with_the_check(samples):
    """Whatever check_image refuses, ImageFolder's loader refuses too (no over-skipping)."""
    for data in (samples["jpg"][:-2], samples["prog"][:-100], corrupt_png(samples["im"])):
        with pytest.raises(BadImage):
            check_image(data)
        with pytest.raises(Exception):
            Image.open(io.BytesIO(data)).convert("RGB")


def test_max_pixels_both_ways(samples, monkeypatch):
    # below PIL's limit: our limit applies
    with pytest.raises(BadImage, match=r"decompression bomb: 120x90 = 10800 pixels exceeds "
                                       r"max_pixels=10000"):
        check_image(samples["jpg"], max_pixels=10_000)
    assert check_image(samples["jpg"], max_pixels=10_800).width == 120
    # above PIL's limit: --max-pixels must win over PIL's own bomb check (warn at N, refuse at 2N)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert check_image(samples["jpg"], max_pixels=1_000_000).width == 120
    assert check_image(samples["png"], max_pixels=1_000_000).width == 120
    assert Image.MAX_IMAGE_PIXELS == 1000  # restored


def test_default_max_pixels_is_pils():
    assert DEFAULT_MAX_PIXELS == Image.MAX_IMAGE_PIXELS


def test_unconvertible_mode_is_not_packed():
    """Training calls convert("RGB"): a file that opens but cannot convert must be skipped."""
    data = encode(Image.new("LAB", (32, 32)), "TIFF")
    try:
        Image.open(io.BytesIO(data)).convert("RGB")
    except Exception:
        with pytest.raises(BadImage, match=r"cannot be converted to RGB .*mode LAB"):
            check_image(data)
    else:  # this PIL has littlecms: fine to pack
        assert check_image(data).mode == "LAB"


def test_max_pixels_option_in_build(odd_tree, tmp_path):
    m = quiet_build(odd_tree.root, tmp_path / "d", checks=Checks(max_pixels=150 * 150)).manifest
    reasons = {s["path"]: s["reason"] for s in m["skipped"]}
    assert reasons["B/a.jpg"].startswith("decompression bomb: ")  # ImageNet-sized: over 22,500 px
    assert "Z9/rgba.png" not in reasons  # 160x120 = 19,200 px
    assert m["options"]["max_pixels"] == 150 * 150


def test_list_with_missing_and_bad_files(odd_tree, tmp_path):
    lst = tmp_path / "list.tsv"
    lst.write_text("B/a.jpg\tcat\nnot/there.jpg\tdog\nwith space/empty.jpg\tdog\n"
                   "Z10/cmyk.jpg\tdog\n_x/notes.txt\tcat\n", encoding="utf-8")
    m = quiet_build(FileList(lst, root=odd_tree.root), tmp_path / "d").manifest
    assert m["classes"] == ["cat", "dog"] and m["count"] == 2
    reasons = {s["path"]: s["reason"] for s in m["skipped"]}
    assert reasons["not/there.jpg"].startswith("unreadable: No such file")
    assert reasons["with space/empty.jpg"] == "empty file"
    assert reasons["_x/notes.txt"].startswith("not an image")  # a list is taken as given
    r = ShardReader(tmp_path / "d")
    assert [(r.record(i)["path"], r.record(i)["label"]) for i in range(2)] == [
        ("B/a.jpg", 0), ("Z10/cmyk.jpg", 1)]
    assert m["options"]["list"] == str(lst)


def test_list_with_a_missing_source_folder_is_an_error(tmp_path):
    lst = tmp_path / "list.tsv"
    lst.write_text("a.jpg\t0\n")
    with pytest.raises(PackerError, match=r"FileList\(list_file, root\): root .* does not exist "
                                          r"or is not a folder"):
        quiet_build(FileList(lst, root=tmp_path / "nope"), tmp_path / "d")


# -- --strict ----------------------------------------------------------------------------------

def test_strict_fails_and_leaves_no_dataset(odd_tree, tmp_path):
    dst = tmp_path / "d"
    with pytest.raises(PackerError, match=r"strict: with space/\w+.* no dataset was written"):
        quiet_build(odd_tree.root, dst, checks=Checks(strict=True), workers=2)
    assert not (dst / "manifest.json").exists()
    for open_it in (read_manifest, ShardReader, lambda d: verify(d, progress=False)):
        with pytest.raises(FormatError, match="manifest.json"):
            open_it(dst)
    assert not list(dst.glob(".*.partial"))


def test_strict_on_clean_input_builds(photo_src, tmp_path):
    m = quiet_build(photo_src, tmp_path / "d", checks=Checks(strict=True), shard_size=1 << 20).manifest
    assert m["skipped"] == [] and m["options"]["strict"] is True
    assert verify(tmp_path / "d", progress=False).ok


def test_strict_after_finished_shards(photo_src, tmp_path):
    """A bad file after several finished shards: still no dataset, and the error names it."""
    import shutil
    src = tmp_path / "src"
    shutil.copytree(photo_src, src)
    (src / "class_03" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 broken")
    with pytest.raises(PackerError, match=r"strict: class_03/zz_broken\.jpg: truncated"):
        quiet_build(src, tmp_path / "d", checks=Checks(strict=True), shard_size=1 << 20)
    assert list((tmp_path / "d").glob("shard-*.lmdb"))  # earlier shards were finished...
    with pytest.raises(FormatError, match="unfinished build"):  # ...but nothing reads as done
        ShardReader(tmp_path / "d")
    # without --strict the same source builds, reporting the file
    m = quiet_build(src, tmp_path / "d", shard_size=1 << 20).manifest
    assert [s["path"] for s in m["skipped"]] == ["class_03/zz_broken.jpg"]
    assert json.loads((tmp_path / "d/manifest.json").read_text())["count"] == 48


def test_file_name_that_is_not_utf8_is_skipped_and_reported(photo_src, tmp_path):
    import os
    import shutil
    src = tmp_path / "src"
    shutil.copytree(photo_src / "class_00", src / "c")
    good = sorted(p.name for p in (src / "c").iterdir())
    os.rename(src / "c" / good[0], os.path.join(os.fsencode(src / "c"), b"caf\xe9.jpg"))
    m = quiet_build(src, tmp_path / "d").manifest
    assert m["skipped"] == [{"path": "c/caf\\xe9.jpg", "reason": "file name is not valid UTF-8: rename "
                             "it (e.g. `convmv -r -f latin1 -t utf8 --notest SRC`)"}]
    assert m["count"] == len(good) - 1
    json.loads((tmp_path / "d" / "manifest.json").read_text("utf-8"))
    with pytest.raises(PackerError, match=r"strict: c/caf\\xe9\.jpg: file name is not valid UTF-8"):
        quiet_build(src, tmp_path / "e", checks=Checks(strict=True))


def test_all_images_bad_is_an_error_not_an_empty_dataset(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.jpg").write_bytes(b"not a jpeg")
    (src / "a" / "y.png").write_bytes(b"")
    from packer import build
    from packer.errors import PackerError
    with pytest.raises(PackerError, match="all 2 images were skipped"):
        build(src, tmp_path / "dst", workers=0, progress=False)
    assert not (tmp_path / "dst" / "manifest.json").exists()
