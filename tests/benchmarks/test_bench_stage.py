"""``benchlib.stage`` (``benchmarks/bench_stage.py``): stage, then read the same records from
the folder, the shards on disk and the staged copy, each in a fresh process from a cold
page cache; the report. The throttled run needs root and a cgroup (skipped otherwise)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packer.bench.coldread import storage
from benchlib.slowdisk import SlowDisk
from benchlib.stage import READERS, StageOptions, bench_stage, prepare, stage_report
from packer.demo import make_image_folder
from packer.errors import PackerError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("bench_stage") / "src", images=40, classes=4)


def quick(tmp_path, **kw) -> StageOptions:
    """Small, quiet, and never dropping the whole page cache (only the files read)."""
    if storage(tmp_path).endswith("(RAM)"):
        pytest.skip(f"{tmp_path} is in RAM ({storage(tmp_path)}); the bench needs a disk")
    kw = dict(dict(workdir=tmp_path / "work", shm=tmp_path / "shm", throttle=False,
                   drop_all=False, workers=0, progress=False, records=20), **kw)
    return StageOptions(**kw)


def test_prepare_builds_once_and_reuses(src, tmp_path):
    opts = quick(tmp_path)
    folder, packed, files = prepare(src, opts)
    assert folder == src and (packed / "manifest.json").is_file() and len(files) == 40
    mtime = (packed / "manifest.json").stat().st_mtime_ns
    assert prepare(src, opts)[1] == packed
    assert (packed / "manifest.json").stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_bench_stage_result_and_report(src, tmp_path):
    res = bench_stage(src, quick(tmp_path))
    assert res["images"] == 40 and res["read"] == 20 and res["shards"] >= 1
    assert res["throttle"] == "no throttle (--no-throttle)"
    assert set(res["results"]) == {"stage", *READERS}
    assert res["results"]["stage"]["bytes"] > 0 and res["results"]["stage"]["seconds"] > 0
    for name in READERS:
        r = res["results"][name]
        assert r["records"] == 20 and r["bytes"] > 0 and r["seconds"] > 0, name
        assert r["cache"].startswith(("cold", "warm")), r
    # the same records everywhere: folder files and records hold the same JPEG bytes
    assert res["results"]["shards/disk"]["bytes"] == res["results"]["shards/RAM"]["bytes"]
    assert not any((tmp_path / "shm").glob("packer-bench-*/manifest.json"))  # unstaged
    report = stage_report(res).splitlines()
    assert report[0].startswith("40 images (") and "20 read per variant" in report[0]
    assert [line.split(" | ")[0] for line in report if line.startswith("| ") and "records" not in line] \
        == [f"| {n}" for n in READERS]
    assert any(line.startswith("staging (one-off") for line in report)


def test_workdir_in_ram_is_refused(src, tmp_path):
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and storage(shm).endswith("(RAM)")):
        pytest.skip("no writable tmpfs at /dev/shm")
    work = shm / f"packer-test-{os.getpid()}"
    try:
        with pytest.raises(PackerError, match="is in RAM"):
            prepare(src, StageOptions(workdir=work, workers=0, progress=False))
    finally:
        if work.exists():
            work.rmdir()


def test_throttled_run(src, tmp_path):
    with SlowDisk(tmp_path) as probe:
        if not probe.throttled:
            pytest.skip(f"the throttle needs root and a cgroup blkio/io controller: {probe.how}")
    res = bench_stage(src, quick(tmp_path, throttle=True, records=8))
    assert "IOPS" in res["throttle"] or "riops" in res["throttle"]
    assert res["cgroup_counter"] and res["results"]["folder"]["disk_reads"] is not None


def test_script_help():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_stage.py"), "--help"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--workdir" in proc.stdout and "--no-throttle" in proc.stdout



def test_default_workdir_is_fresh_and_private(src, tmp_path):
    """Run as root (the script says sudo), a fixed folder under /var/tmp would let another
    user plant links that packer then writes through: each run makes its own and removes it."""
    before = set(Path("/var/tmp").glob("packer-bench-stage*"))
    result = bench_stage(src, quick(tmp_path, workdir=None))
    assert result["results"]["shards/RAM"]["records"] == 20
    assert set(Path("/var/tmp").glob("packer-bench-stage*")) == before
