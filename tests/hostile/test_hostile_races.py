"""One writer per folder: real second processes racing for one DST or TARGET.

A build is held at a known point with a FIFO as its first image (it blocks opening it, its
lock held, until the test writes the image); a stage is frozen with SIGSTOP while it holds
TARGET. The second writer must fail at once with a PackerError naming the holder's pid, and
the first must finish a dataset that verifies and holds only its own images. Stage and
unstage started at the same instant, many times over, must each succeed or fail with a
PackerError, never a raw OSError.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

import packer
from helpers import gated_packer_cmd, packer_cmd, packer_env, release, wait_for_reader
from packer import build, merge, stage, unstage, verify
from packer.demo import make_image_folder
from packer.errors import PackerError

REPO = Path(packer.__file__).resolve().parent.parent
BUSY = "being written by another packer process (pid {pid}"


# -- helpers -----------------------------------------------------------------------------------

def run_packer(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(packer_cmd(*args), capture_output=True, text=True, env=packer_env(),
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"`packer {' '.join(map(str, args))}` still running after {timeout} s "
                             f"(waiting for the other writer?)") from e


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out + err


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait()


def image_entries(src: Path) -> set:
    """(path, label) of every image of an ImageFolder tree, as the manifest stores them."""
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    return {(p.relative_to(src).as_posix(), classes.index(p.parent.name))
            for p in src.glob("*/*.jpg")}


def records(root: Path) -> set:
    out = run_packer("ls", root)
    assert out.returncode == 0, out.stdout + out.stderr
    return {(line.split("\t")[2], int(line.split("\t")[1])) for line in out.stdout.splitlines()}


@pytest.fixture()
def held_build(tmp_path):
    """A `packer build SRC DST` subprocess blocked on its first image (a FIFO), holding DST.
    Yields (proc, src, dst, release): ``release()`` lets it finish and returns (rc, output)."""
    src = make_image_folder(tmp_path / "src_a", images=24, classes=3)
    jpeg = (src / "class_00" / "img_00000.jpg").read_bytes()
    gate = src / "class_00" / "aaa_gate.jpg"
    os.mkfifo(gate)
    dst = tmp_path / "dst"
    # --quality: a transcoding build reads each image once (one open of the FIFO).
    proc = subprocess.Popen(gated_packer_cmd("build", src, dst, "-q", "--shard-size", "1M", "--workers", "0",
                                       "--quality", "95"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=packer_env())
    try:
        state = {"fd": wait_for_reader(gate, proc)}
    except BaseException:
        stop(proc)
        raise

    def let_go():
        release(state.pop("fd"), jpeg)
        return finish(proc)

    try:
        yield proc, src, dst, let_go
    finally:
        if "fd" in state:
            os.close(state.pop("fd"))
        stop(proc)


def other_source(root: Path) -> Path:
    """Different images under different names (b_*.jpg), same classes."""
    src = make_image_folder(root, images=24, classes=3, seed=7)
    for p in list(src.glob("*/*.jpg")):
        p.rename(p.with_name("b_" + p.name))
    return src


# -- build vs build, build vs merge ------------------------------------------------------------

def test_second_build_into_a_dst_being_built_fails_naming_the_holder(held_build, tmp_path):
    proc, src_a, dst, let_go = held_build
    src_b = other_source(tmp_path / "src_b")
    second = run_packer("build", src_b, dst, "-q", "--shard-size", "1M", "--workers", "0")
    out = second.stdout + second.stderr
    assert second.returncode == 1, out
    assert BUSY.format(pid=proc.pid) in out, out
    assert "Traceback" not in out
    rc, out = let_go()
    assert rc == 0, out
    rep = verify(dst, progress=False)
    assert rep.ok, rep.problems
    assert records(dst) == image_entries(src_a)


def test_merge_into_a_dst_being_built_fails_naming_the_holder(held_build, tmp_path):
    proc, src_a, dst, let_go = held_build
    src_b = other_source(tmp_path / "src_b")
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for k, p in enumerate(parts):
        build(src_b, p, part=f"{k}/2", progress=False, workers=0)
    with pytest.raises(PackerError, match=re.escape(BUSY.format(pid=proc.pid))):
        merge(parts, dst)
    merged = run_packer("merge", *parts, dst)  # the CLI: one clear line, exit 1
    assert merged.returncode == 1 and "Traceback" not in merged.stdout + merged.stderr
    assert BUSY.format(pid=proc.pid) in merged.stdout + merged.stderr
    rc, out = let_go()
    assert rc == 0, out
    rep = verify(dst, progress=False)
    assert rep.ok, rep.problems
    assert records(dst) == image_entries(src_a)
    assert "parts" not in json.loads((dst / "manifest.json").read_text())


# -- stage vs unstage --------------------------------------------------------------------------

def bigger_dataset(root: Path, copies: int = 6) -> Path:
    """~150 real photos (24 made, each linked ``copies`` times), built: about 10 MB."""
    src = make_image_folder(root / "src", images=24, classes=3, seed=3)
    for p in list(src.glob("*/*.jpg")):
        for k in range(1, copies):
            os.link(p, p.with_name(f"{p.stem}_{k}.jpg"))
    build(src, root / "ds", progress=False, workers=0, shard_size=4 << 20)
    return root / "ds"


def freeze_while_holding(proc: subprocess.Popen, folder: Path, timeout: float = 30) -> bool:
    """SIGSTOP ``proc`` once it holds ``folder``'s packer lock; False if it finished first."""
    lock = folder / ".packer-lock"
    mark = f"pid {proc.pid},"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(lock) as f:
                held = f.read().startswith(mark)
        except OSError:
            held = False
        if held:
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                with open(lock) as f:
                    if f.read().startswith(mark):
                        return True
            except OSError:
                pass
            os.kill(proc.pid, signal.SIGCONT)
    return False


def test_unstage_while_a_stage_holds_target_fails_naming_the_holder(tmp_path):
    a = tmp_path / "a"
    b = bigger_dataset(tmp_path / "b")
    src_a = make_image_folder(tmp_path / "src_a", images=24, classes=3)
    build(src_a, a, progress=False, workers=0)
    target = tmp_path / "target"
    for attempt in range(8):
        stage(a, target, progress=False)
        proc = subprocess.Popen(packer_cmd("stage", b, target, "-q"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=packer_env())
        try:
            if not freeze_while_holding(proc, target):
                assert finish(proc)[0] == 0
                continue  # it finished before it could be caught: stage A again and retry
            loser = run_packer("unstage", target, timeout=30)
            out = loser.stdout + loser.stderr
            assert loser.returncode == 1, out
            assert BUSY.format(pid=proc.pid) in out, out
            assert "Traceback" not in out
            restage = run_packer("stage", a, target, "-q", timeout=30)
            assert restage.returncode == 1 and BUSY.format(pid=proc.pid) in restage.stdout + restage.stderr
            os.kill(proc.pid, signal.SIGCONT)
            rc, out = finish(proc)
            assert rc == 0, out
            break
        finally:
            stop(proc)
    else:
        pytest.fail("could not catch `packer stage` holding TARGET's lock in 8 tries")
    rep = verify(target, progress=False)
    assert rep.ok, rep.problems
    staged = json.loads((target / "manifest.json").read_text())
    assert staged["build_id"] == json.loads((b / "manifest.json").read_text())["build_id"]
    unstage(target)
    assert not target.exists()


def _race_child(fn, args, barrier, queue):
    barrier.wait()
    try:
        fn(*args)
        queue.put(("ok", ""))
    except PackerError as e:
        queue.put(("PackerError", str(e)))
    except BaseException:
        queue.put(("raw", traceback.format_exc()))


def _stage_quietly(src, target):
    stage(src, target, progress=False)


def test_stage_racing_unstage_loser_gets_a_packer_error(tmp_path):
    """Stage and unstage of one TARGET started at the same instant, round after round (up to
    8 s; each round's outcome depends on timing, so many rounds): each one either works or
    fails with a PackerError; none raises a raw OSError."""
    src = make_image_folder(tmp_path / "src", images=24, classes=3)
    ds = tmp_path / "ds"
    build(src, ds, progress=False, workers=0)
    target = tmp_path / "target"
    ctx = mp.get_context("fork")
    outcomes = {"ok": 0, "PackerError": 0}
    deadline = time.monotonic() + 8
    rounds = 0
    while time.monotonic() < deadline:
        rounds += 1
        if not (target / "manifest.json").exists():
            if target.exists() and not (target / ".packer-stage.json").exists():
                shutil.rmtree(target)
            stage(ds, target, progress=False)
        barrier, queue = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_race_child, args=(_stage_quietly, (ds, target), barrier, queue)),
                 ctx.Process(target=_race_child, args=(unstage, (target,), barrier, queue))]
        for p in procs:
            p.start()
        results = [queue.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        raw = [msg for kind, msg in results if kind == "raw"]
        assert not raw, f"round {rounds}: a racing stage/unstage raised a raw error:\n{raw[0]}"
        for kind, _ in results:
            outcomes[kind] += 1
    assert outcomes["ok"] > 0
    if not (target / "manifest.json").exists():
        stage(ds, target, progress=False)
    assert verify(target, progress=False).ok


# -- the lock itself ---------------------------------------------------------------------------

def _lock_child(lock_class, folder, seconds, barrier, queue):
    barrier.wait()
    held = both = 0
    end = time.monotonic() + seconds
    inside = os.path.join(folder, "inside")
    while time.monotonic() < end and not both:
        try:
            with lock_class(folder, "test"):
                held += 1
                try:  # only one holder at a time may create this
                    fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    both += 1
                    continue
                os.close(fd)
                os.unlink(inside)
        except PackerError:
            pass
    queue.put((held, both))


def test_folder_lock_has_one_holder_at_a_time(tmp_path):
    """Processes taking and releasing one folder's lock in a loop (about 2 s): never two
    inside at once. (A lock file unlinked while held lets a process that opened it just
    before lock the unlinked file while another creates and locks a new one.)"""
    from packer._util.fsio import FolderLock
    assert Path(sys.modules[FolderLock.__module__].__file__).parent == REPO / "packer" / "_util"
    folder = tmp_path / "dst"
    folder.mkdir()
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_lock_child, args=(FolderLock, str(folder), 2.0, barrier, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert sum(h for h, _ in results) > 100  # they did take turns
    assert sum(b for _, b in results) == 0, (
        f"two processes held the packer lock of one folder at the same time "
        f"({sum(b for _, b in results)} times in {sum(h for h, _ in results)} acquisitions)")
