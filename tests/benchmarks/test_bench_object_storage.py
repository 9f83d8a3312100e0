"""The object-storage benchmarks (``bench_build_url.py``, ``bench_cache.py``,
``bench_object_store.py``) end to end on tiny inputs: each starts its own S3 server on
loopback, runs every variant and prints the table with its ratios."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), AWS_EC2_METADATA_DISABLED="true")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_build_url_bench_prints_all_three_and_the_ratios(tmp_path):
    out = run("bench_build_url.py", "--images", "30", "--rounds", "1", "--workers", "1",
              "--workdir", str(tmp_path))
    for name in ("local", "url", "plain"):
        assert re.search(rf"round 0 {name} +[0-9.]+ images/s \(30 in", out), out
    assert re.search(r"url / local [0-9.]+ +url / plain [0-9.]+", out), out


def test_cache_bench_prints_every_variant_against_staged(tmp_path):
    out = run("bench_cache.py", "--images", "40", "--shard-mb", "1", "--rounds", "1",
              "--epochs", "2", "--workers", "0", "--batch", "8", "--random-batches", "2",
              "--workdir", str(tmp_path))
    for name in ("staged", "cold", "warm", "quarter", "quarter_random"):
        assert re.search(rf"  {name} +median +[0-9.]+ images/s .* ratio to staged [0-9.]+", out), out


def test_object_store_bench_prints_stage_against_a_plain_download(tmp_path):
    out = run("bench_object_store.py", "--mb", "8", "--shard-mb", "4", "--part-mb", "1",
              "--rounds", "1", "--workdir", str(tmp_path / "w"), "--target", str(tmp_path / "t"))
    for name in ("plain", "packer"):
        assert re.search(rf"  {name} +median +[0-9.]+ MiB/s .* ratio to plain [0-9.]+",
                         out), out
