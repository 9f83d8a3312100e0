"""packer/writer.py: one shard (append, grow, finish atomically, abort), side tables, disk-full."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import struct
from array import array
from pathlib import Path

import lmdb
import pytest

from packer.demo import load_photos, make_image
from packer.errors import PackerError
from packer.format.records import key, pack_record, unpack_record
from packer.writing.shard import MIN_MAP, ShardWriter, disk_errors, existing_shard_ok, write_table


@pytest.fixture(scope="module")
def records():
    """Ten real records (photo-like JPEGs, ~50-100 KB each)."""
    rng, photos = random.Random(5), load_photos()
    out = []
    for i in range(10):
        jpeg = make_image(rng, photos)
        out.append(pack_record(jpeg, fields={"label": i % 3}, path=f"c{i % 3}/{i}.jpg", width=1, height=1,
                               format="JPEG", mode="RGB"))
    return out


def items(path: Path):
    """(key, value) pairs of a shard read with plain lmdb (no packer code)."""
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        env.close()


def write_shard(path: Path, records) -> dict:
    w = ShardWriter(path, expected_bytes=sum(map(len, records)))
    for r in records:
        w.append(r)
    return w.finish()


# -- ShardWriter -------------------------------------------------------------------------------

def test_finish_gives_a_compact_file_matching_its_entry(tmp_path, records):
    path = tmp_path / "shard-00000.lmdb"
    entry = write_shard(path, records)
    payload = sum(map(len, records))
    assert entry["path"] == "shard-00000.lmdb" and entry["count"] == len(records)
    assert entry["bytes"] == path.stat().st_size
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # Compacted: the data and a little B-tree, not the 64 MiB map the writer used.
    assert payload <= entry["bytes"] < payload + len(records) * 4096 + (64 << 10)
    assert path.stat().st_blocks * 512 >= entry["bytes"] - 4096  # not sparse
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.lmdb"]  # no .partial/.compact
    assert items(path) == [(key(i), r) for i, r in enumerate(records)]
    assert unpack_record(items(path)[3][1])["path"] == "c0/3.jpg"


def test_shards_are_reproducible(tmp_path, records):
    a = write_shard(tmp_path / "a.lmdb", records)
    b = write_shard(tmp_path / "b.lmdb", records)
    assert a["sha256"] == b["sha256"] and a["bytes"] == b["bytes"]


def test_writing_shows_only_a_partial_file(tmp_path, records):
    path = tmp_path / "shard-00003.lmdb"
    w = ShardWriter(path, expected_bytes=1)
    w.append(records[0])
    w.flush()
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".shard-00003.lmdb.partial"]
    assert w.finish()["count"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["shard-00003.lmdb"]


def test_map_grows_past_min_map(tmp_path):
    big = 16 << 20
    recs = [bytes([i]) * big for i in range(5)]  # 80 MiB: more than the 64 MiB first map
    assert sum(map(len, recs)) > MIN_MAP
    path = tmp_path / "big.lmdb"
    w = ShardWriter(path, expected_bytes=1)
    assert w.map_size == MIN_MAP
    for r in recs:
        w.append(r)
    entry = w.finish()
    assert w.map_size > MIN_MAP
    assert entry["count"] == 5 and entry["bytes"] == path.stat().st_size >= 5 * big
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    try:
        with env.begin(buffers=True) as txn:
            for i in range(5):
                v = txn.get(key(i))
                assert len(v) == big and v[0] == i and v[big - 1] == i
    finally:
        env.close()


def test_abort_removes_partial_files(tmp_path, records):
    path = tmp_path / "shard-00000.lmdb"
    w = ShardWriter(path, expected_bytes=1 << 20)
    for r in records[:4]:
        w.append(r)
    w.flush()
    assert list(tmp_path.iterdir())
    w.abort()
    assert list(tmp_path.iterdir()) == []
    w.abort()  # twice is harmless


def test_a_stale_partial_file_is_replaced(tmp_path, records):
    path = tmp_path / "shard-00000.lmdb"
    stale = tmp_path / ".shard-00000.lmdb.partial"
    stale.write_bytes(b"left by a crash" * 1000)
    entry = write_shard(path, records[:3])
    assert entry["count"] == 3 and items(path) == [(key(i), r) for i, r in enumerate(records[:3])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.lmdb"]


# -- existing_shard_ok -------------------------------------------------------------------------

def test_existing_shard_ok(tmp_path, records):
    entry = write_shard(tmp_path / "s.lmdb", records[:3])
    assert existing_shard_ok(entry, tmp_path) is None
    data = bytearray((tmp_path / "s.lmdb").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    (tmp_path / "s.lmdb").write_bytes(bytes(data))
    assert existing_shard_ok(entry, tmp_path) == "checksum mismatch"
    (tmp_path / "s.lmdb").write_bytes(bytes(data[:-4096]))
    assert existing_shard_ok(entry, tmp_path) == f"size {len(data) - 4096} != {entry['bytes']}"
    (tmp_path / "s.lmdb").unlink()
    assert existing_shard_ok(entry, tmp_path) == "missing"
    (tmp_path / "s.lmdb").mkdir()  # a folder where the shard should be
    assert existing_shard_ok(entry, tmp_path) == "missing"


# -- write_table -------------------------------------------------------------------------------

def test_write_table_is_little_endian(tmp_path):
    labels = array("i", [0, 1, -2, 2**31 - 1, 7])
    entry = write_table(tmp_path, "labels.i32", labels)
    raw = (tmp_path / "labels.i32").read_bytes()
    assert raw == struct.pack("<5i", 0, 1, -2, 2**31 - 1, 7)
    assert entry == {"path": "labels.i32", "bytes": 20, "sha256": hashlib.sha256(raw).hexdigest()}
    offsets = array("Q", [4096, 70000, 2**40 + 3, 1])
    write_table(tmp_path, "offsets.u64", offsets)
    assert (tmp_path / "offsets.u64").read_bytes() == struct.pack("<4Q", 4096, 70000, 2**40 + 3, 1)
    assert list(labels) == [0, 1, -2, 2**31 - 1, 7]  # the caller's array is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.i32", "offsets.u64"]  # no .tmp


def test_write_table_replaces_atomically(tmp_path):
    write_table(tmp_path, "labels.i32", array("i", range(1000)))
    with open(tmp_path / "labels.i32", "rb") as before:
        inode = os.fstat(before.fileno()).st_ino
        write_table(tmp_path, "labels.i32", array("i", [5, 6]))
        assert before.read() == array("i", range(1000)).tobytes()  # the old file, whole
    assert os.stat(tmp_path / "labels.i32").st_ino != inode
    assert (tmp_path / "labels.i32").read_bytes() == struct.pack("<2i", 5, 6)
    assert [p.name for p in tmp_path.iterdir()] == ["labels.i32"]


# -- disk_errors -------------------------------------------------------------------------------

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_errors_turns_a_real_enospc_into_a_packer_error(tmp_path):
    with pytest.raises(PackerError, match=r"^disk full while writing .*shard-00007\.lmdb "
                                          r"\(\d+\.\d MiB free\)\. .*re-run the same command") as info:
        with disk_errors(tmp_path / "shard-00007.lmdb"):
            with open("/dev/full", "wb", buffering=0) as f:
                f.write(b"x" * 4096)  # the kernel answers ENOSPC
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC


def test_disk_errors_recognises_lmdb_words_and_quota(tmp_path):
    for exc in (lmdb.Error("mdb_txn_commit: No space left on device"),
                OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
                OSError(errno.ENOSPC, "No space left on device")):
        with pytest.raises(PackerError, match="disk full"):
            with disk_errors(tmp_path / "x"):
                raise exc


def test_disk_errors_leaves_other_errors_alone(tmp_path):
    with pytest.raises(FileNotFoundError):
        with disk_errors(tmp_path / "x"):
            open(tmp_path / "missing" / "x", "rb")
    with pytest.raises(ValueError, match="No space left"):  # words alone, wrong type: not ours
        with disk_errors(tmp_path / "x"):
            raise ValueError("No space left on device")
    ran = []
    with disk_errors(tmp_path / "x"):
        ran.append(1)
    assert ran == [1]
