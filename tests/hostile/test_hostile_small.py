"""Smaller hostile cases, each on real files and real processes: a build killed with -9
leaves no workers; dataset names cannot drive the terminal; merge refuses labels outside the
classes; stage refuses a shard without a checksum before copying; stage racing unstage
fails only with PackerError."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from array import array
from pathlib import Path

import pytest

import packer
from packer import build, merge, stage, unstage, verify
from packer.demo import make_image_folder
from packer.errors import FormatError, PackerError
from packer.format.manifest import file_sha256

PKG_PARENT = str(Path(packer.__file__).resolve().parents[1])
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (PKG_PARENT, os.environ.get("PYTHONPATH")) if p))


def packer_cmd(*args):
    return [sys.executable, "-m", "packer", *map(str, args)]


def run_packer(*args, timeout=60):
    return subprocess.run(packer_cmd(*args), env=ENV, capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("small") / "src", images=24, classes=3)


@pytest.fixture(scope="module")
def dataset(src, tmp_path_factory) -> Path:
    """A built dataset (read-only)."""
    dst = tmp_path_factory.mktemp("small_built") / "dst"
    build(src, dst, workers=0, progress=False)
    return dst


# -- (a) kill -9 of a build leaves no worker behind --------------------------------------------

def children(pid: int):
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def proc_stat(pid: int):
    """(state, start time) of ``pid``, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


def alive(pid: int, started: str) -> bool:
    """``pid`` is still the process we saw (same start time) and not a zombie."""
    st = proc_stat(pid)
    return st is not None and st[1] == started and st[0] not in ("Z", "X")


def test_kill_9_of_build_leaves_no_worker(src, tmp_path):
    big = tmp_path / "big"
    files = sorted(src.rglob("*.jpg"))
    for c in range(3):
        (big / f"c{c}").mkdir(parents=True)
    for k in range(25):  # 600 real photos (hard links: the build reads each path)
        for i, f in enumerate(files):
            os.link(f, big / f"c{i % 3}" / f"{k:02d}_{f.name}")
    dst = tmp_path / "dst"
    # --short-side 256: a full decode, resize and encode per photo, ~2 s for the two workers
    parent = subprocess.Popen(packer_cmd("build", big, dst, "-j", "2", "-q", "--short-side", "256"),
                              env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers = {}
    try:
        deadline = time.monotonic() + 20
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            for pid in children(parent.pid):
                st = proc_stat(pid)
                if st is not None:
                    workers[pid] = st[1]
            time.sleep(0.005)
        assert len(workers) >= 2, f"no workers seen ({parent.poll()}, {parent.stderr.read()!r})"
        time.sleep(0.2)  # the workers are busy transcoding
        assert parent.poll() is None, "the build ended before it could be killed"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(alive(p, s) for p, s in workers.items()) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = [p for p, s in workers.items() if alive(p, s)]
        assert not left, f"workers {left} outlived their killed parent {parent.pid}"
        assert not (dst / "manifest.json").exists()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stderr.close()
        for pid, started in workers.items():  # only the workers this test's build started
            if alive(pid, started):
                os.kill(pid, signal.SIGKILL)


# -- (b) names with terminal escapes never reach the terminal raw ------------------------------

NASTY_CLASSES = ["\x1b[31mred", "\x1b]0;title\x07", "\x9b2J"]
NASTY_FILES = ["\x1b[2Jimg.jpg", "pic\x07\x1b]0;x\x07.jpg", "a\x9b31m.jpg", "del\x7f\x85.jpg"]


def raw_controls(text: str):
    return sorted({hex(ord(ch)) for ch in text
                   if (ord(ch) < 0x20 and ch not in "\n\t") or 0x7F <= ord(ch) <= 0x9F})


def test_dataset_names_cannot_drive_the_terminal(src, tmp_path):
    nasty = tmp_path / "nasty"
    files = sorted(src.rglob("*.jpg"))
    for c, cls in enumerate(NASTY_CLASSES):
        (nasty / cls).mkdir(parents=True)
        for i, name in enumerate(NASTY_FILES):
            shutil.copyfile(files[c * 4 + i], nasty / cls / name)
    (nasty / NASTY_CLASSES[0] / "\x1b[5mbroken\x1b[0m.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    dst = tmp_path / "dst"

    outputs = {"build": run_packer("build", nasty, dst, "-j", "0", "-q")}
    assert outputs["build"].returncode == 0, outputs["build"].stderr
    for args in (["info"], ["info", "--json"], ["ls"], ["verify", "-q"]):
        outputs[" ".join(args)] = run_packer(args[0], dst, *args[1:])
    for name, p in outputs.items():
        assert p.returncode == 0, (name, p.stderr)
        for stream in (p.stdout, p.stderr):
            text = stream.decode("utf-8")
            assert not raw_controls(text), (name, raw_controls(text), text)

    info_text = outputs["info"].stdout.decode()
    assert "\\x1b[31mred" in info_text and "\\x9b2J" in info_text  # shown, escaped
    assert "\\x1b[5mbroken\\x1b[0m.jpg" in info_text  # the skipped file, escaped too
    info_json = json.loads(outputs["info --json"].stdout)
    assert info_json["classes"] == sorted(NASTY_CLASSES)  # JSON escapes, keeps the names
    assert "broken" in info_json["skipped"][0]["path"]
    listed = outputs["ls"].stdout.decode().splitlines()
    assert len(listed) == 12 and all(line.count("\t") == 2 for line in listed)


# -- (c) merge: labels outside the classes -----------------------------------------------------

def test_merge_refuses_part_with_labels_outside_classes(src, tmp_path):
    parts = [tmp_path / "part-0", tmp_path / "part-1"]
    for k, part in enumerate(parts):
        build(src, part, part=f"{k}/2", workers=0, progress=False)
    labels = array("i", (parts[1] / "labels.i32").read_bytes())
    labels[3] = 7  # 3 classes
    (parts[1] / "labels.i32").write_bytes(labels.tobytes())
    man = json.loads((parts[1] / "manifest.json").read_text())
    man["labels"]["sha256"] = file_sha256(parts[1] / "labels.i32")
    (parts[1] / "manifest.json").write_text(json.dumps(man, indent=1))

    with pytest.raises(FormatError, match="labels.i32"):
        merge(parts, tmp_path / "merged")
    assert not (tmp_path / "merged" / "manifest.json").exists()


# -- (d) stage: a shard without a checksum -----------------------------------------------------

@pytest.mark.parametrize("target_exists", [False, True])
def test_stage_refuses_shard_without_sha256_before_copying(dataset, tmp_path, target_exists):
    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    man = json.loads((ds / "manifest.json").read_text())
    man["shards"][0]["sha256"] = None
    (ds / "manifest.json").write_text(json.dumps(man, indent=1))
    target = tmp_path / "target"
    if target_exists:
        target.mkdir()

    with pytest.raises(FormatError, match=r"'shards\[0\]\.sha256'"):
        stage(ds, target, progress=False)
    p = run_packer("stage", ds, target, "-q")
    assert p.returncode == 1 and b"shards[0].sha256" in p.stderr and b"Traceback" not in p.stderr
    if target_exists:
        assert os.listdir(target) == []
    else:
        assert not target.exists()


# -- (e) stage racing unstage ------------------------------------------------------------------

def test_stage_racing_unstage_fails_only_with_packer_errors(dataset, tmp_path):
    """``stage`` in one thread, ``unstage`` of the same TARGET in another, over and over:
    either may be refused (a PackerError naming the other), never fail with a raw OSError,
    and what is left can be staged and unstaged again."""
    target = tmp_path / "staged"
    stop = threading.Event()
    done = {"stage": 0, "unstage": 0}
    refused = {"stage": 0, "unstage": 0}
    raw = []

    def loop(name, call):
        while not stop.is_set():
            try:
                call()
                done[name] += 1
            except PackerError:
                refused[name] += 1
            except BaseException as e:  # anything else is the bug looked for
                raw.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")

    threads = [threading.Thread(target=loop, args=("stage", lambda: stage(dataset, target, progress=False))),
               threading.Thread(target=loop, args=("unstage", lambda: unstage(target)))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the two as finely as the interpreter allows
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while not raw and time.monotonic() < deadline:  # stop at the first raw error
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        sys.setswitchinterval(interval)
    assert not raw, f"{len(raw)} failure(s) not PackerError; the first:\n{raw[0]}"
    assert done["stage"] and done["unstage"], (done, refused)  # the race really ran
    # whatever the interleaving, what is left can be staged again, and unstaged to nothing
    stage(dataset, target, progress=False)
    assert verify(target, quick=True, progress=False).ok
    unstage(target)
    assert not target.exists()
