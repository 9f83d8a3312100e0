"""Looking inside a dataset: info, verify (full and quick), ls, cat."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
from click.testing import CliRunner

from helpers import imagefolder_rule, packer_env
from packer.cli import main
from packer.errors import FormatError
from packer._util.fsio import write_json_atomic
from packer.format.manifest import FORMAT_VERSION, file_sha256, read_manifest
from packer.info import cat, format_info, info, ls, verify


@pytest.fixture
def copy(odd_built, tmp_path):
    dst = tmp_path / "d"
    shutil.copytree(odd_built, dst)
    return dst


def locate_image_bytes(dst, rel_src: bytes):
    """(shard path, offset) where a slice of a source file's bytes sits inside a shard."""
    m = read_manifest(dst)
    probe = rel_src[len(rel_src) // 2: len(rel_src) // 2 + 64]
    for s in m["shards"]:
        data = (dst / s["path"]).read_bytes()
        at = data.find(probe)
        if at >= 0:
            assert data.count(probe) == 1
            return dst / s["path"], at
    raise AssertionError("image bytes not found in any shard")


def test_info_object(odd_tree, odd_built):
    i = info(odd_built)
    m = read_manifest(odd_built)
    assert i["count"] == m["count"] == len(odd_tree.good)
    assert i["classes"] == imagefolder_rule(odd_tree.root)[0]
    assert i["format_version"] == FORMAT_VERSION
    assert i["bytes"] == sum(s["bytes"] for s in i["shards"])
    assert [{k: s[k] for k in ("path", "count", "bytes")} for s in i["shards"]] == \
        [{k: s[k] for k in ("path", "count", "bytes")} for s in m["shards"]]
    assert sorted(s["path"] for s in i["skipped"]) == sorted(odd_tree.bad)
    assert all(set(s) == {"path", "reason"} for s in i["skipped"])
    json.dumps(i)  # JSON-ready as is


def test_format_info_lines(odd_built):
    text = format_info(info(odd_built))
    lines = text.splitlines()
    m = read_manifest(odd_built)
    assert lines[0].startswith(f"{odd_built}: {m['count']} images, 10 classes, 1 shard(s), ")
    assert lines[1].startswith("build: source ") and "bytes stored unchanged" in lines[1]
    assert "      0  B  6" in lines
    assert "      5  empty  0" in lines
    assert f"skipped: {len(m['skipped'])}" in lines
    assert any(line.startswith("  with space/bomb.png: decompression bomb") for line in lines)


def test_verify_ok(odd_built):
    rep = verify(odd_built, progress=False)
    assert rep.ok and rep.problems == []
    assert rep.checked_records == read_manifest(odd_built)["count"]
    quick = verify(odd_built, quick=True, progress=False)
    assert quick.ok and quick.checked_records == 0 and quick.checked_shards == 1


def test_verify_names_a_tampered_record(odd_tree, copy):
    rel = "Z10/progressive.jpg"
    index = [p for _, _, p in ls(copy)].index(rel)
    shard, at = locate_image_bytes(copy, (odd_tree.root / rel).read_bytes())
    data = bytearray(shard.read_bytes())
    data[at + 10] ^= 0x01
    shard.write_bytes(bytes(data))
    quick = verify(copy, quick=True, progress=False)
    assert quick.problems == [f"{shard.name}: sha256 does not match the manifest"]
    rep = verify(copy, progress=False)
    assert f"{shard.name}: sha256 does not match the manifest" in rep.problems
    assert f"record {index} ({shard.name}) {rel}: image checksum mismatch" in rep.problems
    assert len(rep.problems) == 2  # only that record
    assert rep.checked_records == read_manifest(copy)["count"]


def test_verify_catches_a_wrong_label_and_a_bad_labels_file(copy):
    m = read_manifest(copy)
    labels = bytearray((copy / "labels.i32").read_bytes())
    labels[4 * 3:4 * 4] = struct.pack("<i", 7)
    (copy / "labels.i32").write_bytes(bytes(labels))
    rep = verify(copy, quick=True, progress=False)
    assert rep.problems == ["labels.i32: sha256 does not match the manifest"]
    m["labels"]["sha256"] = file_sha256(copy / "labels.i32")  # a consistent lie: records catch it
    write_json_atomic(copy / "manifest.json", m)
    rep = verify(copy, progress=False)
    assert len(rep.problems) == 1 and rep.problems[0].startswith("record 3 ")
    assert "label 0 != labels.i32 7" in rep.problems[0]


def test_verify_catches_missing_and_truncated_shards(copy):
    shard = copy / "shard-00000.lmdb"
    shard.write_bytes(shard.read_bytes()[:-4096])
    rep = verify(copy, progress=False)
    assert not rep.ok and rep.problems[0].startswith("shard-00000.lmdb: size ")
    shard.unlink()
    rep = verify(copy, quick=True, progress=False)
    assert rep.problems == ["shard-00000.lmdb: missing"]



@pytest.mark.parametrize("table", ["offsets.u64", "paths.utf8"])
@pytest.mark.parametrize("quick", [True, False])
def test_verify_reports_a_missing_side_table(copy, table, quick):
    # a quick verify passed a dataset without its offsets, which no reader could open
    (copy / table).unlink()
    rep = verify(copy, quick=quick, progress=False)
    assert f"{table}: missing (readers need it)" in rep.problems, rep.problems
    res = CliRunner().invoke(
        main, ["verify", str(copy), "--json", *(["--quick"] if quick else [])])
    assert res.exit_code == 1 and f"{table}: missing" in res.stdout, res.output
    assert f"{table}: missing (readers need it)" in json.loads(res.stdout)["problems"]

def test_verify_catches_extra_records(copy):
    """A shard holding more records than its manifest entry says is damaged too."""
    m = read_manifest(copy)
    shard = copy / m["shards"][0]["path"]
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(struct.pack(">Q", m["shards"][0]["count"]), b"\x80")
    env.close()
    m["bytes"] += shard.stat().st_size - m["shards"][0]["bytes"]
    m["shards"][0]["bytes"] = shard.stat().st_size
    m["shards"][0]["sha256"] = file_sha256(shard)
    write_json_atomic(copy / "manifest.json", m)
    rep = verify(copy, progress=False)
    assert any("records" in p and str(m["shards"][0]["count"]) in p for p in rep.problems), rep.problems


def test_verify_refuses_what_is_not_a_dataset(tmp_path):
    with pytest.raises(FormatError, match="not a packer dataset"):
        verify(tmp_path, progress=False)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(FormatError, match="is damaged"):
        verify(tmp_path, progress=False)


def test_ls_and_cat(odd_tree, odd_built):
    rows = list(ls(odd_built))
    _, _, samples = imagefolder_rule(odd_tree.root)
    assert rows == [(i, lab, p) for i, (p, lab) in enumerate(s for s in samples if s[0] in odd_tree.good)]
    for i, _, p in rows:
        assert cat(odd_built, i) == (odd_tree.root / p).read_bytes()
    assert cat(odd_built, -1) == (odd_tree.root / rows[-1][2]).read_bytes()
    with pytest.raises(IndexError, match=f"record {len(rows)} out of range for a dataset of {len(rows)}"):
        cat(odd_built, len(rows))


def test_verify_decodes_every_record(odd_tree, tmp_path, monkeypatch):
    """Records whose bytes are intact (checksum fine) but do not decode are reported too."""
    import warnings
    from packer.writing import builder as build_mod
    from packer.sources import ImageFolder
    from packer.writing import worker as shardwork
    from packer.writing.check import Checked

    monkeypatch.setattr(shardwork, "check_image",  # a build that validated nothing
                        lambda data, **kw: Checked(data, 1, 1, "JPEG", "RGB"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_mod.build(ImageFolder(odd_tree.root, allow_empty=True), tmp_path / "d", workers=0,
                        progress=False)
    rep = verify(tmp_path / "d", progress=False)
    # everything broken that could be read, and the bomb (over verify's own default limit);
    # every other record lies about its size (the stub's 1x1), which verify reports too
    broken = {rel for rel, kind in odd_tree.bad.items() if kind != "unreadable"}
    decode = [p for p in rep.problems if ": does not decode: " in p]
    assert {p.split(": does not decode")[0].split(") ", 1)[1] for p in decode} == broken
    sizes = [p for p in rep.problems if p not in decode]
    assert sizes and all(p.endswith(", its record says 1x1") for p in sizes), sizes


def test_ctrl_c_in_a_command_that_does_not_resume_does_not_promise_a_resume(odd_built, tmp_path):
    # `packer cat DST 0 -o FIFO` waits in open() for a reader: a real Ctrl-C lands there
    fifo = tmp_path / "out.jpg"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "packer", "cat", str(odd_built), "0", "-o",
                             str(fifo)], env=packer_env(), stderr=subprocess.PIPE, text=True)
    wchan, deadline = Path(f"/proc/{proc.pid}/wchan"), time.time() + 60
    while time.time() < deadline and "partner" not in wchan.read_text():
        time.sleep(0.05)  # until it waits for the FIFO's reader
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "Interrupted.", err
