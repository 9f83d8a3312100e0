"""A shard's LMDB B-tree read directly with ``pread``, every page number, offset and range
checked against the file's size (a crafted shard is a ``FormatError``, never a SIGBUS).
Only what packer writes is accepted: LMDB data format 1, 8-byte keys ``0..count-1``."""
from __future__ import annotations

import os
import struct
from array import array
from typing import List, Tuple

from ..errors import FormatError
from .records import KEY

MAGIC, DATA_VERSION = 0xBEEFC0DE, 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
P_INVALID = (1 << 64) - 1
PAGE_HEADER = struct.Struct("<QHHHH")      # pgno, pad, flags, lower, upper
DB = struct.Struct("<IHHQQQQQ")            # psize (free DB), flags, depth, 3 counts, entries, root
META = struct.Struct("<II QQ 48s48s QQ")   # magic, version, address, mapsize, 2 DBs, last_pg, txnid
NODE = struct.Struct("<HHHH")              # lo, hi, flags, ksize
MAX_DEPTH = 32


class ShardFile:
    """One shard file, open for ``pread``: its meta data, checked, and its records' ranges."""

    def __init__(self, path: os.PathLike, fd: int):
        self.path, self.fd = path, fd
        self.size = os.fstat(fd).st_size
        self.psize, self.last_pg, self.entries, self.root, self.depth = self._meta()

    def _fail(self, what: str) -> FormatError:
        return FormatError(f"{self.path} is not a valid packer shard: {what}; the file is "
                           f"damaged or not from packer (rebuild or re-stage it)")

    def _read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise self._fail(f"bytes {offset}..{offset + length} lie outside the file "
                             f"({self.size} bytes)")
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise self._fail("the file is shorter than it was a moment ago")
        return data

    def _meta(self) -> Tuple[int, int, int, int, int]:
        """(page size, last page, entries, root page, depth) of the newer of the two metas,
        both checked as LMDB checks them, and the newer one's pages all inside the file."""
        metas, offset = [], 0
        for _ in range(2):
            head = self._read(offset, PAGE_HEADER.size + META.size)
            flags = PAGE_HEADER.unpack_from(head)[2]
            magic, version, _, _, free_db, main_db, last_pg, txnid = META.unpack_from(
                head, PAGE_HEADER.size)
            if not flags & P_META or magic != MAGIC:
                raise self._fail("no LMDB meta page (wrong magic)")
            if version != DATA_VERSION:
                raise self._fail(f"LMDB data version {version}, not {DATA_VERSION}")
            psize = DB.unpack(free_db)[0]
            if psize < 512 or psize > 65536 or psize & (psize - 1):
                raise self._fail(f"page size {psize}")
            metas.append((txnid, psize, last_pg, DB.unpack(main_db)))
            offset = metas[0][1]  # the second meta sits one (first meta's) page in
        txnid, psize, last_pg, (_, db_flags, depth, _, _, _, entries, root) = max(
            metas, key=lambda m: m[0])
        if last_pg < 1 or (last_pg + 1) * psize > self.size:
            raise self._fail(f"its meta data says {last_pg + 1} pages of {psize} bytes, the file "
                             f"has {self.size} bytes")
        if db_flags & 0x04 or depth > MAX_DEPTH:  # MDB_DUPSORT: not a packer shard
            raise self._fail(f"database flags {db_flags:#x}, depth {depth}")
        if root != P_INVALID and not 2 <= root <= last_pg:
            raise self._fail(f"root page {root} outside pages 2..{last_pg}")
        if (root == P_INVALID) != (entries == 0):
            raise self._fail(f"{entries} entries but root page {root}")
        return psize, last_pg, entries, root, depth

    def _page(self, pgno: int, want: int) -> Tuple[bytes, int]:
        if not 2 <= pgno <= self.last_pg:
            raise self._fail(f"page {pgno} outside pages 2..{self.last_pg}")
        page = self._read(pgno * self.psize, self.psize)
        _, _, flags, lower, upper = PAGE_HEADER.unpack_from(page)
        if not flags & want:
            raise self._fail(f"page {pgno} has flags {flags:#x}")
        if flags & P_OVERFLOW:
            return page, 0
        if not PAGE_HEADER.size <= lower <= upper <= self.psize or lower % 2:
            raise self._fail(f"page {pgno} has a bad free-space range {lower}..{upper}")
        return page, (lower - PAGE_HEADER.size) // 2

    def _node(self, page: bytes, pgno: int, i: int) -> Tuple[int, int, int, int]:
        """(lo | hi << 16, flags, key size, offset of the key) of node ``i`` on ``page``."""
        at = struct.unpack_from("<H", page, PAGE_HEADER.size + 2 * i)[0]
        if at + NODE.size > self.psize:
            raise self._fail(f"node {i} of page {pgno} lies outside the page")
        lo, hi, flags, ksize = NODE.unpack_from(page, at)
        if at + NODE.size + ksize > self.psize:
            raise self._fail(f"the key of node {i} of page {pgno} lies outside the page")
        return lo | hi << 16, flags, ksize, at + NODE.size

    def records(self) -> array:
        """(offset, length) of every value in key order, flattened (``offsets.u64``). Keys must run
        ``0..entries-1``, values lie inside the file, and no page be reached twice (a crafted
        tree of shared pages would be walked exponentially often)."""
        out = array("Q")
        if self.root != P_INVALID:
            self._walk(self.root, 0, out, set())
        if len(out) != 2 * self.entries:
            raise self._fail(f"{len(out) // 2} records in its tree, {self.entries} in its meta "
                             f"data")
        return out

    def _walk(self, pgno: int, level: int, out: array, seen: set) -> None:
        if level > self.depth:
            raise self._fail(f"the tree is deeper than its meta data says ({self.depth})")
        if pgno in seen:
            raise self._fail(f"page {pgno} is reached twice in its tree")
        seen.add(pgno)
        page, n = self._page(pgno, P_BRANCH | P_LEAF)
        if PAGE_HEADER.unpack_from(page)[2] & P_BRANCH:
            for i in range(n):
                lo, flags, _, _ = self._node(page, pgno, i)
                self._walk(lo | flags << 32, level + 1, out, seen)  # a branch node's child page
            return
        for i in range(n):
            size, flags, ksize, key_at = self._node(page, pgno, i)
            if ksize != KEY.size or page[key_at:key_at + ksize] != KEY.pack(len(out) // 2):
                raise self._fail(f"keys are not 0..N-1 in order (at record {len(out) // 2})")
            if flags & (F_SUBDATA | F_DUPDATA):
                raise self._fail(f"record {len(out) // 2} is a sub-database")
            data_at = key_at + ksize
            if flags & F_BIGDATA:
                out.extend(self._overflow(page, pgno, data_at, size))
            else:
                if data_at + size > self.psize:
                    raise self._fail(f"record {len(out) // 2} runs past its page")
                out.extend((pgno * self.psize + data_at, size))

    def _overflow(self, page: bytes, pgno: int, data_at: int, size: int) -> List[int]:
        if data_at + 8 > self.psize:
            raise self._fail(f"an overflow pointer on page {pgno} lies outside the page")
        first = struct.unpack_from("<Q", page, data_at)[0]
        head, _ = self._page(first, P_OVERFLOW)
        pages = struct.unpack_from("<I", head, 12)[0]
        start = first * self.psize + PAGE_HEADER.size
        if first + pages - 1 > self.last_pg or start + size > (first + pages) * self.psize:
            raise self._fail(f"the value on overflow page {first} runs past its pages")
        return [start, size]


def shard_records(path: os.PathLike) -> array:
    """(offset, length) of every record of the shard at ``path``: see ``ShardFile.records``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return ShardFile(path, fd).records()
    finally:
        os.close(fd)
