"""Builds on Ray (``engine="ray"``, ``packer build --ray``) give the local build's dataset
byte for byte, also when a Ray worker is killed mid-shard; a missing Ray is one line.

One local Ray cluster (2 CPUs) serves the module: starting one takes ~15 s on a 2-core box.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

import packer
from helpers import packer_cmd
from packer.demo import make_image_folder
from packer.demo.scenes import make_detection_folder
from packer.errors import PackerError
from packer.sources import Coco, ImageFolder

ray = pytest.importorskip("ray")
VOLATILE = ("created", "build_id")  # manifest keys that differ between any two builds


@pytest.fixture(scope="module")
def cluster():
    ctx = ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """160 JPEGs (~10 MB): ~10 shards of 1 MiB."""
    return make_image_folder(tmp_path_factory.mktemp("ray") / "src", images=160, classes=3,
                             seed=5)


def build(src, dst, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return packer.build(src, dst, shard_size=1 << 20, progress=False, **kw)


def dataset(dst: Path) -> dict:
    """Every file of a dataset by name: its sha256, and the manifest's keys (less the
    build's time and id)."""
    out = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(dst.iterdir()) if p.name != "manifest.json"}
    manifest = json.loads((dst / "manifest.json").read_text("utf-8"))
    out["manifest.json"] = {k: v for k, v in manifest.items() if k not in VOLATILE}
    return out


def test_cli_ray_build_equals_local_build(cluster, tmp_path):
    """``packer build --ray`` on RAY_ADDRESS's cluster, a COCO source with a broken image
    and unusable boxes: the same files as the local build, skip and drop lists included."""
    det = make_detection_folder(tmp_path / "det", images=48, seed=3, workers=1)
    (det / "images/000007.jpg").write_bytes(b"\xff\xd8 not really a JPEG")
    coco = json.loads((det / "annotations.json").read_text())
    coco["annotations"][0]["bbox"] = [-50.0, -50.0, 10.0, 10.0]  # outside its image: dropped
    (det / "annotations.json").write_text(json.dumps(coco))
    local = tmp_path / "local"
    build(Coco(det / "images", det / "annotations.json"), local, workers=2)
    env = dict(os.environ, RAY_ADDRESS=cluster)
    proc = subprocess.run(packer_cmd("build", det / "images", tmp_path / "ray", "--coco",
                                     det / "annotations.json", "--ray", "--shard-size", "1M",
                                     "--json"), capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["shards"] >= 3
    want = dataset(local)
    assert want["manifest.json"]["skipped"] and want["manifest.json"]["dropped"]
    assert dataset(tmp_path / "ray") == want


def ray_task_pids(name: str = "ray::write_part") -> list:
    """Processes under this one (the local cluster's workers) running a shard task now:
    Ray titles a worker with the task it runs."""
    parent = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    out = []
    for pid in parent:
        up = pid
        while up in parent and up != os.getpid():
            up = parent[up]
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if up == os.getpid() and title.startswith(name.encode()):
            out.append(pid)
    return out


def kill_a_writer(dst: Path, killed: list, stop: threading.Event) -> None:
    """Once a shard is half-written in ``dst``, SIGKILL a worker running a shard task."""
    while not stop.is_set():
        partial = dst.is_dir() and any(p.name.endswith(".partial") for p in dst.iterdir())
        pids = ray_task_pids() if partial else []
        if pids:
            os.kill(pids[0], 9)
            killed.append(pids[0])
            return
        time.sleep(0.002)


def test_killed_ray_worker_same_dataset(cluster, folder, tmp_path):
    """A worker killed mid-shard: Ray runs its task again; the half-written shard is never
    taken, and the dataset is the local build's, byte for byte, with no temp file left."""
    build(folder, tmp_path / "local", workers=2)
    dst, killed, stop = tmp_path / "ray", [], threading.Event()
    killer = threading.Thread(target=kill_a_writer, args=(dst, killed, stop), daemon=True)
    killer.start()
    try:
        build(folder, dst, engine="ray")
    finally:
        stop.set()
        killer.join()
    assert killed, "the build ended before a worker could be killed"
    assert dataset(dst) == dataset(tmp_path / "local")
    assert not [p.name for p in dst.iterdir() if p.name.startswith(".shard-")]


def test_strict_failure_leaves_what_local_leaves(cluster, folder, tmp_path, monkeypatch):
    """A strict build stopped by a broken image mid-plan: Ray's queued and running tasks
    stop (through the stop file: nothing is cancelled) and shards finished after the failing
    one are removed, as locally."""
    cancelled = []
    monkeypatch.setattr(ray, "cancel", lambda ref, **kw: cancelled.append(ref))
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    (src / "class_01/img_00080.jpg").write_bytes(b"\xff\xd8 truncated")
    left = {}
    for name, how in (("local", {"workers": 2}), ("ray", {"engine": "ray"})):
        with pytest.raises(PackerError, match="strict: class_01/img_00080.jpg"):
            build(ImageFolder(src), tmp_path / name, **how, checks=packer.Checks(strict=True))
        left[name] = {p.name: p.read_bytes() for p in (tmp_path / name).iterdir()}
    # How many shards before the failing one finish first depends on timing; what is kept is
    # the same bytes, a run of shards from the first, and no manifest
    for kept in left.values():
        shards = sorted(n for n in kept if n.startswith("shard-"))
        assert shards and shards == [f"shard-{k:05d}.lmdb" for k in range(len(shards))]
        assert "manifest.json" not in kept
    for n in set(left["ray"]) & set(left["local"]):
        if n.startswith("shard-"):
            assert left["ray"][n] == left["local"][n], n
    assert not [n for n in left["ray"] if n.startswith(".shard-")]  # no temp or stop file
    assert cancelled == []


def test_a_task_stopped_as_it_finishes_leaves_no_shard(cluster, folder, tmp_path, monkeypatch):
    """A failing shard stops the tasks still running, through the stop file and never
    ``ray.cancel`` (which can abort the driver when it races a task's reply). One that renamed
    its shard into place before it stopped has no result the driver takes, so the driver
    removes its planned shard by name; the stop file goes too."""
    from packer.writing import ray_engine

    def write_part(job, local, task, version):
        if task.index == 0:
            time.sleep(3)  # the next task has written its shard by then, and waits
            raise PackerError("strict: the first shard is broken")
        (job.dst / f"shard-{task.index:05d}.lmdb").write_bytes(b"finished")
        deadline = time.monotonic() + 20  # a broken stop must not leave it running for good
        while not job.stop.is_set() and time.monotonic() < deadline:  # as write_shard looks
            time.sleep(0.05)

    cancelled = []
    monkeypatch.setattr(ray, "cancel", lambda ref, **kw: cancelled.append(ref))
    monkeypatch.setattr(ray_engine, "write_part", write_part)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers lack tests/
    try:
        t0 = time.monotonic()
        with pytest.raises(PackerError, match="the first shard is broken"):
            build(ImageFolder(folder), tmp_path / "dst", engine="ray")
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert cancelled == [] and time.monotonic() - t0 < 15
    assert sorted(p.name for p in (tmp_path / "dst").glob("*shard-*")) == []


def test_no_ray_is_one_line(folder, tmp_path):
    """Without Ray: one line naming the pip command, before anything is written; and
    ``import packer`` never imports Ray."""
    code = ("import sys; sys.modules['ray'] = None; import packer, packer.writing.ray_engine; "
            "from packer.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "build", str(folder),
                           str(tmp_path / "dst"), "--ray"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr == ("Error: building on Ray needs Ray installed: pip install "
                           "'packer-lmdb[ray]' (or pip install ray)\n")
    assert not (tmp_path / "dst").exists()
    with pytest.raises(PackerError, match="engine must be 'local', 'ray' or an engine object"):
        build(folder, tmp_path / "dst", engine="dask")
    with pytest.raises(PackerError, match="workers must be a process count"):
        build(folder, tmp_path / "dst", workers="ray")
    with pytest.raises(PackerError, match="workers counts this machine's processes"):
        build(folder, tmp_path / "dst", engine="ray", workers=2)
    code = "import sys, packer; packer.build; import packer.writing.ray_engine; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True).stdout == "False\n"
