"""benchmarks/bench_shm_release.py end to end, tiny: the three variants in fresh processes, the
free-vs-copy timing, and the table."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_shm_release.py"


def test_tiny_run(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPT), "--images", "64", "--batch", "16",
                          "--epochs", "1", "--rounds", "2", "--block-mib", "1",
                          "--root", str(tmp_path / "data"), "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    for name in ("ring", "release", "norel"):
        assert len(res["runs"][name]) == 2
        assert all(r["batches"] == 4 and r["cpu_ms"] > 0 for r in res["runs"][name])
    assert res["block"]["mib"] == 1 and res["block"]["copy_ms"] > 0 and res["block"]["free_ms"] > 0
    assert "| in a slot of the batch ring |" in run.stdout and "shared block: copy" in run.stdout
