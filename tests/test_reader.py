"""packer/reader.py: ShardReader (index -> record bytes, per process), the side tables."""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import lmdb
import pytest

import packer
from packer.reading import ShardReader
from packer.demo import make_image_folder
from packer.errors import FormatError
from packer._util.fsio import write_json_atomic
from packer.format.records import key, unpack_record
from packer.format.tables import read_labels, read_offsets
from packer.format.lmdbfile import shard_records


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("reader") / "src", images=24, classes=3)


@pytest.fixture(scope="module")
def built(src, tmp_path_factory) -> Path:
    """24 photo-like JPEGs in 3 classes, in at least two shards; read-only."""
    dst = tmp_path_factory.mktemp("reader_built") / "dst"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packer.build(src, dst, progress=False, workers=0, shard_size=1 << 20)
    assert len(manifest(dst)["shards"]) >= 2
    return dst


@pytest.fixture
def copy(built, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(built, dst)
    return dst


def manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text("utf-8"))


def expected_order(src: Path):
    """(relative path, label) in ImageFolder order: sorted classes, sorted files."""
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    return [(f"{c}/{f.name}", i) for i, c in enumerate(classes) for f in sorted((src / c).iterdir())]


def lmdb_value(shard: Path, local: int) -> bytes:
    """One record read with plain lmdb (no packer code)."""
    env = lmdb.open(str(shard), subdir=False, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return txn.get(key(local))
    finally:
        env.close()


def digests(reader) -> list:
    return [hashlib.sha256(reader.read(i)).hexdigest() for i in range(len(reader))]


# -- indexing ----------------------------------------------------------------------------------

def test_len_and_locate(built):
    m = manifest(built)
    counts = [s["count"] for s in m["shards"]]
    r = ShardReader(built)
    try:
        assert len(r) == m["count"] == sum(counts) == 24
        assert r.locate(0) == (0, 0)
        assert r.locate(counts[0] - 1) == (0, counts[0] - 1)
        assert r.locate(counts[0]) == (1, 0)  # first record of the second shard
        assert r.locate(23) == (len(counts) - 1, counts[-1] - 1)
        assert r.locate(-1) == r.locate(23) and r.locate(-24) == (0, 0)
        assert [r.locate(i) for i in range(24)] == [(s, j) for s, c in enumerate(counts) for j in range(c)]
        for bad in (24, 25, -25, 10**9):
            with pytest.raises(IndexError, match="out of range for a dataset of 24"):
                r.locate(bad)
        with pytest.raises(IndexError):
            r.read(24)
    finally:
        r.close()


def test_read_is_the_bytes_lmdb_holds(built):
    r = ShardReader(built)
    try:
        assert r.offsets is not None  # built on Linux: reads are preads at the offsets
        for i in range(len(r)):
            shard, local = r.locate(i)
            assert r.read(i) == lmdb_value(r.paths[shard], local), i
        assert r.read(-1) == r.read(len(r) - 1)
    finally:
        r.close()


def test_records_in_imagefolder_order(built, src):
    r = ShardReader(built)
    try:
        recs = [r.record(i) for i in range(len(r))]
    finally:
        r.close()
    assert [(rec["path"], rec["label"]) for rec in recs] == expected_order(src)
    for rec in recs:
        assert rec["image"] == (src / rec["path"]).read_bytes()
        assert rec["format"] == "JPEG" and rec["mode"] == "RGB"


def test_reads_without_an_offsets_table(built):
    """Older datasets: the ranges come from each shard's B-tree, read once (no LMDB map)."""
    m = manifest(built)
    del m["offsets"]
    plain, via_lmdb = ShardReader(built), ShardReader(built, m)
    try:
        assert via_lmdb.offsets == plain.offsets
        assert [via_lmdb.read(i) for i in range(len(via_lmdb))] == [plain.read(i) for i in range(len(plain))]
    finally:
        plain.close()
        via_lmdb.close()


# -- processes ---------------------------------------------------------------------------------

def test_pickles_without_open_envs_and_reads_in_a_new_process(built, tmp_path):
    r = ShardReader(built)
    try:
        want = digests(r)  # every shard opened in this process
        data = pickle.dumps(r)
        clone = pickle.loads(data)
        assert digests(clone) == want
        clone.close()
        (tmp_path / "reader.pkl").write_bytes(data)
        code = ("import hashlib, pickle, sys\n"
                "r = pickle.load(open(sys.argv[1], 'rb'))\n"
                "print('\\n'.join(hashlib.sha256(r.read(i)).hexdigest() for i in range(len(r))))\n")
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "reader.pkl")],
                             capture_output=True, text=True, check=True)
        assert out.stdout.split() == want
    finally:
        r.close()


def _child_digests(reader, queue):
    try:
        queue.put(digests(reader))
        queue.put(digests(pickle.loads(pickle.dumps(reader))))  # a second reader in the child
    except BaseException as e:  # report, not hang
        queue.put(repr(e))


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_reader_opened_in_the_parent_reads_in_a_forked_child(built):
    m = manifest(built)
    del m["offsets"]  # through LMDB: the environments the child inherits must not be reused
    for r in (ShardReader(built), ShardReader(built, m)):
        try:
            want = digests(r)
            ctx = mp.get_context("fork")
            q = ctx.Queue()
            p = ctx.Process(target=_child_digests, args=(r, q))
            p.start()
            got = [q.get(timeout=60), q.get(timeout=60)]
            p.join(60)
            assert p.exitcode == 0
            assert got == [want, want]
            assert digests(r) == want  # the parent's environments still work
        finally:
            r.close()


def test_two_readers_over_the_same_shards(built):
    m = manifest(built)
    del m["offsets"]
    for kw in ({}, {"manifest": m}):
        a, b = ShardReader(built, **kw), ShardReader(built, **kw)
        want = digests(a)
        assert digests(b) == want
        a.close()  # shared environments: closing one reader leaves the other working
        assert digests(b) == want
        b.close()
        c = ShardReader(built, **kw)
        assert digests(c) == want
        c.close()


# -- damaged datasets --------------------------------------------------------------------------

def test_missing_shard(copy):
    shard = copy / manifest(copy)["shards"][1]["path"]
    shard.unlink()
    with pytest.raises(FormatError, match=rf"shard .*{shard.name} listed in .* is missing"):
        ShardReader(copy)


def test_a_shard_removed_after_opening_is_a_format_error(copy):
    """Unstaged (or deleted) while a training job still reads it: the job's next read of that
    shard says so, as docs/security.md promises, not a raw FileNotFoundError."""
    reader = ShardReader(copy)
    reader.read(0)
    last = len(reader) - 1
    (copy / manifest(copy)["shards"][-1]["path"]).unlink()
    with pytest.raises(FormatError, match="cannot be opened .*removed .*after this dataset was opened"):
        reader.read(last)



def test_a_shard_replaced_by_a_fifo_is_a_format_error_not_a_wait(copy):
    # a FIFO put in a shard's place (a shared /dev/shm) made the lazy open wait for a writer
    reader = ShardReader(copy)
    reader.read(0)
    last = len(reader) - 1
    shard = copy / manifest(copy)["shards"][-1]["path"]
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(FormatError, match="was replaced after this dataset was opened"):
        reader.read(last)
def test_a_shard_cut_short_while_it_is_open_is_a_format_error(copy):
    """Truncated in place after the reader opened it: a short read is refused, not returned
    as a record."""
    reader = ShardReader(copy)
    last = len(reader) - 1
    reader.read(last)  # its shard is open now
    os.truncate(copy / manifest(copy)["shards"][-1]["path"], 8192)
    with pytest.raises(FormatError, match="shorter than its offsets say; damaged shard"):
        reader.read(last)


def test_verify_crc_refuses_an_image_changed_on_disk(copy):
    """One byte of record 0's image flipped in its shard: still a valid record, so only the
    CRC-32 check tells (without it, damaged pixels are trained on)."""
    reader = ShardReader(copy)
    data = reader.read(0)
    image = unpack_record(data)["image"]
    at = reader.offsets[0] + data.index(image) + len(image) // 2
    reader.close()
    shard = copy / manifest(copy)["shards"][0]["path"]
    with open(shard, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))
    assert ShardReader(copy).record(0)["image"] != image  # read as it is without the check
    with pytest.raises(FormatError, match="record 0 of .*fails its CRC-32 check"):
        ShardReader(copy, verify_crc=True).record(0)


def test_a_shard_that_is_a_folder_of_the_listed_size_is_refused(copy):
    """Only a regular file is a shard, even one whose size matches its manifest entry (a
    folder would be opened, then each read an IsADirectoryError)."""
    man = manifest(copy)
    s = man["shards"][0]
    shard = copy / s["path"]
    shard.unlink()
    shard.mkdir()
    man["bytes"] += shard.stat().st_size - s["bytes"]
    s["bytes"] = shard.stat().st_size
    write_json_atomic(copy / "manifest.json", man)
    with pytest.raises(FormatError, match=rf"shard .*{shard.name} is not a regular file"):
        ShardReader(copy)


@pytest.mark.parametrize("change", ["truncate", "extend"])
def test_shard_of_the_wrong_size(copy, change):
    s = manifest(copy)["shards"][0]
    shard = copy / s["path"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-4096] if change == "truncate" else data + bytes(4096))
    size = shard.stat().st_size
    with pytest.raises(FormatError, match=rf"is {size} bytes but .* says {s['bytes']} .*re-stage"):
        ShardReader(copy)


def test_missing_manifest(copy):
    (copy / "manifest.json").unlink()
    with pytest.raises(FormatError, match="not a packer dataset"):
        ShardReader(copy)


# -- shard files and the side tables -------------------------------------------------------

def test_shard_records_refuses_a_non_lmdb_file(tmp_path):
    (tmp_path / "not.lmdb").write_bytes(b"not an lmdb file" * 1000)
    with pytest.raises(FormatError, match="not a valid packer shard: no LMDB meta page"):
        shard_records(tmp_path / "not.lmdb")


def test_read_labels(built, src):
    labels = read_labels(built)
    assert labels.typecode == "i" and labels.itemsize == 4
    assert list(labels) == [lab for _, lab in expected_order(src)]
    assert list(read_labels(built, manifest(built))) == list(labels)


def test_read_offsets_point_at_the_records(built):
    m = manifest(built)
    offsets = read_offsets(built)
    assert offsets.typecode == "Q" and len(offsets) == 2 * m["count"]
    r = ShardReader(built)
    try:
        i = 0
        for s in m["shards"]:
            data = (built / s["path"]).read_bytes()
            for _ in range(s["count"]):
                off, length = offsets[2 * i], offsets[2 * i + 1]
                assert data[off:off + length] == r.read(i)
                assert unpack_record(data[off:off + length])["image"][:2] == b"\xff\xd8"
                i += 1
    finally:
        r.close()
    del m["offsets"]
    assert read_offsets(built, m) is None


@pytest.mark.parametrize("name, cut", [("labels.i32", 4), ("offsets.u64", 16)])
def test_a_table_of_the_wrong_length(copy, name, cut):
    table = copy / name
    table.write_bytes(table.read_bytes()[:-cut])
    read = read_labels if name == "labels.i32" else read_offsets
    kind = name.split(".")[0]
    with pytest.raises(FormatError, match=rf"holds 23 {kind} for 24 records; the dataset is damaged"):
        read(copy)
    table.write_bytes(table.read_bytes() + bytes(2 * cut))  # too long is damaged too
    with pytest.raises(FormatError, match=rf"holds 25 {kind} for 24 records"):
        read(copy)
    if name == "offsets.u64":
        with pytest.raises(FormatError):
            ShardReader(copy)


def test_a_table_that_is_missing_or_unaligned(copy):
    (copy / "labels.i32").unlink()
    with pytest.raises(FormatError, match="cannot read labels .*re-stage or rebuild"):
        read_labels(copy)
    offsets = copy / "offsets.u64"
    offsets.write_bytes(offsets.read_bytes()[:-3])  # not a whole number of uint64s
    with pytest.raises(FormatError, match="holds 23 offsets for 24 records"):
        read_offsets(copy)


def test_manifest_table_path_is_used(copy):
    m = manifest(copy)
    (copy / "labels.i32").rename(copy / "other-labels.i32")
    m["labels"]["path"] = "other-labels.i32"
    write_json_atomic(copy / "manifest.json", m)
    assert len(read_labels(copy)) == 24
