"""The ``packer`` command through click's CliRunner: exit codes and the lines users read."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from helpers import image_files, imagefolder_rule
from packer import __version__
from packer.cli import Size, main
from packer._util.fsio import write_json_atomic
from packer.format.manifest import FORMAT_VERSION, read_manifest


def invoke(*args, code=0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, f"exit {res.exit_code}, want {code}\n{res.output}\n{res.exception!r}"
    return res


SUMMARY = r"packed (\d+) images in (\d+) classes into (\d+) shard\(s\), [\d.]+ (?:KiB|MiB); skipped (\d+); [\d.]+ s -> "


@pytest.fixture(scope="module")
def built(odd_tree, tmp_path_factory):
    dst = tmp_path_factory.mktemp("cli") / "dst"
    res = invoke("build", odd_tree.root, dst, "--quiet", "--shard-size", "1M", "--allow-empty")
    return dst, res


# -- build -------------------------------------------------------------------------------------

def test_build_output(odd_tree, built):
    dst, res = built
    assert re.fullmatch(SUMMARY + re.escape(str(dst)) + "\n", res.stdout), res.stdout
    assert re.match(SUMMARY, res.stdout).groups() == (str(len(odd_tree.good)), "10", "1", str(len(odd_tree.bad)))
    err = res.stderr.splitlines()
    assert "Warning: class folder 'empty' has no images; it keeps label 5 but contributes no samples" in err
    assert "Warning: class folder 'only_txt' has no images; it keeps label 7 but contributes no samples" in err
    assert err[-1].startswith(f"{len(odd_tree.bad)} file(s) skipped, e.g. with space/bomb.png: "
                              f"decompression bomb")
    assert err[-1].endswith(f"(all listed by `packer info {dst}`)")
    assert "%|" not in res.stderr  # --quiet: no progress bar


def test_build_shows_progress_unless_quiet(photo_src, tmp_path):
    res = invoke("build", photo_src, tmp_path / "d")
    n = len(image_files(photo_src))
    assert "packing src" in res.stderr and f"{n}/{n}" in res.stderr
    assert res.stdout.count("\n") == 1 and re.match(SUMMARY, res.stdout)
    assert res.stderr.count("skipped") <= 2  # the bar's postfix; no skip report line
    assert "file(s) skipped" not in res.stderr


def test_build_errors(photo_src, built, tmp_path):
    dst, _ = built
    res = invoke("build", tmp_path / "nope", tmp_path / "d", code=1)
    assert res.stderr == f"Error: source folder {tmp_path / 'nope'} does not exist or is not a folder\n"
    res = invoke("build", photo_src, dst, "-q", code=1)
    assert res.stderr == (f"Error: {dst} already holds a finished dataset (of another source or "
                          f"options, or an older packer); replace it with --overwrite\n")
    assert invoke("build", photo_src, tmp_path / "d", "--part", "4/4", code=1).stderr == \
        "Error: part 4/4: K must be in 0..N-1 (parts are numbered from 0)\n"
    assert "Error: --shard-size must be between 1 MiB and 64 GiB" in \
        invoke("build", photo_src, tmp_path / "d", "--shard-size", "10K", code=1).stderr
    assert "'lots' is not a size (examples: 512M, 1G, 1073741824)" in \
        invoke("build", photo_src, tmp_path / "d", "--shard-size", "lots", code=2).stderr
    assert "Invalid value for '--max-side': 8 is not in the range x>=16" in \
        invoke("build", photo_src, tmp_path / "d", "--max-side", "8", code=2).stderr
    invoke("build", photo_src, tmp_path / "d", "--quality", "101", code=2)
    invoke("build", photo_src, tmp_path / "d", "--list", tmp_path / "no-such-list", code=2)
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_build_overwrite(photo_src, tmp_path):
    invoke("build", photo_src, tmp_path / "d", "-q")
    before = read_manifest(tmp_path / "d")
    invoke("build", photo_src, tmp_path / "d", "-q")  # the same build again: done, unchanged
    assert read_manifest(tmp_path / "d") == before
    invoke("build", photo_src, tmp_path / "d", "-q", "--shard-size", "2M", code=1)  # another
    res = invoke("build", photo_src, tmp_path / "d", "-q", "--overwrite", "--shard-size", "1M")
    assert re.match(SUMMARY, res.stdout).group(3) != "1"
    assert read_manifest(tmp_path / "d")["options"]["shard_size"] == 1 << 20


def test_build_strict(odd_tree, tmp_path):
    res = invoke("build", odd_tree.root, tmp_path / "d", "--strict", "-q", "--allow-empty", code=1)
    assert res.stderr.splitlines()[-1].startswith("Error: strict: with space/bomb.png: decompression bomb")
    assert res.stderr.rstrip().endswith("no dataset was written (fix or remove the file, then re-run)")
    assert not (tmp_path / "d" / "manifest.json").exists()
    assert invoke("verify", tmp_path / "d", code=1).stderr.startswith("Error: ")


def test_build_list_and_transcode(odd_tree, tmp_path):
    lst = tmp_path / "l.tsv"
    lst.write_text("B/a.jpg\t1\nZ9/png16.png\t0\nZ10/cmyk.jpg\t1\n", encoding="utf-8")
    res = invoke("build", odd_tree.root, tmp_path / "d", "--list", lst, "-q",
                 "--max-side", "64", "--quality", "80")
    assert re.match(SUMMARY, res.stdout).groups()[:2] == ("3", "2")
    m = read_manifest(tmp_path / "d")
    assert m["classes"] == ["0", "1"] and m["options"]["transcode"]["quality"] == 80
    assert invoke("ls", tmp_path / "d").stdout == "0\t1\tB/a.jpg\n1\t0\tZ9/png16.png\n2\t1\tZ10/cmyk.jpg\n"
    bad = tmp_path / "bad.tsv"
    bad.write_text("B/a.jpg 1\n")
    assert invoke("build", odd_tree.root, tmp_path / "e", "--list", bad, code=1).stderr == \
        f"Error: {bad}:1: expected 'relative/path<TAB>label', got 'B/a.jpg 1'\n"


def test_parts_and_merge(photo_src, tmp_path):
    for k in range(2):
        invoke("build", photo_src, tmp_path / f"p{k}", "--part", f"{k}/2", "-q", "--shuffle", "--seed", "9")
    res = invoke("merge", tmp_path / "p0", tmp_path / "p1", tmp_path / "all")
    n = len(image_files(photo_src))
    assert re.fullmatch(rf"merged 2 parts: {n} images, \d+ shards -> {re.escape(str(tmp_path / 'all'))}\n",
                        res.stdout)
    paths = [line.split("\t")[2] for line in invoke("ls", tmp_path / "all").stdout.splitlines()]
    assert sorted(paths) == image_files(photo_src)
    assert invoke("verify", tmp_path / "all", "-q").stdout.startswith("OK: ")
    assert "more than once" in invoke("merge", tmp_path / "p0", tmp_path / "p0", tmp_path / "x", code=1).stderr


# -- info, verify, ls, cat ---------------------------------------------------------------------

def test_info(odd_tree, built):
    dst, _ = built
    text = invoke("info", dst).stdout
    m = read_manifest(dst)
    assert text.startswith(f"{dst}: {m['count']} images, 10 classes, 1 shard(s), ")
    assert "\nclasses:\n" in text and "\nshards:\n  shard-00000.lmdb  " in text
    assert f"\nskipped: {len(odd_tree.bad)}\n" in text
    i = json.loads(invoke("info", dst, "--json").stdout)
    assert i["count"] == m["count"] and i["bytes"] == m["bytes"]
    assert i["classes"] == imagefolder_rule(odd_tree.root)[0]
    assert i["format_version"] == FORMAT_VERSION
    assert [set(s) >= {"path", "count", "bytes"} for s in i["shards"]] == [True]
    assert sorted(s["path"] for s in i["skipped"]) == sorted(odd_tree.bad)
    assert all(set(s) == {"path", "reason"} for s in i["skipped"])


def test_info_refuses_newer_major(built, tmp_path):
    dst = tmp_path / "d"
    shutil.copytree(built[0], dst)
    m = read_manifest(dst)
    m["format_version"] = "2.1"
    write_json_atomic(dst / "manifest.json", m)
    for cmd in (["info"], ["info", "--json"], ["verify"], ["ls"], ["cat"]):
        res = invoke(*cmd, dst, *(["0"] if cmd == ["cat"] else []), code=1)
        assert res.stderr == (f"Error: {dst / 'manifest.json'} was written in packer format 2.1, newer "
                              f"than this packer understands ({FORMAT_VERSION}); upgrade packer (pip install -U packer-lmdb)\n")
        assert res.stdout == ""


def test_verify(odd_tree, built, tmp_path):
    dst, _ = built
    n = read_manifest(dst)["count"]
    assert invoke("verify", dst, "-q").stdout == f"OK: 1 shards and {n} records verified in {dst}\n"
    assert invoke("verify", dst, "--quick", "-q").stdout == (
        f"OK: 1 shards verified in {dst}; records were not read, decoded or compared with "
        f"labels.i32 (quick)\n")
    # tamper with one byte of one stored image
    bad = tmp_path / "bad"
    shutil.copytree(dst, bad)
    rel = "_x/sub dir/s.jpg"
    index = [line.split("\t")[2] for line in invoke("ls", bad).stdout.splitlines()].index(rel)
    src = (odd_tree.root / rel).read_bytes()
    shard = bad / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    probe = src[len(src) // 2:len(src) // 2 + 64]  # entropy-coded data: unique to this image
    assert data.count(probe) == 1
    at = data.find(probe)
    data[at + 5] ^= 0x40
    shard.write_bytes(bytes(data))
    res = invoke("verify", bad, "-q", code=1)
    assert res.stderr.splitlines() == [
        "shard-00000.lmdb: sha256 does not match the manifest",
        f"record {index} (shard-00000.lmdb) {rel}: image checksum mismatch",
        f"Error: 2 problem(s) in {bad}"]
    assert res.stdout == ""
    res = invoke("verify", bad, "--quick", "-q", code=1)
    assert res.stderr.splitlines() == ["shard-00000.lmdb: sha256 does not match the manifest",
                                       f"Error: 1 problem(s) in {bad}"]


def test_verify_unfinished_and_non_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".packer-build.json").write_text("{}")
    assert invoke("verify", tmp_path / "d", code=1).stderr == (
        f"Error: {tmp_path / 'd'} is an unfinished build (no manifest.json yet); re-run the same "
        f"`packer build` command to resume it\n")
    assert invoke("info", tmp_path, code=1).stderr == \
        f"Error: {tmp_path} is not a packer dataset: {tmp_path / 'manifest.json'} not found\n"
    invoke("verify", tmp_path / "nope", code=2)  # click: the folder must exist


def test_ls(odd_tree, built):
    dst, _ = built
    out = invoke("ls", dst).stdout
    _, _, samples = imagefolder_rule(odd_tree.root)
    want = [(p, lab) for p, lab in samples if p in odd_tree.good]
    assert out == "".join(f"{i}\t{lab}\t{p}\n" for i, (p, lab) in enumerate(want))


def test_cat(odd_tree, built, tmp_path):
    dst, _ = built
    rel = "é/café ü.jpg"
    lines = invoke("ls", dst).stdout.splitlines()
    index = [line.split("\t")[2] for line in lines].index(rel)
    res = invoke("cat", dst, index)
    assert res.stdout_bytes == (odd_tree.root / rel).read_bytes()
    out = tmp_path / "x.jpg"
    res = invoke("cat", dst, index, "-o", out)
    assert res.stdout_bytes == b"" and out.read_bytes() == (odd_tree.root / rel).read_bytes()
    res = invoke("cat", dst, len(lines), code=1)
    assert res.stderr == f"Error: record {len(lines)} out of range for a dataset of {len(lines)}\n"
    invoke("cat", dst, "x", code=2)


# -- the command itself ------------------------------------------------------------------------

def test_python_dash_m_help():
    proc = subprocess.run([sys.executable, "-m", "packer", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: packer [OPTIONS] COMMAND [ARGS]...")
    for cmd in ("build", "merge", "info", "verify", "ls", "cat"):
        assert re.search(rf"^  {cmd}\s+\S", proc.stdout, re.M), cmd


def test_every_command_is_documented():
    top = invoke("--help").stdout
    for name, cmd in main.commands.items():
        assert cmd.help and len(cmd.help.split()) >= 5, f"`packer {name}` has no real help text"
        assert re.search(rf"^  {re.escape(name)}\s+\S", top, re.M), f"{name} missing from packer --help"
        res = invoke(name, "--help")
        assert res.stdout.startswith(f"Usage: main {name} ") or res.stdout.startswith(f"Usage: packer {name} ")
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                assert p.help, f"`packer {name} {p.opts[0]}` has no help"


def test_version():
    assert invoke("--version").stdout.startswith(f"packer {__version__} (python ")


@pytest.mark.parametrize("text, want", [
    ("1073741824", 1 << 30), ("1G", 1 << 30), ("512M", 512 << 20), ("1.5 GiB", 3 << 29),
    ("64k", 64 << 10), ("2TB", 2 << 40), ("100b", 100)])
def test_size_param(text, want):
    assert Size().convert(text, None, None) == want


def test_size_param_rejects_garbage():
    with pytest.raises(click.BadParameter, match="is not a size"):
        Size().convert("M", None, None)


def test_max_pixels_must_be_positive(tmp_path):
    from click.testing import CliRunner
    from packer.cli import main
    (tmp_path / "src" / "a").mkdir(parents=True)
    r = CliRunner().invoke(main, ["build", str(tmp_path / "src"), str(tmp_path / "dst"), "--max-pixels", "0"])
    assert r.exit_code == 2 and "--max-pixels" in r.output


# -- --json on every command that reports --------------------------------------------------------

def test_json_output_of_every_reporting_command(photo_src, tmp_path):
    """One JSON object on stdout (ls: one per line), the keys docs/cli.md lists; no bar."""
    d = tmp_path / "d"
    b = json.loads(invoke("build", photo_src, d, "--json", "--shard-size", "1M").stdout)
    assert set(b) == {"dst", "count", "bytes", "shards", "task", "seconds", "resumed_shards",
                      "skipped", "dropped_count", "dropped"}
    assert b["count"] == 48 and b["task"] == "classification" and b["skipped"] == []
    v = json.loads(invoke("verify", d, "--json").stdout)
    assert v == {"path": str(d), "ok": True, "checked_shards": b["shards"], "checked_records": 48,
                 "problems": [], "skipped_checks": ""}
    rows = [json.loads(line) for line in invoke("ls", d, "--json").stdout.splitlines()]
    assert len(rows) == 48 and set(rows[0]) == {"index", "path", "width", "height", "label"}
    m = json.loads(invoke("merge", d, tmp_path / "m", "--json").stdout)
    assert m == {"dst": str(tmp_path / "m"), "parts": [str(d)], "count": 48, "shards": b["shards"],
                 "missing_parts": []}
    s = json.loads(invoke("stage", d, tmp_path / "s", "--json").stdout)
    assert s["target"] == str(tmp_path / "s") and s["wrote_manifest"] and s["bytes_total"] > 0
    u = json.loads(invoke("unstage", tmp_path / "s", "--json").stdout)
    assert u["target"] == str(tmp_path / "s") and u["removed_dir"]
    assert u["bytes_freed"] >= s["bytes_total"]  # the data files, plus manifest and marker
    # A failed verify still prints its report, and exits 1.
    shard = next(d.glob("shard-*.lmdb"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = invoke("verify", d, "--json", code=1)
    bad = json.loads(res.stdout)
    assert bad["ok"] is False and any("sha256" in p for p in bad["problems"])


# -- what a newcomer tried: a negative INDEX, Ctrl-C, a full stdout, examples in --help ---------

def test_cat_counts_a_negative_index_from_the_end(built):
    """`packer cat DST -1` said `No such option '-1'` (and `-999`: `No such option '-9'`),
    though the library reads record -1 as the last one."""
    dst, _ = built
    n = len(invoke("ls", dst).stdout.splitlines())
    assert invoke("cat", dst, "-1").stdout_bytes == invoke("cat", dst, n - 1).stdout_bytes
    assert invoke("cat", dst, f"-{n + 1}", code=1).stderr == \
        f"Error: record -{n + 1} out of range for a dataset of {n}\n"
    assert "No such option '--bogus'" in invoke("cat", dst, "0", "--bogus", code=2).stderr
    assert "No such option '--outptu'" in invoke("cat", "--outptu", "x", dst, "0", code=2).stderr
    out = dst.parent / "last.jpg"
    invoke("cat", dst, "-1", "-o", out)  # an option after a negative INDEX
    assert out.read_bytes() == invoke("cat", dst, n - 1).stdout_bytes


def test_doctor_ctrl_c_is_interrupted_not_aborted(monkeypatch):
    """`packer doctor --cuda` (seconds importing torch) stopped with Ctrl-C printed click's
    `Aborted!` and exited 1; docs/cli.md promises `Interrupted.` and 130, as every command."""
    import packer.doctor

    def interrupted(**kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(packer.doctor, "doctor", interrupted)
    assert invoke("doctor", "--cuda", code=130).stderr == "\nInterrupted.\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["build", "--help"], ["doctor"]])
def test_a_full_stdout_is_one_line_not_a_traceback(args):
    """`packer --help > /dev/full` (and `--version`, `doctor`) ended in a traceback."""
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([sys.executable, "-m", "packer", *args], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, "Error: No space left on device\n")


def test_commands_of_several_arguments_show_examples():
    """`packer merge --help` (PARTS... DST) and `packer cat --help` (DST INDEX) showed no
    example of the arguments in order, as build and stage do."""
    for name, cmd in main.commands.items():
        args = [p for p in cmd.params if isinstance(p, click.Argument)]
        if len(args) > 1 or any(p.nargs == -1 for p in args):
            text = invoke(name, "--help").stdout
            assert "\n  Examples:\n" in text, f"`packer {name} --help` shows no example"
            assert f"\n    packer {name} " in text.split("\n  Examples:\n")[1].split("\n\n")[0], name
