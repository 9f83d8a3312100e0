"""The write path: shards, records, manifest, bit-exact bytes, transcoding, shuffle, parts."""
from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import lmdb
import msgpack
import pytest
from PIL import Image

import packer
from helpers import encode, image_files, imagefolder_rule, quiet_build
from packer.format import manifest as fmt
from packer.format.records import RECORD_FIELDS
from packer._util.fsio import write_json_atomic
from packer.writing import shard as writer_mod
from packer import merge
from packer.errors import FormatError, PackerError
from packer.writing.check import Transcode
from packer.info import ls, verify
from packer.reading.reader import ShardReader
from packer.format.tables import read_labels
from packer.writing.shard import ShardWriter

PACKER_DIR = Path(packer.__file__).parent


def records(root):
    r = ShardReader(root)
    try:
        return [r.record(i) for i in range(len(r))]
    finally:
        r.close()


def shard_items(path: Path):
    """(key, value) pairs of one shard, read with plain lmdb (no packer code)."""
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return list(txn.cursor())
    finally:
        env.close()


# -- manifest and records ------------------------------------------------------------------

def test_manifest_has_everything(odd_tree, odd_built):
    m = json.loads((odd_built / "manifest.json").read_text("utf-8"))
    classes, class_to_idx, _ = imagefolder_rule(odd_tree.root)
    assert m["format"] == "packer"
    assert m["format_version"] == fmt.FORMAT_VERSION
    assert m["packer_version"] == packer.__version__
    assert m["classes"] == classes and m["class_to_idx"] == class_to_idx
    assert m["count"] == len(odd_tree.good) == sum(s["count"] for s in m["shards"])
    counts = dict(zip(m["classes"], m["class_counts"]))
    assert counts["empty"] == counts["only_txt"] == 0 and counts["B"] == 6
    assert sum(m["class_counts"]) == m["count"]
    assert m["bytes"] == sum(s["bytes"] for s in m["shards"])
    for s in m["shards"]:
        p = odd_built / s["path"]
        assert re.fullmatch(r"shard-\d{5}\.lmdb", s["path"])
        assert p.stat().st_size == s["bytes"]
        assert fmt.file_sha256(p) == s["sha256"]
        assert len(shard_items(p)) == s["count"]
    kinds = {s["path"]: s["reason"].split(":")[0].split(" (")[0].removesuffix(" packer opens")
             for s in m["skipped"]}  # "not an image packer opens": PIL's other formats too
    assert kinds == odd_tree.bad
    opts = m["options"]
    assert opts["shard_size"] == 1 << 20 and opts["transcode"] is None and opts["shuffle"] is False
    assert {"seed", "part", "strict", "max_pixels", "list"} <= set(opts)


def test_bit_exact_round_trip(odd_tree, odd_built):
    recs = records(odd_built)
    _, _, samples = imagefolder_rule(odd_tree.root)
    good = [(p, lab) for p, lab in samples if p in odd_tree.good]
    assert [(r["path"], r["label"]) for r in recs] == good  # source order, ImageFolder labels
    for r in recs:
        src = (odd_tree.root / r["path"]).read_bytes()
        assert r["image"] == src, r["path"]
        assert r["crc32"] == zlib.crc32(src)
        with Image.open(io.BytesIO(src)) as im:
            assert (r["width"], r["height"]) == im.size
            assert r["format"] == im.format and r["mode"] == im.mode
    assert list(read_labels(odd_built)) == [lab for _, lab in good]


def test_records_are_plain_msgpack_with_big_endian_keys(odd_built):
    m = fmt.read_manifest(odd_built)

    def no_ext(code, data):
        raise AssertionError(f"msgpack ext type {code} in a record")

    for s in m["shards"]:
        items = shard_items(odd_built / s["path"])
        assert [k for k, _ in items] == [struct.pack(">Q", i) for i in range(s["count"])]
        for _, v in items:
            rec = msgpack.unpackb(v, raw=False, ext_hook=no_ext, strict_map_key=True)
            assert set(RECORD_FIELDS) <= set(rec)
            assert isinstance(rec["image"], bytes) and isinstance(rec["path"], str)
            assert isinstance(rec["label"], int) and isinstance(rec["crc32"], int)


def test_no_pickle_anywhere_in_the_format():
    mods = [PACKER_DIR / "info.py"] + [p for d in ("format", "sources", "writing", "reading")
                                       for p in (PACKER_DIR / d).glob("*.py")]
    for mod in mods:
        text = mod.read_text("utf-8")
        assert not re.search(r"^\s*(import|from)\s+(c?[pP]ickle|dill|cloudpickle)\b", text, re.M), mod
        assert "torch.load" not in text and "marshal" not in text, mod
    code = "import sys, packer.format.manifest, packer.reading.reader; print(sorted(m for m in sys.modules if 'pickle' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_newer_major_format_is_refused_with_a_clear_message(odd_built, tmp_path):
    import shutil
    from packer.reading.dataset import PackedDataset
    dst = tmp_path / "d"
    shutil.copytree(odd_built, dst)
    man = json.loads((dst / "manifest.json").read_text("utf-8"))
    man["format_version"] = "1.7"  # newer minor: accepted
    write_json_atomic(dst / "manifest.json", man)
    assert len(PackedDataset(dst)) == man["count"]
    man["format_version"] = "2.0"
    write_json_atomic(dst / "manifest.json", man)
    for open_it in (fmt.read_manifest, ShardReader, PackedDataset, verify):
        with pytest.raises(FormatError, match=r"packer format 2\.0, newer than this packer "
                                              r"understands \(1\.\d+\); upgrade packer"):
            open_it(dst)


# -- shards ----------------------------------------------------------------------------------

def test_shards_are_single_compacted_files_of_about_shard_size(photo_src, tmp_path):
    dst = tmp_path / "dst"
    shard_size = 1 << 20
    m = quiet_build(photo_src, dst, shard_size=shard_size, workers=2).manifest
    assert len(m["shards"]) >= 3
    names = sorted(p.name for p in dst.iterdir())
    assert names == sorted(["manifest.json", "labels.i32", "offsets.u64", "column-width.i32",
                           "column-height.i32", "paths.u64", "paths.utf8"] + [s["path"] for s in m["shards"]])
    biggest = max(p.stat().st_size for p in photo_src.rglob("*.jpg"))
    for n, s in enumerate(m["shards"]):
        p = dst / s["path"]
        assert p.is_file() and not p.is_symlink()
        st = p.stat()
        assert st.st_blocks * 512 >= st.st_size * 0.95, "shard is sparse: not compacted"
        payload = sum(len(v) for _, v in shard_items(p))
        assert st.st_size <= payload * 1.15 + (64 << 10), "shard is not compacted"
        # planned by the source files' bytes: at most shard_size of them (or one file), and no
        # room left for the next image (the records add a few hundred bytes each)
        if n < len(m["shards"]) - 1:
            assert shard_size - biggest - 1024 < payload <= shard_size + s["count"] * 1024
    assert m["count"] == len(image_files(photo_src))


def test_map_grows_by_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "MIN_MAP", 64 << 10)
    monkeypatch.setattr(writer_mod, "TXN_BYTES", 300 << 10)
    w = ShardWriter(tmp_path / "shard-00000.lmdb", expected_bytes=1)  # a 64 KiB map at first
    blobs = [os.urandom(20_000 + i) for i in range(120)]  # ~2.4 MB
    for b in blobs:
        w.append(b)
    entry = w.finish()
    assert w.map_size > 64 << 10
    assert entry["count"] == 120 and not list(tmp_path.glob(".*"))
    assert [v for _, v in shard_items(tmp_path / entry["path"])] == blobs


def test_build_survives_a_tiny_initial_map(photo_src, tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "MIN_MAP", 0)  # map = 1.25 x shard size: overflow pages overflow it
    dst = tmp_path / "dst"
    quiet_build(photo_src, dst, shard_size=4 << 20)
    assert verify(dst, progress=False).ok


def test_shard_size_bounds_are_checked(photo_src, tmp_path):
    with pytest.raises(PackerError, match="shard_size must be between 1 MiB and 64 GiB"):
        quiet_build(photo_src, tmp_path / "d", shard_size=1000)
    with pytest.raises(PackerError, match="workers must be >= 0"):
        quiet_build(photo_src, tmp_path / "d", workers=-1)


def test_workers_do_not_change_the_result(odd_tree, odd_built, tmp_path):
    m = quiet_build(odd_tree.root, tmp_path / "d", workers=0, shard_size=1 << 20).manifest
    ref = fmt.read_manifest(odd_built)
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in ref["shards"]]
    assert m["skipped"] == ref["skipped"]



def test_more_workers_than_shards_start_one_process_per_shard(odd_tree, odd_built, tmp_path):
    # 10**11 workers was an OverflowError traceback; 5,000 forked 5,000 processes for one shard
    m = quiet_build(odd_tree.root, tmp_path / "d", workers=10 ** 11, shard_size=1 << 20).manifest
    ref = fmt.read_manifest(odd_built)
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in ref["shards"]]
def test_empty_source_is_an_error(tmp_path):
    (tmp_path / "src/a").mkdir(parents=True)
    (tmp_path / "src/a/readme.txt").write_text("x")
    with pytest.raises(PackerError, match="no images"):
        quiet_build(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst" / "manifest.json").exists()


def test_dst_inside_src_is_refused(photo_src, tmp_path):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(photo_src, src)
    with pytest.raises(PackerError, match="inside the image folder"):
        quiet_build(src, src / "packed")
    assert not (src / "packed").exists()


# -- overwrite ---------------------------------------------------------------------------------

def test_finished_dst_needs_overwrite(photo_src, tmp_path):
    dst = tmp_path / "dst"
    quiet_build(photo_src, dst, shard_size=1 << 20)
    (dst / "README.txt").write_text("mine")
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    with pytest.raises(PackerError, match=r"already holds a finished dataset \(of another source or options, or an "
                                         r"older packer\); replace it with overwrite=True"):
        quiet_build(photo_src, dst, shard_size=2 << 20)
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before
    m = quiet_build(photo_src, dst, shard_size=2 << 20, overwrite=True).manifest
    assert m["options"]["shard_size"] == 2 << 20
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        ["README.txt", "manifest.json", "labels.i32", "offsets.u64", "column-width.i32", "column-height.i32", "paths.u64", "paths.utf8"] + [s["path"] for s in m["shards"]])
    assert verify(dst, progress=False).ok


# -- shuffle -----------------------------------------------------------------------------------

def test_shuffle_seed_is_reproducible_and_a_permutation(photo_src, tmp_path):
    order = lambda d: [p for _, _, p in ls(d)]  # noqa: E731
    quiet_build(photo_src, tmp_path / "plain", shard_size=1 << 20)
    a = quiet_build(photo_src, tmp_path / "a", shuffle=True, seed=3, shard_size=1 << 20).manifest
    b = quiet_build(photo_src, tmp_path / "b", shuffle=True, seed=3, shard_size=1 << 20, workers=2).manifest
    quiet_build(photo_src, tmp_path / "c", shuffle=True, seed=4, shard_size=1 << 20)
    assert order(tmp_path / "plain") == image_files(photo_src)
    assert order(tmp_path / "a") == order(tmp_path / "b")
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert order(tmp_path / "a") != order(tmp_path / "plain")
    assert order(tmp_path / "a") != order(tmp_path / "c")
    assert sorted(order(tmp_path / "a")) == sorted(order(tmp_path / "c")) == image_files(photo_src)
    assert a["options"]["shuffle"] is True and a["options"]["seed"] == 3
    # labels follow their records
    want = dict(imagefolder_rule(photo_src)[2])
    assert [lab for _, lab, _ in ls(tmp_path / "a")] == [want[p] for p in order(tmp_path / "a")]
    assert list(read_labels(tmp_path / "a")) == [want[p] for p in order(tmp_path / "a")]


# -- transcoding -------------------------------------------------------------------------------

def quant_tables(data: bytes):
    with Image.open(io.BytesIO(data)) as im:
        return im.quantization


def test_transcode_bounds_sizes_and_makes_baseline_jpegs(odd_tree, tmp_path):
    m = quiet_build(odd_tree.root, tmp_path / "d", transcode=Transcode(max_side=64, quality=70)).manifest
    assert m["options"]["transcode"] == {"max_side": 64, "short_side": None, "quality": 70}
    recs = records(tmp_path / "d")
    assert len(recs) == len(odd_tree.good)
    ref_q = quant_tables(encode(Image.new("RGB", (32, 32), "gray"), "JPEG", quality=70))
    for r in recs:
        with Image.open(io.BytesIO(r["image"])) as im:
            assert im.format == "JPEG" and im.mode == "RGB", r["path"]
            assert "progressive" not in im.info and "progression" not in im.info, r["path"]
            assert im.size == (r["width"], r["height"])
            assert max(im.size) <= 64, r["path"]
            im.load()
        assert (r["format"], r["mode"]) == ("JPEG", "RGB")
        assert quant_tables(r["image"]) == ref_q, r["path"]
        with Image.open(odd_tree.root / r["path"]) as src:
            w, h = src.size
        assert abs(r["width"] / r["height"] - w / h) < 0.05, r["path"]  # aspect kept
    assert verify(tmp_path / "d", progress=False).ok


def test_transcode_short_side_never_upscales(odd_tree, tmp_path):
    quiet_build(odd_tree.root, tmp_path / "d", transcode=Transcode(short_side=100))
    recs = records(tmp_path / "d")
    for r in recs:
        with Image.open(odd_tree.root / r["path"]) as src:
            w, h = src.size
        assert min(r["width"], r["height"]) == min(100, w, h), r["path"]
        assert r["width"] <= w and r["height"] <= h


def test_transcode_quality_changes_size(odd_tree, tmp_path):
    size = {}
    for q in (20, 95):
        quiet_build(odd_tree.root, tmp_path / str(q), transcode=Transcode(quality=q))
        size[q] = sum(len(r["image"]) for r in records(tmp_path / str(q)))
    assert size[20] * 2 < size[95]


def test_transcode_odd_modes_to_sensible_rgb(odd_tree, tmp_path):
    quiet_build(odd_tree.root, tmp_path / "d", transcode=Transcode(quality=100))
    got = {r["path"]: Image.open(io.BytesIO(r["image"])).convert("RGB") for r in records(tmp_path / "d")}

    def close(a, b, tol=12):
        return all(abs(x - y) <= tol for x, y in zip(a, b))

    # 16-bit grey is scaled to 8 bits (v >> 8), not clipped to white as convert("RGB") does
    src16 = Image.open(odd_tree.root / "Z9/png16.png")
    for xy in [(10, 10), (80, 60), (150, 110)]:
        v = src16.getpixel(xy) >> 8
        assert close(got["Z9/png16.png"].getpixel(xy), (v, v, v)), xy
    # transparent palette entries go on white
    pal = Image.open(odd_tree.root / "Z9/palette_transparent.png").convert("RGBA")
    xy = next((x, y) for y in range(pal.height) for x in range(pal.width) if pal.getpixel((x, y))[3] == 0)
    assert close(got["Z9/palette_transparent.png"].getpixel(xy), (255, 255, 255))
    # CMYK and the rest: what ImageFolder's convert("RGB") shows
    for rel in ("Z10/cmyk.jpg", "Z10/gray.jpg", "a/img.tif"):
        ref = Image.open(odd_tree.root / rel).convert("RGB")
        assert close(got[rel].getpixel((40, 40)), ref.getpixel((40, 40)), tol=20), rel
    # EXIF is kept (not applied), so exif_orientation still works at read time
    with Image.open(io.BytesIO([r for r in records(tmp_path / "d")
                                if r["path"] == "Z10/exif_rotated.jpg"][0]["image"])) as im:
        assert im.getexif().get(0x0112) == 6 and im.size == (180, 100)


def test_transcode_options_are_checked():
    with pytest.raises(PackerError, match="max_side must be at least 16"):
        Transcode(max_side=8)
    with pytest.raises(PackerError, match="quality must be in 1..100"):
        Transcode(quality=0)


# -- parts and merge ---------------------------------------------------------------------------

def test_parts_then_merge(photo_src, tmp_path):
    parts = [tmp_path / f"p{k}" for k in range(3)]
    for k, p in enumerate(parts):
        quiet_build(photo_src, p, part=f"{k}/3", shard_size=1 << 20)
    paths = [[q for _, _, q in ls(p)] for p in parts]
    flat = [q for ps in paths for q in ps]
    assert sorted(flat) == image_files(photo_src) and len(set(flat)) == len(flat)
    before = {f: f.stat().st_size for f in tmp_path.rglob("*.lmdb")}
    m = merge(parts, tmp_path / "all")
    assert {f: f.stat().st_size for f in tmp_path.rglob("*.lmdb")} == before  # no shard copied
    assert not list((tmp_path / "all").glob("*.lmdb"))
    assert m["count"] == len(flat)
    assert all(s["path"].startswith("../p") for s in m["shards"])
    assert [q for _, _, q in ls(tmp_path / "all")] == flat
    want = dict(imagefolder_rule(photo_src)[2])
    assert list(read_labels(tmp_path / "all")) == [want[q] for q in flat]
    assert verify(tmp_path / "all", progress=False).ok
    assert merge(parts, tmp_path / "all") == m  # the same merge again: done, unchanged
    with pytest.raises(PackerError, match="already holds a finished dataset"):
        merge(parts[:2], tmp_path / "all")
    merge(parts[:2], tmp_path / "all", overwrite=True)


def test_merge_refuses_mismatched_or_repeated_parts(photo_src, odd_built, tmp_path):
    p0 = tmp_path / "p0"
    quiet_build(photo_src, p0, part="0/2", shard_size=1 << 20)
    with pytest.raises(PackerError, match="different classes"):
        merge([p0, odd_built], tmp_path / "m")
    with pytest.raises(PackerError, match="more than once"):
        merge([p0, p0], tmp_path / "m")
    with pytest.raises(FormatError, match="not a packer dataset"):
        merge([p0, tmp_path], tmp_path / "m")
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_the_shard_plan_is_a_function_of_the_file_sizes_alone():
    from packer.writing.worker import MIN_PLANNED, PLANNED_SHARDS, plan_shards
    sizes = [(i * 7919) % 200_000 + 1 for i in range(20_000)]  # ~2 GB of files
    plan = plan_shards(sizes, 1 << 30)
    assert plan == plan_shards(list(sizes), 1 << 30)
    assert [p[0] for p in plan] == [0] + [p[1] for p in plan[:-1]] and plan[-1][1] == len(sizes)
    target = max(MIN_PLANNED, -(-sum(sizes) // PLANNED_SHARDS))  # small: ~64 shards
    assert all(n == sum(sizes[a:e]) and (n <= target or e - a == 1) for a, e, n in plan)
    assert PLANNED_SHARDS <= len(plan) <= PLANNED_SHARDS * 1.02  # greedy cuts: a little more
    big = plan_shards(sizes, 32 << 20)  # a shard size under the small-dataset target wins
    assert all(n <= 32 << 20 for _, _, n in big) and len(big) > len(plan) // 2
    assert plan_shards([5 << 30, 1], 1 << 30) == [(0, 1, 5 << 30), (1, 2, 1)]  # one huge file
    assert plan_shards([], 1 << 30) == []
