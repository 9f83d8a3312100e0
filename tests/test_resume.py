"""Crash safety and resume: killed builds never look finished; re-running finishes them."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import image_files, run_packer
from packer.writing import packing as packing_mod
from packer.writing.journal import JOURNAL, read as read_journal
from packer.cli import main
from packer.errors import FormatError, PackerError
from packer.format.manifest import read_manifest
from packer.info import ls, verify
from packer.reading.reader import ShardReader
from packer.writing.shard import ShardWriter

import helpers


def quiet_build(src, dst, **kw):
    kw.setdefault("shard_size", 1 << 20)
    return helpers.quiet_build(src, dst, **kw)


def assert_not_finished(dst: Path) -> None:
    """Nothing accepts ``dst`` as a dataset."""
    assert not (dst / "manifest.json").exists()
    for open_it in (read_manifest, ShardReader, lambda d: verify(d, progress=False)):
        with pytest.raises(FormatError):
            open_it(dst)


def assert_one_record_per_image(dst: Path, src: Path) -> None:
    got = [p for _, _, p in ls(dst)]
    assert got == image_files(src), "not exactly one record per source image, in order"
    rep = verify(dst, progress=False)
    assert rep.ok, rep.problems


def big_tree(base: Path, photo_src: Path, copies: int) -> Path:
    """``copies`` x the photo folder, as symlinked class folders: a big source for free."""
    src = base / "big"
    src.mkdir()
    for k in range(copies):
        for cls in sorted(photo_src.iterdir()):
            (src / f"{cls.name}_{k}").symlink_to(cls, target_is_directory=True)
    return src


class Crash(Exception):
    pass


def crash_on_finish(monkeypatch, after: int, exc=KeyboardInterrupt):
    """Make the ``after+1``-th shard finish raise (after the first ``after`` finished)."""
    real = ShardWriter.finish
    calls = {"n": 0}

    def finish(self):
        calls["n"] += 1
        if calls["n"] > after:
            raise exc()
        return real(self)
    monkeypatch.setattr(ShardWriter, "finish", finish)


# -- in-process failure injection --------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [False, True])
def test_interrupted_build_resumes_after_finished_shards(photo_src, tmp_path, monkeypatch, shuffle):
    dst = tmp_path / "d"
    with monkeypatch.context() as mp:
        crash_on_finish(mp, after=2)  # in-process (workers=0): the order shards finish is fixed
        with pytest.raises(KeyboardInterrupt):
            quiet_build(photo_src, dst, shuffle=shuffle, seed=5, workers=0, shard_size=1 << 20)
    assert_not_finished(dst)
    with pytest.raises(FormatError, match="unfinished build .* re-run the same `packer build`"):
        read_manifest(dst)
    assert sorted(p.name for p in dst.glob("shard-*")) == ["shard-00000.lmdb", "shard-00001.lmdb"]
    assert not list(dst.glob(".shard-*"))  # the interrupted shard's temp files are gone
    r = quiet_build(photo_src, dst, shuffle=shuffle, seed=5, workers=2, shard_size=1 << 20)
    assert r.resumed_shards == 2
    if shuffle:
        ref = quiet_build(photo_src, tmp_path / "ref", shuffle=True, seed=5, shard_size=1 << 20)
        assert [p for _, _, p in ls(dst)] == [p for _, _, p in ls(tmp_path / "ref")]
        assert [s["sha256"] for s in r.manifest["shards"]] == [s["sha256"] for s in ref.manifest["shards"]]
        assert sorted(p for _, _, p in ls(dst)) == image_files(photo_src)
        assert verify(dst, progress=False).ok
    else:
        assert_one_record_per_image(dst, photo_src)
    assert not (dst / JOURNAL).exists()


@pytest.mark.parametrize("workers", [0, 2])
def test_ctrl_c_just_after_a_shard_is_journaled_keeps_it(photo_src, tmp_path, monkeypatch,
                                                          workers):
    """Ctrl-C landing after the journal recorded a shard, before the builder moved on: the
    shard stays (it is the journal's now) and the re-run resumes after it. It used to be
    removed as "finished but not taken", so the re-run found the journal broken and started
    over (seen once in CI: `test_ctrl_c_exits_130_and_resumes`)."""
    dst = tmp_path / "d"
    real = packing_mod.Packing.add_shard

    def add_then_interrupt(self, shard, next_entry):
        real(self, shard, next_entry)
        if shard is not None:
            raise KeyboardInterrupt
    with monkeypatch.context() as mp:
        mp.setattr(packing_mod.Packing, "add_shard", add_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            quiet_build(photo_src, dst, workers=workers, shard_size=1 << 20)
    assert (dst / "shard-00000.lmdb").exists()
    r = quiet_build(photo_src, dst, workers=workers, shard_size=1 << 20)
    assert r.resumed_shards == 1
    assert_one_record_per_image(dst, photo_src)


def test_skips_before_the_crash_are_kept_once(odd_tree, tmp_path, monkeypatch):
    dst = tmp_path / "d"
    with monkeypatch.context() as mp:
        crash_on_finish(mp, after=0, exc=Crash)
        with pytest.raises(Crash):
            quiet_build(odd_tree.root, dst, shard_size=1 << 20)
    m = quiet_build(odd_tree.root, dst).manifest
    assert sorted(s["path"] for s in m["skipped"]) == sorted(odd_tree.bad)
    assert m["count"] == len(odd_tree.good)


def test_crash_between_labels_and_manifest(photo_src, tmp_path, monkeypatch):
    dst = tmp_path / "d"
    real = packing_mod.write_json_atomic

    def no_manifest(path, obj):
        if Path(path).name == "manifest.json":
            raise Crash()
        return real(path, obj)
    with monkeypatch.context() as mp:
        mp.setattr(packing_mod, "write_json_atomic", no_manifest)
        with pytest.raises(Crash):
            quiet_build(photo_src, dst)
    assert (dst / "labels.i32").exists()
    assert_not_finished(dst)
    quiet_build(photo_src, dst)
    assert_one_record_per_image(dst, photo_src)


def test_damaged_finished_shard_is_rebuilt(photo_src, tmp_path, monkeypatch):
    dst = tmp_path / "d"
    with monkeypatch.context() as mp:
        crash_on_finish(mp, after=3)
        with pytest.raises(KeyboardInterrupt):
            quiet_build(photo_src, dst)
    p = dst / "shard-00001.lmdb"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    (dst / "shard-00007.lmdb").write_bytes(b"left by some earlier attempt")
    r = quiet_build(photo_src, dst)
    assert r.resumed_shards == 1  # shard 0 kept, everything from the damaged one redone
    assert_one_record_per_image(dst, photo_src)
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        ["manifest.json", "labels.i32", "offsets.u64", "column-width.i32", "column-height.i32", "paths.u64", "paths.utf8"] + [s["path"] for s in r.manifest["shards"]])


def test_different_command_restarts_cleanly(photo_src, tmp_path, monkeypatch):
    dst = tmp_path / "d"
    with monkeypatch.context() as mp:
        crash_on_finish(mp, after=2)
        with pytest.raises(KeyboardInterrupt):
            quiet_build(photo_src, dst)
    r = quiet_build(photo_src, dst, shard_size=2 << 20)  # other options: not a resume
    assert r.resumed_shards == 0
    assert_one_record_per_image(dst, photo_src)
    assert all(s["bytes"] > (2 << 20) for s in r.manifest["shards"][:-1])


def test_changed_source_restarts_cleanly(photo_src, tmp_path, monkeypatch):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(photo_src, src)
    dst = tmp_path / "d"
    with monkeypatch.context() as mp:
        crash_on_finish(mp, after=2)
        with pytest.raises(KeyboardInterrupt):
            quiet_build(src, dst)
    shutil.copy(src / "class_00/img_00000.jpg", src / "class_01/new.jpg")
    assert quiet_build(src, dst).resumed_shards == 0
    assert_one_record_per_image(dst, src)


def test_interrupted_overwrite_leaves_no_finished_dataset(photo_src, tmp_path, monkeypatch):
    dst = tmp_path / "d"
    quiet_build(photo_src, dst)
    with monkeypatch.context() as mp:
        crash_on_finish(mp, after=1)
        with pytest.raises(KeyboardInterrupt):
            quiet_build(photo_src, dst, overwrite=True, shard_size=2 << 20)
    assert_not_finished(dst)
    quiet_build(photo_src, dst, shard_size=2 << 20)  # the same command as the interrupted one resumes
    assert_one_record_per_image(dst, photo_src)


def test_overwrite_removes_the_manifest_before_anything_else(photo_src, tmp_path, monkeypatch):
    """Killed while removing the old dataset: the old manifest must already be gone."""
    dst = tmp_path / "d"
    quiet_build(photo_src, dst)
    real_unlink = Path.unlink

    def unlink(self, *a, **kw):
        if self.parent == dst and self.name.startswith("shard-"):
            raise Crash()
        return real_unlink(self, *a, **kw)
    with monkeypatch.context() as mp:
        mp.setattr(Path, "unlink", unlink)
        with pytest.raises(Crash):
            quiet_build(photo_src, dst, overwrite=True)
    assert_not_finished(dst)


# -- real kills ----------------------------------------------------------------------------------

def start_build(src, dst, *extra):
    # As a shell starts a foreground job: Ctrl-C at its default, whatever this process has
    # (an ignored SIGINT is inherited across exec, and Python then installs no handler).
    return subprocess.Popen([sys.executable, "-m", "packer", "build", str(src), str(dst),
                             "--shard-size", "1M", "-q", *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def kill_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_kill_9_at_random_points_then_rerun(photo_src, tmp_path):
    src = big_tree(tmp_path, photo_src, copies=5)  # 240 images, ~17 shards of 1 MiB
    ref = tmp_path / "ref"
    t0 = time.perf_counter()
    run_packer("build", src, ref, "--shard-size", "1M", "-q")
    full = time.perf_counter() - t0
    want = [p for _, _, p in ls(ref)]
    assert want == image_files(src)
    outcomes = []
    for seed in range(6):
        rng = random.Random(seed)
        dst = tmp_path / f"d{seed}"
        extra = ["-j", "0"] if seed % 2 else []
        for attempt in range(1 + seed % 3):  # kill some builds more than once before finishing
            proc = start_build(src, dst, *extra)
            time.sleep(rng.uniform(0.1, 1.0) * full)
            if rng.random() < 0.5:
                os.kill(proc.pid, signal.SIGKILL)  # the main process only; workers orphaned
            else:
                kill_group(proc, signal.SIGKILL)   # everything at once, like a power cut
            proc.wait(timeout=60)
            kill_group(proc, signal.SIGKILL)       # then the orphaned workers we started
            proc.communicate(timeout=60)
            finished = (dst / "manifest.json").exists()
            outcomes.append((proc.returncode, finished))
            if finished:  # the kill came too late: the dataset must then be whole
                assert verify(dst, progress=False).ok
                break
            assert_not_finished(dst)
        rerun = run_packer("build", src, dst, "--shard-size", "1M", "-q", *extra, check=False)
        assert rerun.returncode == 0, rerun.stderr  # finished or not: the same command is done
        assert rerun.stdout.strip().splitlines()[-1].startswith(f"packed {len(want)} images")
        assert [p for _, _, p in ls(dst)] == want
        assert verify(dst, progress=False).ok
        if not finished:
            assert not list(dst.glob(".*")), "temp files left in a finished dataset"
        digests = [s["sha256"] for s in read_manifest(dst)["shards"]]
        assert digests == [s["sha256"] for s in read_manifest(ref)["shards"]]  # reproducible
    assert any(rc == -signal.SIGKILL and not fin for rc, fin in outcomes), outcomes


def finished_shards(dst) -> int:
    """Shards the journal lists as finished (it exists from the build's start)."""
    try:
        return len(read_journal(dst)["shards"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


@pytest.mark.slow
def test_ctrl_c_exits_130_and_resumes(photo_src, tmp_path):
    src = big_tree(tmp_path, photo_src, copies=40)  # 1,920 images: seconds of work left
    dst = tmp_path / "d"
    proc = start_build(src, dst, "--workers", "1")  # one worker: the build outlasts the signal
    deadline = time.time() + 60
    while not finished_shards(dst) and time.time() < deadline:  # after a finished shard
        time.sleep(0.01)
    # Frozen first, so that a test process starved by a busy machine cannot lose the race
    # with the build; the Ctrl-C is then delivered the moment the build runs again.
    kill_group(proc, signal.SIGSTOP)
    kill_group(proc, signal.SIGINT)  # Ctrl-C goes to the whole foreground process group
    kill_group(proc, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    kill_group(proc, signal.SIGKILL)
    if proc.returncode == 0:
        pytest.fail("the build finished before Ctrl-C could interrupt it; make the source bigger")
    assert proc.returncode == 130, err
    assert err.strip().endswith("Interrupted. Re-run the same command to resume."), err
    assert "Traceback" not in err
    assert_not_finished(dst)
    rerun = run_packer("build", src, dst, "--shard-size", "1M", "-q")
    assert rerun.stdout.startswith("resumed after ")
    assert_one_record_per_image(dst, src)


@pytest.mark.slow
def test_a_build_worker_killed_is_a_message_and_the_rerun_resumes(photo_src, tmp_path):
    """The OOM killer takes a build worker: one message that says what happened and what to
    do (no BrokenProcessPool traceback), the finished shards kept for the re-run."""
    src = big_tree(tmp_path, photo_src, copies=40)
    dst = tmp_path / "d"
    proc = start_build(src, dst, "--workers", "2")
    deadline = time.time() + 60
    while not finished_shards(dst) and time.time() < deadline:
        time.sleep(0.01)
    kill_group(proc, signal.SIGSTOP)  # frozen, so the build cannot finish meanwhile
    workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    kill_group(proc, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    kill_group(proc, signal.SIGKILL)
    assert workers and proc.returncode == 1, err
    assert err.startswith("Error: a build worker process died") and "--workers N" in err, err
    assert "Traceback" not in err
    rerun = run_packer("build", src, dst, "--shard-size", "1M", "-q")
    assert rerun.stdout.startswith("resumed after ")
    assert_one_record_per_image(dst, src)


# -- a full disk -----------------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MiB tmpfs in tmp_path (needs root; CI must run it, so there it fails instead)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("the disk-full test needs root (to mount a tmpfs) and CI must run it")
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs as root ({res.stderr.strip()}): the disk-full test "
                    f"needs CAP_SYS_ADMIN (e.g. docker run --privileged)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_disk_full_stops_clearly_keeps_shards_and_resumes(photo_src, tiny_disk, jobs):
    # -j 2: two shards are written at once and either may hit the full disk first; shards
    # finished but not yet in the journal are removed: what stays is what the journal lists
    dst = tiny_disk / "dst"
    args = ["build", str(photo_src), str(dst), "--shard-size", "1M", "-q", "-j", jobs]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith("Error: disk full while writing "), res.stderr
    assert "re-run the same command to resume" in res.stderr
    assert "Traceback" not in res.output
    kept = sorted(p.name for p in dst.glob("shard-*.lmdb"))
    journal = read_journal(dst)
    assert (kept or jobs != "1") and [s["path"] for s in journal["shards"]] == kept
    assert not list(dst.glob(".shard-*"))  # the unfinished shard's temp files are removed
    assert_not_finished(dst)
    # more space (the same tmpfs, grown), the same command: resumes after the kept shards
    subprocess.run(["mount", "-o", "remount,size=64m", str(tiny_disk)], check=True)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    if kept:
        assert lines.pop(0) == f"resumed after {len(kept)} finished shard(s)", lines
    assert lines[0].startswith(f"packed {len(image_files(photo_src))} images in 4 classes")
    assert_one_record_per_image(dst, photo_src)


def test_disk_full_at_a_shards_first_page_leaves_no_temp_file(tiny_disk):
    # the disk fills between creating the shard's temp file and LMDB's first write (its meta
    # pages): the constructor fails, no caller holds a writer to abort, so it cleans up itself
    with open(tiny_disk / "filler", "wb") as f:
        with pytest.raises(OSError):
            while True:
                f.write(b"x" * 65536)
                f.flush()
    with pytest.raises(PackerError, match="disk full while writing"):
        ShardWriter(tiny_disk / "shard-00000.lmdb", expected_bytes=1 << 20)
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["filler"]


def test_disk_full_is_a_packer_error_in_the_library(photo_src, tiny_disk):
    with pytest.raises(PackerError, match=r"disk full while writing .*MiB free\)\. Shards finished "
                                          r"before this one are kept"):
        quiet_build(photo_src, tiny_disk / "dst")


def test_another_src_with_the_same_names_is_another_build(photo_src, tmp_path, monkeypatch):
    """A second SRC holding files of the same names (another photo set, a re-export) is not
    the interrupted build's input: its run starts over rather than resuming into a mix of
    both, and over a finished dataset it is refused, not taken for a no-op re-run."""
    from packer.demo import make_image_folder
    other = make_image_folder(tmp_path / "other", images=48, classes=4, seed=2)
    assert image_files(other) == image_files(photo_src)
    dst = tmp_path / "d"
    with monkeypatch.context() as mp:
        crash_on_finish(mp, after=2)
        with pytest.raises(KeyboardInterrupt):
            quiet_build(photo_src, dst, workers=0, shard_size=1 << 20)
    r = quiet_build(other, dst, workers=0, shard_size=1 << 20)
    assert r.resumed_shards == 0
    ref = quiet_build(other, tmp_path / "ref", workers=0, shard_size=1 << 20)
    assert [s["sha256"] for s in r.manifest["shards"]] == [s["sha256"] for s in ref.manifest["shards"]]
    with pytest.raises(PackerError, match="already holds a finished dataset"):
        quiet_build(photo_src, dst, workers=0, shard_size=1 << 20)
    assert quiet_build(other, dst, workers=0, shard_size=1 << 20).resumed_shards == len(ref.manifest["shards"])


def test_side_tables_of_a_run_killed_before_its_manifest_go_with_the_next_run(photo_src, tmp_path,
                                                                           monkeypatch):
    """Killed after its side tables, before its manifest; re-run with other input (here no
    labels): the first run's labels.i32 is removed, not left unlisted, so a later overwrite
    is not refused for a file packer wrote itself."""
    from packer import build
    from packer.sources import Table
    dst = tmp_path / "d"
    with monkeypatch.context() as mp:
        mp.setattr(packing_mod, "new_manifest", lambda **kw: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            quiet_build(photo_src, dst, workers=0)
    assert (dst / "labels.i32").exists() and not (dst / "manifest.json").exists()
    table = tmp_path / "meta.jsonl"
    table.write_text("".join(json.dumps({"path": p, "score": 1.5}) + "\n" for p in image_files(photo_src)))
    build(Table(photo_src, table), dst, workers=0, progress=False)
    assert "labels" not in read_manifest(dst) and not (dst / "labels.i32").exists()
    quiet_build(photo_src, dst, workers=0, overwrite=True)
    assert read_manifest(dst)["labels"]


def test_a_no_op_rerun_keeps_the_users_files_named_like_tables(photo_src, tmp_path):
    """Files a user puts in a finished dataset's folder stay, even named like side tables:
    only what packer claimed is ever removed."""
    dst = tmp_path / "d"
    quiet_build(photo_src, dst, workers=0)
    (dst / "paths.txt").write_text("notes")
    (dst / "column-readme.md").write_text("notes")
    assert quiet_build(photo_src, dst, workers=0).resumed_shards == len(read_manifest(dst)["shards"])
    assert (dst / "paths.txt").exists() and (dst / "column-readme.md").exists()


def test_a_resume_keeps_the_claims_on_side_tables_written_before(tmp_path):
    """A run claims its side tables in the journal before writing them; a resume that rewrites
    the journal must keep those claims, or a later restart leaves the tables as strangers."""
    from packer.writing import journal
    dst = tmp_path / "d"
    dst.mkdir()
    journal.restart(dst, "fp")
    journal.claim_more(dst, ["column-area.f32"])
    journal.load(dst, "fp")  # a resume: the journal rewritten whole
    assert read_journal(dst)["owned"] == ["column-area.f32"]
    (dst / "column-area.f32").write_bytes(b"\0" * 8)
    journal.load(dst, "other")  # another build's restart removes what this one claimed
    assert not (dst / "column-area.f32").exists()
