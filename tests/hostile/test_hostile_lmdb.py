"""Crafted shards never crash a reader.

A dataset without the ``offsets`` table (as older packers wrote them) is read through each
shard's LMDB B-tree. Here real shards are edited byte by byte (meta page fields, node
pointers, overflow page numbers, truncation) and the manifest is rewritten to match the
edited file (size, sha256), so nothing but the shard's inside is wrong. Readers run in a
subprocess, so a SIGBUS or SIGSEGV shows as a negative return code instead of killing
pytest: every reader must exit 0 or 1 with a clear error, never a signal or a traceback.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import packer
from packer import build
from packer.demo import make_image_folder

REPO = Path(packer.__file__).resolve().parent.parent
PSIZE = 4096
PAGE_HEADER = struct.Struct("<QHHHH")      # pgno, pad, flags, lower, upper
META = struct.Struct("<IIQQ48s48sQQ")      # magic, version, address, mapsize, free DB, main DB, last_pg, txnid
DB = struct.Struct("<IHHQQQQQ")            # pad, flags, depth, branch, leaf, overflow pages, entries, root
LAST_PG_AT = PAGE_HEADER.size + 4 + 4 + 8 + 8 + 48 + 48
MAIN_ROOT_AT = PAGE_HEADER.size + 4 + 4 + 8 + 8 + 48 + (DB.size - 8)
MAGIC_AT = PAGE_HEADER.size
CLEAR_ERROR = "not a valid packer shard"

READ_DATASET = r"""
import sys
from packer import PackedDataset
from packer.errors import FormatError
try:
    ds = PackedDataset(sys.argv[1])
    ds[0]
    print("read", len(list(ds)), "records")
except FormatError as e:
    print("FormatError:", e)
    sys.exit(1)
"""


# -- crafting ----------------------------------------------------------------------------------

def newest_meta(data: bytes) -> int:
    """Offset of the meta page LMDB uses (the larger txnid)."""
    metas = [(META.unpack_from(data, k * PSIZE + PAGE_HEADER.size)[-1], k * PSIZE) for k in (0, 1)]
    return max(metas)[1]


def main_root(data: bytes) -> int:
    meta = META.unpack_from(data, newest_meta(data) + PAGE_HEADER.size)
    return DB.unpack(meta[5])[-1]


def put(data: bytearray, fmt: str, offset: int, value: int) -> None:
    struct.pack_into(fmt, data, offset, value)


def last_page_past_end(data: bytearray) -> bytearray:
    put(data, "<Q", newest_meta(data) + LAST_PG_AT, len(data) // PSIZE + 1000)
    return data


def root_past_end(data: bytearray) -> bytearray:
    put(data, "<Q", newest_meta(data) + MAIN_ROOT_AT, len(data) // PSIZE + 50)
    return data


def flipped_magic(data: bytearray) -> bytearray:
    at = newest_meta(data) + MAGIC_AT
    put(data, "<I", at, struct.unpack_from("<I", data, at)[0] ^ 0xFFFFFFFF)
    return data


def node_outside_page(data: bytearray) -> bytearray:
    root = main_root(data)  # 24 records: the root is the one leaf page
    assert PAGE_HEADER.unpack_from(data, root * PSIZE)[2] & 0x02, "root is not a leaf"
    put(data, "<H", root * PSIZE + PAGE_HEADER.size, 0xFFF0)  # node 0's offset in its page
    return data


def overflow_past_end(data: bytearray) -> bytearray:
    root = main_root(data)
    node = root * PSIZE + struct.unpack_from("<H", data, root * PSIZE + PAGE_HEADER.size)[0]
    assert struct.unpack_from("<H", data, node + 4)[0] & 0x01, "record 0 is not on overflow pages"
    put(data, "<Q", node + 8 + 8, len(data) // PSIZE + 7)  # after the node header and 8-byte key
    return data


def truncated(data: bytearray) -> bytearray:
    return data[: (len(data) // PSIZE // 2) * PSIZE]


CRAFTS = {"last_pg past the end": last_page_past_end, "main root past the end": root_past_end,
          "flipped magic": flipped_magic, "leaf node outside its page": node_outside_page,
          "overflow page past the end": overflow_past_end, "truncated": truncated}


def rewrite_manifest(root: Path) -> None:
    """The manifest made consistent with the shards as they are now, without offsets."""
    man = json.loads((root / "manifest.json").read_text())
    man.pop("offsets", None)
    for s in man["shards"]:
        data = (root / s["path"]).read_bytes()
        s["bytes"], s["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    man["bytes"] = sum(s["bytes"] for s in man["shards"])
    tmp = root / "manifest.json.edit"
    tmp.write_text(json.dumps(man, indent=1) + "\n")
    os.replace(tmp, root / "manifest.json")
    (root / "offsets.u64").unlink(missing_ok=True)


def run(*cmd) -> tuple:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    p = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lmdb")
    src = make_image_folder(root / "src", images=24, classes=3)
    build(src, root / "ds", progress=False, workers=0)  # one shard
    # The control: without offsets, an intact shard's B-tree reads, all 24 records.
    control = root / "control"
    shutil.copytree(root / "ds", control)
    rewrite_manifest(control)
    rc, out = run("-c", READ_DATASET, control)
    assert rc == 0 and "read 24 records" in out, out
    return root / "ds"


# -- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("craft", list(CRAFTS))
def test_crafted_shard_is_a_clear_error_in_every_reader(built, tmp_path, craft):
    root = tmp_path / "ds"
    shutil.copytree(built, root)
    shard = root / "shard-00000.lmdb"
    data = CRAFTS[craft](bytearray(shard.read_bytes()))
    assert bytes(data) != shard.read_bytes()
    shard.write_bytes(bytes(data))
    rewrite_manifest(root)

    for what, cmd in [("PackedDataset", ("-c", READ_DATASET, root)),
                      ("packer verify", ("-m", "packer", "verify", root, "-q")),
                      ("packer ls", ("-m", "packer", "ls", root))]:
        rc, out = run(*cmd)
        assert rc >= 0, f"{what} on a shard with {craft} was killed by signal {-rc}:\n{out}"
        assert "Traceback" not in out, f"{what} on a shard with {craft} crashed:\n{out}"
        assert rc == 1, f"{what} accepted a shard with {craft} (exit {rc}):\n{out}"
        assert CLEAR_ERROR in out, f"{what} on a shard with {craft}: unclear error:\n{out}"


def shared_page_chain(path: Path, depth: int) -> None:
    """A shard whose tree is a chain of branch pages, each with two nodes pointing at the
    next page, ending in an empty leaf: 2**depth paths through depth + 1 pages."""
    pages = depth + 3
    buf = bytearray(pages * PSIZE)
    for m in (0, 1):
        PAGE_HEADER.pack_into(buf, m * PSIZE, m, 0, 0x08, 0, 0)
        main = DB.pack(0, 0, depth, depth, 1, 0, 1, 2)  # one entry, root page 2
        free = DB.pack(PSIZE, 0, 0, 0, 0, 0, 0, (1 << 64) - 1)
        META.pack_into(buf, m * PSIZE + PAGE_HEADER.size, 0xBEEFC0DE, 1, 0, pages * PSIZE,
                       free, main, pages - 1, m)
    for pg in range(2, 2 + depth):
        PAGE_HEADER.pack_into(buf, pg * PSIZE, pg, 0, 0x01, PAGE_HEADER.size + 4, PSIZE - 8)
        for i in (0, 1):
            struct.pack_into("<H", buf, pg * PSIZE + PAGE_HEADER.size + 2 * i, PSIZE - 8)
        struct.pack_into("<HHHH", buf, pg * PSIZE + PSIZE - 8, pg + 1, 0, 0, 0)
    PAGE_HEADER.pack_into(buf, (2 + depth) * PSIZE, 2 + depth, 0, 0x02, PAGE_HEADER.size, PSIZE)
    path.write_bytes(bytes(buf))


def test_tree_of_shared_pages_is_refused_not_walked_for_ever(tmp_path):
    # 143 KB whose 2**30 paths took hours to walk: every page may be reached once.
    shard = tmp_path / "shard-00000.lmdb"
    shared_page_chain(shard, 30)
    rc, out = run("-c", "import sys\nfrom packer.format.lmdbfile import shard_records\n"
                  "from packer.errors import FormatError\ntry:\n shard_records(sys.argv[1])\n"
                  "except FormatError as e:\n print(e); sys.exit(1)", shard)
    assert rc == 1 and "reached twice" in out and CLEAR_ERROR in out, out
