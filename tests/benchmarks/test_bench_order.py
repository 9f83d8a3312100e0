"""``benchlib.order`` (``benchmarks/bench_order.py``): read passes in each order from a cold
page cache, the resume time, and the report; the throttle where root and a cgroup allow it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packer import build
from benchlib.slowdisk import SlowDisk
from benchlib.order import OrderOptions, bench_order, order_report, orders, read_pass
from packer.demo import make_image_folder
from packer.errors import PackerError

REPO = Path(__file__).resolve().parents[2]
QUICK = OrderOptions(repeat=2, batch_size=8, throttle=False, block_size=8, window=2)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_order")
    src = make_image_folder(tmp / "src", images=40, classes=4)
    build(src, tmp / "packed", workers=0, progress=False)
    return tmp / "packed"


def test_orders_are_permutations():
    got = orders(40, 30, block_size=8, window=2)
    assert list(got) == ["random", "block 8x2", "block 8x1", "sequential"]
    full = orders(40, 40, block_size=8, window=2)
    for name, order in full.items():
        assert sorted(order) == list(range(40)), name
    assert all(len(o) == 30 for o in got.values())
    assert full["sequential"] == list(range(40))


def test_read_pass(packed):
    rate, mbs = read_pass(str(packed), list(range(10)))
    assert rate > 0 and mbs > 0


def test_bench_order_result_and_report(packed):
    lines = []
    res = bench_order(packed, QUICK, log=lines.append)
    assert res["records"] == 40 and res["read"] == 40 and res["shards"] >= 1
    assert res["throttled"] is False and res["throttle"] == "no throttle (--no-throttle)"
    assert list(res["passes"]) == ["random", "block 8x2", "block 8x1", "sequential"]
    for name, passes in res["passes"].items():
        assert len(passes) == 2, name
        for rate, mbs, cold in passes:
            assert rate > 0 and mbs > 0 and 0 <= cold <= 1
        assert res["best"][name] == max(passes)
    assert res["resume"]["batch"] == 4 and res["resume"]["ms"] > 0  # 10% of 40 left
    assert len([line for line in lines if "records/s" in line]) == 8  # 4 orders x 2 passes
    report = order_report(res)
    assert report.startswith("best of 2 passes per order:")
    assert "| random |" in report and "| sequential |" in report and "1.00x" in report
    assert "resume at 90% of the epoch: load_state_dict + first batch of 4 in " in report


def test_bench_order_builds_a_dataset_when_none_is_given():
    lines = []
    res = bench_order(None, OrderOptions(images=24, workers=0, repeat=1, batch_size=4,
                                         throttle=False, records=16), log=lines.append)
    assert res["records"] == 24 and res["read"] == 16
    assert lines[0].startswith("built 24-image dataset in ")
    built = Path(lines[0].rsplit(": ", 1)[1])
    assert not built.exists()  # the temporary folder is removed


def test_throttle_on_demand(packed):
    """--throttle: a throttled pass in a child process where root and a cgroup allow it,
    else a clear error saying why not (no root needed for this test)."""
    with SlowDisk(packed) as probe:
        possible, why = probe.throttled, probe.how
    opts = OrderOptions(repeat=1, batch_size=8, throttle=True, records=8)
    if not possible:
        with pytest.raises(PackerError, match="--throttle: no throttle"):
            bench_order(packed, opts, log=lambda _: None)
        assert why.startswith("no throttle")
        return
    res = bench_order(packed, opts, log=lambda _: None)
    assert res["throttled"] and ("read IOPS" in res["throttle"] or "riops" in res["throttle"])
    assert "; not throttled" in order_report(res)


def test_script_help():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_order.py"), "--help"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--block-size" in proc.stdout and "--no-throttle" in proc.stdout
