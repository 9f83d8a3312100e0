"""Crash safety at the edges: a resumed build whose source files changed size, a file-size limit
(``ulimit -f``) met mid-shard, and the journal's cost over many shards."""
from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from crashlib import env, folder_state
from helpers import quiet_build
from packer import verify
from packer.demo import make_image_folder
from packer.format.manifest import read_manifest
from packer.writing import journal
from packer.writing.packing import Packing
from packer.writing.shard import ShardWriter
from PIL import Image

MiB = 1 << 20


def interrupted_after_two_shards(src, dst, monkeypatch) -> None:
    """A build of ``src`` into ``dst`` stopped (KeyboardInterrupt) as its third shard finishes."""
    real, calls = ShardWriter.finish, []

    def finish(self):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(self)
    with monkeypatch.context() as mp:
        mp.setattr(ShardWriter, "finish", finish)
        with pytest.raises(KeyboardInterrupt):
            quiet_build(src, dst, shard_size=MiB)


def test_a_resume_after_the_files_changed_size_never_replaces_a_finished_shard(tmp_path, monkeypatch):
    """Killed after two shards; then the images of those two are re-saved smaller, so that the
    new plan puts them in one shard ending where the journal stopped (plan index 1). The rest
    used to be written from shard-00001.lmdb on, over the journaled one: a manifest listing
    shard-00001.lmdb twice, which no reader opens."""
    src = make_image_folder(tmp_path / "src", images=48, classes=4, seed=1)
    dst = tmp_path / "d"
    interrupted_after_two_shards(src, dst, monkeypatch)
    done = journal.read(dst)["next_entry"]
    files = sorted(src.rglob("*.jpg"))
    for p in files[:done]:  # together just under 1 MiB: one planned shard, ending at `done`
        im = Image.open(p)
        im.thumbnail((64, 64))
        im.save(p, quality=50)
        with open(p, "ab") as f:  # bytes after the JPEG's end: the same image
            f.write(bytes(MiB // done - p.stat().st_size))
    m = quiet_build(src, dst, shard_size=MiB).manifest
    names = [s["path"] for s in m["shards"]]
    assert len(set(names)) == len(names) and names[:2] == ["shard-00000.lmdb", "shard-00001.lmdb"]
    assert verify(dst, progress=False).ok and read_manifest(dst)["count"] == 48


def limited(nbytes: int):
    """For ``preexec_fn``: this child's files may grow to ``nbytes`` at most."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


@pytest.mark.parametrize("jobs", ["0", "2"])
def test_a_file_size_limit_is_one_error_and_the_rerun_resumes(tmp_path, jobs):
    """``ulimit -f`` below a shard's size: LMDB's commit is cut short (EIO, not ENOSPC: the
    disk has room). It used to end in a traceback; now one ``Error:`` line, and the same
    command without the limit finishes the same dataset as an unlimited build."""
    src = make_image_folder(tmp_path / "src", images=48, classes=4, seed=1)
    argv = lambda d: [sys.executable, "-m", "packer", "build", str(src), str(d), "-q", "-j",
                      jobs, "--shard-size", "1M"]
    assert subprocess.run(argv(tmp_path / "ref"), env=env(), capture_output=True).returncode == 0
    dst = tmp_path / "d"
    proc = subprocess.run(argv(dst), env=env(), capture_output=True, text=True,
                          preexec_fn=limited(600_000), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("Error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "ulimit -f" in proc.stderr and not (dst / "manifest.json").exists()
    again = subprocess.run(argv(dst), env=env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert folder_state(dst) == folder_state(tmp_path / "ref")


def test_the_journal_grows_by_what_each_shard_adds(tmp_path):
    """300 shards of 20 skipped images each: the journal used to be rewritten whole (and
    fsynced twice) per shard, all the skips so far again each time: ~100 MB written for a
    0.7 MB journal, minutes for a build of thousands of shards. Now a line per shard."""
    fp = "f" * 64
    run = Packing(tmp_path, fp, journal.load(tmp_path, fp), shard_size=MiB, strict=False,
                  schema={"task": "classification", "fields": [{"name": "label", "type": "int"}]})
    written = wchar()
    for i in range(300):
        for k in range(20):
            run.skip(i * 21 + k, f"class_{i:03d}/img_{k:04d}.jpg", "not an image packer opens")
        run.add_shard({"path": f"shard-{i:05d}.lmdb", "count": 1, "bytes": 1, "sha256": "0" * 64},
                      (i + 1) * 21)
    written = wchar() - written
    j = journal.read(tmp_path)
    assert len(j["shards"]) == 300 and len(j["skipped"]) == 6000 and j["next_entry"] == 6300
    assert j["shards"][-1]["next_entry"] == 6300 and j["skipped"] == run.skipped
    assert written < 3 * (tmp_path / journal.JOURNAL).stat().st_size, written


def wchar() -> int:
    """Bytes this process has written so far (``/proc/self/io``)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except OSError:
        pytest.skip("no /proc/self/io here")


def test_a_journal_line_cut_short_by_a_kill_is_ignored_and_the_run_goes_on(tmp_path, monkeypatch):
    """Killed while appending a shard's line: the re-run resumes after the shards before it,
    and its own lines follow a complete journal (it is rewritten whole on loading)."""
    src = make_image_folder(tmp_path / "src", images=48, classes=4, seed=1)
    ref = quiet_build(src, tmp_path / "ref", shard_size=MiB).manifest
    dst = tmp_path / "d"
    interrupted_after_two_shards(src, dst, monkeypatch)
    with open(dst / journal.JOURNAL, "a") as f:
        f.write('{"shard": {"path": "shard-00002.lmdb", "cou')
    assert len(journal.read(dst)["shards"]) == 2
    r = quiet_build(src, dst, shard_size=MiB)
    assert r.resumed_shards == 2 and r.manifest["shards"] == ref["shards"]
    assert verify(dst, progress=False).ok and not (dst / journal.JOURNAL).exists()
