"""``verify`` reports what training would fail on, on hostile datasets made of real files.

Every dataset here is real: records are msgpack maps written into LMDB shards by
``ShardWriter``, with a labels table, an offsets table and a manifest carrying every field of
docs/format.md. The CLI runs as a real ``python -m packer`` process; the decompression bomb
is checked under an address-space limit, so "verify does not decode it" is measured, not
assumed.
"""
from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from array import array
from pathlib import Path

import msgpack
import pytest
from PIL import Image

import packer
from helpers import LIMIT_AFTER_IMPORTS
from packer import PackedDataset, build, verify
from packer.demo import make_image_folder
from packer.errors import FormatError
from packer.format.manifest import file_sha256
from packer.format.records import pack_record
from packer.format.lmdbfile import shard_records
from packer.writing.shard import ShardWriter, write_table

PKG_PARENT = str(Path(packer.__file__).resolve().parents[1])
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (PKG_PARENT, os.environ.get("PYTHONPATH")) if p))
MAX_PIXELS = 89_478_485
QUICK_NOTE = "records were not read, decoded or compared with labels.i32 (quick)"
BOMB_SIDE = 30000  # 30000 x 30000 RGB: 2.7 GB once decoded


# -- helpers ---------------------------------------------------------------------------------

# The child reports its own peak RSS, beyond what imports took when a limit is set (VmHWM
# starts afresh at exec; getrusage's ru_maxrss of a forked child would include the test
# process's memory at fork time).
PEAK = ("import atexit, sys\n"
        "def _kb(field):\n"
        "    return int([l for l in open('/proc/self/status') if l.startswith(field)][0].split()[1])\n"
        "def _peak():\n"
        "    sys.stderr.write('PEAK_KB %d\\n' % (_kb('VmHWM') - globals().get('_base_kb', 0)))\n"
        "atexit.register(_peak)\n")
BASE = "_base_kb = _kb('VmRSS')  # what torch and packer take before any work\n"


def run(args, *, limit_as=None, timeout=60):
    """Run ``args`` (``[python, -c, code, ...]`` or ``[python, -m, module, ...]``) as a real
    process, optionally under RLIMIT_AS: (rc, out, err, peak RSS MiB of that process)."""
    # The limit is ``limit_as`` bytes more than the process maps once torch and packer are
    # imported (a CUDA torch maps many GiB of address space by itself).
    prefix = PEAK + LIMIT_AFTER_IMPORTS + (BASE if limit_as else "")
    if args[1] == "-m":
        args = [args[0], "-c", prefix + f"import runpy\n"
                f"runpy.run_module({args[2]!r}, run_name='__main__')", *args[3:]]
    else:
        args = [args[0], "-c", prefix + args[2], *args[3:]]
    env = dict(ENV, PACKER_TEST_EXTRA_AS=str(limit_as or 0))

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(args, stdout=out, stderr=err, env=env)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                os.wait4(p.pid, 0)
                p.returncode = -9
                pytest.fail(f"{args} ran past {timeout} s")
            time.sleep(0.02)
        p.returncode = rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        lines = err.read().decode().splitlines(keepends=True)
        peak = [int(ln.split()[1]) for ln in lines if ln.startswith("PEAK_KB ")]
        text = "".join(ln for ln in lines if not ln.startswith("PEAK_KB "))
        return rc, out.read().decode(), text, (peak[-1] if peak else 0) / 1024


def packer_cli(*args, **kw):
    return run([sys.executable, "-m", "packer", *map(str, args)], **kw)


def library_verify(root, *, quick=False, **kw):
    """``packer.verify`` in a child process: (rc, problems, skipped_checks, maxrss MiB)."""
    code = ("import json, sys\nfrom packer import verify\n"
            "rep = verify(sys.argv[1], quick=sys.argv[2] == '1', progress=False)\n"
            "print(json.dumps([rep.problems, rep.skipped_checks, rep.checked_records]))\n")
    rc, out, err, rss = run([sys.executable, "-c", code, str(root), "1" if quick else "0"], **kw)
    assert rc == 0, err
    problems, skipped, checked = json.loads(out.strip().splitlines()[-1])
    return problems, skipped, checked, rss


def real_record(path: Path, rel: str, label: int) -> bytes:
    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size
        fmt, mode = im.format, im.mode
    return pack_record(data, fields={"label": label}, path=rel, width=w, height=h, format=fmt, mode=mode)


def make_dataset(dst: Path, records, classes, *, labels=None, max_pixels=MAX_PIXELS) -> Path:
    """A dataset written by hand: one shard of ``records`` (msgpack bytes, or dicts packed
    here), labels.i32 (``labels``, else each record's ``label``), offsets.u64 read back from
    the shard, and a manifest with every documented field."""
    dst.mkdir(parents=True, exist_ok=True)
    packed = [r if isinstance(r, bytes) else msgpack.packb(r, use_bin_type=True) for r in records]
    if labels is None:
        labels = [msgpack.unpackb(r, raw=False).get("label") for r in packed]
    writer = ShardWriter(dst / "shard-00000.lmdb", expected_bytes=1 << 20)
    for r in packed:
        writer.append(r)
    shard = writer.finish()
    counts = [0] * len(classes)
    for lab in labels:
        if 0 <= lab < len(classes):
            counts[lab] += 1
    manifest = {
        "format": "packer", "format_version": "1.1", "packer_version": packer.__version__,
        "created": "2024-01-01T00:00:00+00:00", "count": len(packed), "bytes": shard["bytes"],
        "classes": list(classes), "class_to_idx": {c: i for i, c in enumerate(classes)},
        "class_counts": counts, "shards": [shard],
        "labels": write_table(dst, "labels.i32", array("i", labels)),
        "offsets": write_table(dst, "offsets.u64", shard_records(dst / shard["path"])),
        "skipped": [], "source": "/nonexistent/src",
        "options": {"shard_size": 1 << 30, "transcode": None, "shuffle": False, "seed": 0,
                    "part": None, "strict": False, "max_pixels": max_pixels, "list": None},
        "pil": "test",
    }
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return dst


def rewrite_manifest(root: Path, **changes) -> None:
    path = root / "manifest.json"
    man = json.loads(path.read_text())
    man.update(changes)
    path.write_text(json.dumps(man, indent=1))


def bomb_png(photo: Path, side: int = BOMB_SIDE) -> bytes:
    """A real PNG of a photo whose IHDR (CRC fixed) declares ``side`` x ``side`` pixels."""
    with Image.open(photo) as im:
        small = im.convert("RGB").resize((128, 96))
    out = io.BytesIO()
    small.save(out, "PNG")
    data = bytearray(out.getvalue())
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", side, side)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def no_traceback(*texts):
    for t in texts:
        assert "Traceback" not in t, t


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("verify") / "src", images=24, classes=3)


@pytest.fixture(scope="module")
def jpegs(src):
    return sorted(src.rglob("*.jpg"))


def good_records(jpegs, n=5, label=None):
    return [real_record(p, f"{p.parent.name}/{p.name}",
                        label if label is not None else int(p.parent.name[-2:]))
            for p in jpegs[:n]]


# -- (a) a decompression bomb ------------------------------------------------------------------

def test_verify_reports_bomb_within_memory_limit(src, jpegs, tmp_path):
    bomb = bomb_png(jpegs[1])
    assert len(bomb) < 64 << 10
    # build refuses it (so the dataset below is written by hand, as a stranger could)
    folder = tmp_path / "src"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "ok.jpg").write_bytes(jpegs[0].read_bytes())
    (folder / "a" / "bomb.png").write_bytes(bomb)
    m = build(folder, tmp_path / "built", workers=0, progress=False).manifest
    assert m["count"] == 1 and [s["path"] for s in m["skipped"]] == ["a/bomb.png"]
    assert "decompression bomb" in m["skipped"][0]["reason"]

    records = good_records(jpegs, 5)
    records.insert(3, pack_record(bomb, fields={"label": 1}, path="class_01/bomb.png", width=BOMB_SIDE,
                                  height=BOMB_SIDE, format="PNG", mode="RGB"))
    root = make_dataset(tmp_path / "dst", records, ["class_00", "class_01", "class_02"])
    limit = 3 << 29  # 1.5 GiB more address space: the bomb needs 2.7 GB decoded

    rc, out, err, rss = packer_cli("verify", "-q", root, limit_as=limit)
    no_traceback(out, err)
    assert rc == 1, (out, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("record 3 ")]
    assert len(lines) == 1, err
    assert "bomb.png" in lines[0] and "does not decode" in lines[0]
    assert "decompression bomb" in lines[0], lines[0]
    assert not any(ln.startswith(("record 0", "record 1 ", "record 2", "record 4", "record 5"))
                   for ln in err.splitlines()), err
    assert 0 < rss < 400, f"verify used {rss:.0f} MiB"

    problems, _, checked, rss = library_verify(root, limit_as=limit)
    assert checked == 6
    assert len(problems) == 1 and problems[0].startswith("record 3 "), problems
    assert "decompression bomb" in problems[0]
    assert 0 < rss < 400, f"verify used {rss:.0f} MiB"


# -- (b) labels outside classes ----------------------------------------------------------------

def test_verify_reports_labels_outside_classes(jpegs, tmp_path):
    records = good_records(jpegs, 4)
    records.append(good_records(jpegs[4:], 1, label=7)[0])  # record and labels.i32 agree: 7
    root = make_dataset(tmp_path / "dst", records, ["class_00", "class_01", "class_02"])
    assert list(array("i", (root / "labels.i32").read_bytes()))[-1] == 7

    rep = verify(root, progress=False)
    assert not rep.ok
    assert any("labels.i32" in p and "outside 0..2" in p for p in rep.problems), rep.problems

    rc, out, err, _ = packer_cli("verify", "-q", root)
    no_traceback(out, err)
    assert rc == 1
    assert any("labels.i32" in ln and "outside 0..2" in ln for ln in err.splitlines()), err
    # --quick compares labels with classes too (it reads no record)
    rc, out, err, _ = packer_cli("verify", "--quick", "-q", root)
    assert rc == 1 and "outside 0..2" in err, (out, err)


# -- (c) a field of the wrong type -------------------------------------------------------------

@pytest.mark.parametrize("field, value, kind, want", [
    ("image", "text", "str", "bytes"),
    ("image", 12345, "int", "bytes"),
    ("label", "cat", "str", "int"),
    ("width", None, "NoneType", "int"),
])
def test_verify_reports_field_of_wrong_type(jpegs, tmp_path, field, value, kind, want):
    records = good_records(jpegs, 3)
    rec = msgpack.unpackb(records[1], raw=False)
    rec[field] = value
    records[1] = msgpack.packb(rec, use_bin_type=True)
    labels = [0, 0, 0] if field == "label" else None
    root = make_dataset(tmp_path / "dst", records, ["class_00", "class_01", "class_02"],
                        labels=labels)
    expected = f"field {field!r} is {kind}, not {want}"

    rep = verify(root, progress=False)
    assert len(rep.problems) == 1, rep.problems
    assert rep.problems[0].startswith("record 1 ") and expected in rep.problems[0]

    rc, out, err, _ = packer_cli("verify", "-q", root)
    no_traceback(out, err)
    assert rc == 1
    assert any(ln.startswith("record 1 ") and expected in ln for ln in err.splitlines()), err


# -- (d) a shard that is not LMDB ------------------------------------------------------------

@pytest.fixture
def built(src, tmp_path) -> Path:
    build(src, tmp_path / "dst", workers=0, progress=False)
    return tmp_path / "dst"


def test_verify_reports_flipped_lmdb_magic(built):
    shard = built / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    assert struct.unpack_from("<I", data, 16)[0] == 0xBEEFC0DE  # the first meta page's magic
    data[16] ^= 0xFF
    shard.write_bytes(bytes(data))
    man = json.loads((built / "manifest.json").read_text())
    man["shards"][0]["sha256"] = file_sha256(shard)  # checksum agrees: only structure is wrong
    (built / "manifest.json").write_text(json.dumps(man, indent=1))

    rep = verify(built, progress=False)
    assert not rep.ok
    assert rep.problems[0].startswith("shard-00000.lmdb: "), rep.problems

    for args in (["verify", "-q"], ["verify", "--quick", "-q"]):
        rc, out, err, _ = packer_cli(*args, built)
        no_traceback(out, err)
        assert rc == 1, (args, out, err)
        assert any(ln.startswith("shard-00000.lmdb: ") for ln in err.splitlines()), err

    # Readers of a dataset without offsets.u64 (format 1.0) walk the shard's B-tree: there,
    # what training hits is a FormatError naming the shard, not an lmdb exception or a crash.
    del man["offsets"]
    (built / "offsets.u64").unlink()
    (built / "manifest.json").write_text(json.dumps(man, indent=1))
    with pytest.raises(FormatError, match="shard-00000.lmdb"):
        PackedDataset(built)[0]
    rc, out, err, _ = packer_cli("ls", built)
    no_traceback(out, err)
    assert rc == 1 and "Error:" in err and "shard-00000.lmdb" in err, (out, err)


# -- (e) --quick says what it skipped ----------------------------------------------------------

def test_quick_says_what_it_did_not_check(built, jpegs, tmp_path):
    rep = verify(built, quick=True, progress=False)
    assert rep.ok and rep.checked_records == 0 and rep.checked_shards == 1
    assert rep.skipped_checks == QUICK_NOTE
    assert verify(built, progress=False).skipped_checks == ""

    rc, out, err, _ = packer_cli("verify", "--quick", "-q", built)
    assert rc == 0, (out, err)
    assert out.startswith("OK: 1 shards verified") and QUICK_NOTE in out, out

    # a dataset whose records are bad passes --quick, and the output says why
    records = good_records(jpegs, 2)
    records.append(msgpack.packb(dict(msgpack.unpackb(records[0], raw=False), image="text"),
                                 use_bin_type=True))
    bad = make_dataset(tmp_path / "bad", records, ["class_00", "class_01", "class_02"])
    rc, out, err, _ = packer_cli("verify", "--quick", "-q", bad)
    assert rc == 0 and QUICK_NOTE in out, (out, err)
    rc, out, err, _ = packer_cli("verify", "-q", bad)
    assert rc == 1 and "field 'image' is str, not bytes" in err, (out, err)


# -- (f) verify_crc ----------------------------------------------------------------------------

def test_verify_crc_catches_altered_image_bytes(built):
    index = 5
    offsets = array("Q", (built / "offsets.u64").read_bytes())
    start, length = offsets[2 * index], offsets[2 * index + 1]
    shard = built / "shard-00000.lmdb"
    before = PackedDataset(built, decode=bytes).load(index)
    with open(shard, "r+b") as f:  # one byte of the stored JPEG, in place (same size)
        at = start + length // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))

    checked = PackedDataset(built, decode=bytes, verify_crc=True)
    with pytest.raises(FormatError, match=f"record {index} "):
        checked[index]
    assert checked[index - 1][1] == checked.target(index - 1)  # its neighbours still read

    image, label = PackedDataset(built, decode=bytes, verify_crc=False)[index]
    assert label == before["label"]
    assert len(image) == len(before["image"]) and image != before["image"]

    rep = verify(built, progress=False)
    assert any(p.startswith(f"record {index} ") and "checksum mismatch" in p
               for p in rep.problems), rep.problems
