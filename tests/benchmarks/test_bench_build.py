"""``benchlib.figures.bench_build`` (``benchmarks/bench_build.py``): decode and build rates on a small
realistic folder, and the table made of them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packer.bench.build import DECODE, DECODE_LOADED, build_variants, decode_rate
from benchlib.figures import bench_build, build_table
from packer.demo import make_image_folder

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("bench_build") / "src", images=40, classes=4)


def test_decode_rate(src):
    blobs = [p.read_bytes() for p in sorted(src.rglob("*.jpg"))[:5]]
    assert decode_rate(blobs) > 0


def test_bench_build_rows_and_table(src):
    lines = []
    res = bench_build(src, workers=0, repeats=2, decode_sample=10, progress=False,
                      log=lines.append)
    assert res["images"] == 40 and res["workers"] == 0 and res["repeats"] == 2
    assert res["bytes"] == sum(p.stat().st_size for p in src.rglob("*.jpg"))
    assert list(res["rows"]) == [DECODE, DECODE_LOADED] + [name for name, _ in build_variants()]
    for name, values in res["rows"].items():
        assert len(values) == 2 and all(v > 0 for v in values), name
    assert lines and lines[0].startswith("40 images, ") and "PIL: " in lines[0]
    table = build_table(res).splitlines()
    assert table[0].startswith("| variant | images/s (median of 2) |")
    assert [row.split(" | ")[0] for row in table[2:6]] == [f"| {n}" for n in res["rows"]]
    assert table[-1].startswith("goal: build >= 0.8 x 1 x ")  # workers=0: one core


def test_bench_build_makes_its_own_folder():
    res = bench_build(None, images=12, workers=0, repeats=1, decode_sample=4, progress=False,
                      log=lambda _: None)
    assert res["images"] == 12


def test_script_help():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_build.py"), "--help"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--decode-sample" in proc.stdout and "--repeats" in proc.stdout
