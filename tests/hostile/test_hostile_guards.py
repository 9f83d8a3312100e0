"""Each check of ``packer/format/lmdbfile.py`` (a shard's B-tree read with ``pread``) against
the one crafted shard that only it refuses.

A three-record shard is written with plain ``lmdb`` (record 1 on two overflow pages), then
one field is edited; ``shard_records`` must refuse it with the message of the check that
guards that field. Several checks back each other up (a page number outside the tree would
also be a read outside the file), so each test names its check's message: removing any one
check makes its test fail. Where the missing check would let through more than a vaguer
message (a RecursionError, a ``struct.error``, records in the wrong order or past their
pages), the test says so.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import lmdb
import pytest

from packer.errors import FormatError
from packer.format.lmdbfile import ShardFile, shard_records
from packer.format.records import key

PSIZE = 4096
PAGE_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
# magic, version, address, mapsize, free DB, main DB, last_pg, txnid
META = struct.Struct("<II QQ 48s48s QQ")
DB = struct.Struct("<IHHQQQQQ")  # psize (free DB), flags, depth, 3 page counts, entries, root
NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
# Offsets inside a meta page (after its page header).
VERSION_AT, FREE_DB_AT, MAIN_DB_AT = 16 + 4, 16 + 24, 16 + 72
MAIN_FLAGS_AT, MAIN_DEPTH_AT = MAIN_DB_AT + 4, MAIN_DB_AT + 6
MAIN_ENTRIES_AT, MAIN_ROOT_AT = MAIN_DB_AT + 32, MAIN_DB_AT + 40
TXNID_AT = 16 + 128
SIZES = [10, 5000, 20]  # record 1 lies on overflow pages
CLEAR = "not a valid packer shard"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("lmdb") / "shard.lmdb"
    env = lmdb.open(str(path), subdir=False, map_size=1 << 24, lock=False)
    with env.begin(write=True) as txn:
        for i, n in enumerate(SIZES):
            txn.put(key(i), bytes([i + 1]) * n)
    env.close()
    data = path.read_bytes()
    # The layout the crafts below assume: meta 1 the newer, root page 2 a leaf of 3 nodes,
    # record 1 on overflow pages 3-4.
    assert len(data) == 5 * PSIZE
    assert meta(data, "<Q", TXNID_AT) == 1 and meta(data, "<Q", MAIN_ROOT_AT) == 2
    assert PAGE_HEADER.unpack_from(data, 2 * PSIZE)[2:4] == (0x02, 16 + 2 * len(SIZES))
    assert node(data, 1)[2] & 0x01 and PAGE_HEADER.unpack_from(data, 3 * PSIZE)[2] == 0x04
    return data


@pytest.fixture
def shard(pristine, tmp_path):
    """(path, bytearray): a copy of the pristine shard to edit, then ``save``."""
    path = tmp_path / "shard-00000.lmdb"
    path.write_bytes(pristine)
    return path, bytearray(pristine)


def meta(data, fmt, at, value=None, m=1):
    """Read (or with ``value`` write) a field of meta page ``m``."""
    if value is None:
        return struct.unpack_from(fmt, data, m * PSIZE + at)[0]
    struct.pack_into(fmt, data, m * PSIZE + at, value)


def node_at(data, i, pgno=2) -> int:
    return pgno * PSIZE + struct.unpack_from("<H", data, pgno * PSIZE + 16 + 2 * i)[0]


def node(data, i, pgno=2):
    return NODE.unpack_from(data, node_at(data, i, pgno))


def set_node(data, i, pgno=2, **kw):
    at = node_at(data, i, pgno)
    lo, hi, flags, ksize = NODE.unpack_from(data, at)
    vals = {"lo": lo, "hi": hi, "flags": flags, "ksize": ksize, **kw}
    NODE.pack_into(data, at, vals["lo"], vals["hi"], vals["flags"], vals["ksize"])


def refused(path: Path, data: bytearray, message: str) -> str:
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError) as e:
        shard_records(path)
    assert CLEAR in str(e.value) and message in str(e.value), str(e.value)
    return str(e.value)


def test_the_pristine_shard_reads(shard):
    path, _ = shard
    recs = list(shard_records(path))
    assert recs[1::2] == SIZES
    raw = path.read_bytes()
    assert [raw[o:o + n] for o, n in zip(recs[::2], recs[1::2])] == [
        bytes([i + 1]) * n for i, n in enumerate(SIZES)]


# -- the meta pages ----------------------------------------------------------------------------

def test_a_file_shorter_than_its_meta_pages(shard):
    path, data = shard
    refused(path, data[:PSIZE + 40], "lie outside the file")


def test_a_file_that_shrinks_while_it_is_read(shard):
    """Its size was taken when it was opened; a read that comes back short is refused (not
    parsed: a short page is a struct.error)."""
    path, _ = shard
    fd = os.open(path, os.O_RDONLY)
    try:
        sf = ShardFile(path, fd)
        os.truncate(path, 2 * PSIZE)  # the meta pages stay, the tree goes
        with pytest.raises(FormatError, match="shorter than it was a moment ago"):
            sf.records()
    finally:
        os.close(fd)


def test_another_lmdb_data_version(shard):
    path, data = shard
    for m in (0, 1):
        meta(data, "<I", VERSION_AT, 2, m=m)
    refused(path, data, "LMDB data version 2")


@pytest.mark.parametrize("psize", [4000, 256, 1 << 17])
def test_a_page_size_lmdb_never_writes(shard, psize):
    path, data = shard
    meta(data, "<I", FREE_DB_AT, psize)
    refused(path, data, f"page size {psize}")


def test_a_dupsort_database(shard):
    path, data = shard
    meta(data, "<H", MAIN_FLAGS_AT, 0x04)
    refused(path, data, "database flags 0x4")


@pytest.mark.parametrize("root", [0, 1])
def test_a_root_on_a_meta_page(shard, root):
    path, data = shard
    meta(data, "<Q", MAIN_ROOT_AT, root)
    refused(path, data, f"root page {root} outside pages 2..4")


def test_entries_but_no_tree(shard):
    path, data = shard
    meta(data, "<Q", MAIN_ENTRIES_AT, 0)
    refused(path, data, "0 entries but root page 2")


def test_more_entries_than_the_tree_holds(shard):
    path, data = shard
    meta(data, "<Q", MAIN_ENTRIES_AT, 4)
    refused(path, data, "3 records in its tree, 4 in its meta data")


# -- trees deeper than they say ----------------------------------------------------------------

def chain(path: Path, pages: int, depth: int) -> None:
    """A shard whose tree is ``pages`` branch pages, each with one node pointing at the next,
    ending in an empty leaf; its meta data says ``depth``. Pages of 512 bytes keep it small."""
    ps = 512
    total = pages + 3
    buf = bytearray(total * ps)
    for m in (0, 1):
        PAGE_HEADER.pack_into(buf, m * ps, m, 0, 0x08, 0, 0)
        main = DB.pack(0, 0, depth, pages, 1, 0, 1, 2)
        free = DB.pack(ps, 0, 0, 0, 0, 0, 0, (1 << 64) - 1)
        META.pack_into(buf, m * ps + 16, 0xBEEFC0DE, 1, 0, total * ps, free, main, total - 1, m)
    for pg in range(2, 2 + pages):
        PAGE_HEADER.pack_into(buf, pg * ps, pg, 0, 0x01, 16 + 2, ps - 8)
        struct.pack_into("<H", buf, pg * ps + 16, ps - 8)
        NODE.pack_into(buf, pg * ps + ps - 8, pg + 1, 0, 0, 0)
    PAGE_HEADER.pack_into(buf, (2 + pages) * ps, 2 + pages, 0, 0x02, 16, ps)
    path.write_bytes(bytes(buf))


def test_a_tree_deeper_than_lmdb_allows_is_refused_before_the_walk(tmp_path):
    """1500 levels, and the meta data says so: walked, it would be a RecursionError."""
    chain(tmp_path / "s.lmdb", 1500, 1500)
    with pytest.raises(FormatError, match="depth 1500"):
        shard_records(tmp_path / "s.lmdb")


def test_a_tree_deeper_than_its_meta_data_says(tmp_path):
    """1500 levels where the meta data says 1: refused at level 2, not at a RecursionError."""
    chain(tmp_path / "s.lmdb", 1500, 1)
    with pytest.raises(FormatError, match=r"deeper than its meta data says \(1\)"):
        shard_records(tmp_path / "s.lmdb")


# -- pages and nodes -------------------------------------------------------------------------

def test_an_overflow_pointer_past_the_last_page(shard):
    path, data = shard
    struct.pack_into("<Q", data, node_at(data, 1) + 16, 5)
    refused(path, data, "page 5 outside pages 2..4")


def test_an_overflow_pointer_at_a_leaf_page(shard):
    path, data = shard
    struct.pack_into("<Q", data, node_at(data, 1) + 16, 2)
    refused(path, data, "page 2 has flags 0x2")


@pytest.mark.parametrize("lower", [16 + 7, 14, PSIZE + 2])
def test_a_free_space_range_that_is_none(shard, lower):
    """An odd ``lower`` (half a node pointer), one inside the header, one past the page."""
    path, data = shard
    struct.pack_into("<H", data, 2 * PSIZE + 12, lower)
    refused(path, data, "bad free-space range")


def test_a_node_outside_its_page(shard):
    path, data = shard
    struct.pack_into("<H", data, 2 * PSIZE + 16, PSIZE - 4)
    refused(path, data, "node 0 of page 2 lies outside the page")


def test_a_key_outside_its_page(shard):
    path, data = shard
    set_node(data, 0, ksize=PSIZE)
    refused(path, data, "the key of node 0 of page 2 lies outside the page")


def test_keys_out_of_order(shard):
    """Record 0's key says 2: read anyway, the records would come in the wrong order."""
    path, data = shard
    data[node_at(data, 0) + 8:node_at(data, 0) + 16] = key(2)
    refused(path, data, "keys are not 0..N-1 in order (at record 0)")


def test_a_sub_database_record(shard):
    path, data = shard
    set_node(data, 0, flags=0x02)
    refused(path, data, "record 0 is a sub-database")


def test_a_record_longer_than_its_page(shard):
    """Record 0 says 5000 bytes on a 4096-byte page: its range would run into other pages."""
    path, data = shard
    set_node(data, 0, lo=5000)
    refused(path, data, "record 0 runs past its page")


def test_an_overflow_pointer_at_the_end_of_its_page(shard):
    """Record 0's node (header and key) moved to the last 16 bytes of its page and marked as
    on overflow pages: its 8-byte page pointer would be read from past the page (a
    struct.error)."""
    path, data = shard
    at = 2 * PSIZE + PSIZE - 16
    data[at:at + 16] = data[node_at(data, 0):node_at(data, 0) + 16]
    struct.pack_into("<H", data, 2 * PSIZE + 16, PSIZE - 16)
    set_node(data, 0, flags=0x01)
    refused(path, data, "an overflow pointer on page 2 lies outside the page")


@pytest.mark.parametrize("size", [2 * PSIZE, 1 << 30])
def test_an_overflow_value_longer_than_its_pages(shard, size):
    """Record 1 on 2 overflow pages says it is longer than they are: its range would run
    past them (and past the file)."""
    path, data = shard
    set_node(data, 1, lo=size & 0xFFFF, hi=size >> 16)
    refused(path, data, "the value on overflow page 3 runs past its pages")
