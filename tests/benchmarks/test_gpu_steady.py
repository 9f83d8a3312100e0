"""The steady-state GPU benchmark (benchmarks/bench_gpu_steady.py) on the CPU: its dry run
end to end, each variant in its own process (PIL stands in for nvJPEG; DALI skipped)."""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu_steady.py"


def test_dry_run_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "OUT")}
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--root", str(tmp_path / "data"),
                          "--out", str(out), "--profile", "2"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    variants = ("packer", "packer_pinned3", "packer_plain2", "packer_cpu")
    assert res["data"]["images"] == 160 and res["baseline"] == "packer"  # no DALI here
    assert set(res["skipped"]) == {"dali", "dali_hw99"}
    assert [sorted(o) for o in res["order"]] == [sorted(variants)] * 2
    assert res["order"][0] != res["order"][1]  # rotated between rounds
    for v in variants:
        s = res["summary"][v]
        assert len(s["rounds"]) == 2 and all(r > 0 for r in s["rounds"])
        assert s["min"] <= s["median"] <= s["max"] and s["ratio_median"] > 0
        assert all(r > 0 for r in s["ratio_rounds"])
        for r in res["runs"][v]:
            assert r["epoch_boundaries"] >= 3 and r["batches"] == 36
            assert r["images"] == 36 * 16  # 160 images: 10 whole batches an epoch
            assert 0 < r["gap_ms"]["p50"] <= r["gap_ms"]["max"]
            assert 0 < r["epoch_start_gap_ms"] <= r["gap_ms"]["max"]
            if v != "packer_cpu":
                assert 1 <= r["decode_threads_mean"] <= 3
            cpu = r["cpu_in_window"]  # where the host time of the window went
            assert cpu["workers"] > 0 and cpu["minflt"] >= 0 and cpu["nvcsw"] > 0
            if v != "packer_cpu":
                assert "packer-gpu-decode-0" in cpu
            prof = r["device_ms_per_batch"]  # --profile 2: what the profiled batches ran
            assert prof["all"] > 0 and 1 < len(prof) <= 17
            assert sum(ms for k, ms in prof.items() if k != "all") <= prof["all"] + 1e-3 * len(prof)
    assert "device ms per batch: {'all': " in run.stdout
    assert res["runs"]["packer"][0]["decoded"]["cpu"] == 0  # the stand-in decoder took all
    table = (out / "results.md").read_text()
    assert "| variant | median img/s | min-max |" in table and "x packer per round" in table
    for v in variants:
        assert f"| {v} |" in table and f"| {v} |" in run.stdout
    assert "dali: skipped (dry run (CPU))" in table


def test_help_names_the_command():
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert "python3 benchmarks/bench_gpu_steady.py --images 10000 --rounds 3" in run.stdout


def test_variant_knobs():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_gpu_steady as b
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert b.packer_knobs("packer") == {}
    assert b.packer_knobs("packer_w8_t4_plain") == {"w": 8, "t": 4, "plain": 0}
    assert b.packer_knobs("packer_pinned3") == {"pinned": 0, "t": 3}
    assert b.packer_knobs("packer_plain2") == {"plain": 0, "t": 2}
    assert b.packer_knobs("packer_t1_s500") == {"t": 1, "s": 500}
    assert b.packer_knobs("packer_nvic_t3") == {"nvic": 0, "t": 3}
    assert b.packer_knobs("packer_nvichw") == {"nvichw": 0}
    assert b.packer_knobs("packer_norel_t1") == {"norel": 0, "t": 1}
    assert b.packer_knobs("packer_noring") == {"noring": 0}
    assert b.packer_knobs("packer_c1_t2") == {"c": 1, "t": 2}
    for bad in ("packer_x3", "packer_w", "packer_s", "packer_c", "packer_w8_fast", "packer_d1",
                "packer_nvic2"):
        try:
            b.packer_knobs(bad)
        except SystemExit as e:
            assert bad.split("_")[-1] in str(e)
        else:
            raise AssertionError(bad)


def test_detection_dry_run(tmp_path):
    """--detection: detection scenes packed with Coco, an SSDlite320 step fed by each path in
    its own process, the epoch's batches held on the GPU ("resident") as the baseline."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "OUT")}
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPT), "--detection", "--dry-run", "--root",
                          str(tmp_path / "data"), "--out", str(out)], capture_output=True,
                         text=True, timeout=400, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["baseline"] == "resident" and res["data"]["images"] == 8
    assert sorted(res["runs"]) == sorted(["resident", "synthetic", "packer_cpu", "packer",
                                          "packer_t1"])
    for v in ("resident", "packer_cpu", "packer", "packer_t1"):
        r = res["runs"][v][0]
        assert r["rate"] > 0 and r["epoch_boundaries"] >= 3 and r["images"] == 12 * 2
    assert res["runs"]["packer"][0]["decoded"]["gpu"] > 0  # GPUDecoder's path, PIL standing in
    assert "SSDlite320 step on detection scenes" in (out / "results.md").read_text()
    bad = subprocess.run([sys.executable, str(SCRIPT), "--detection", "--dry-run", "--only",
                          "dali", "--root", str(tmp_path / "data")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert bad.returncode != 0 and "unknown variants ['dali']" in bad.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "resident",
                          "--root", str(tmp_path / "data")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert bad.returncode != 0 and "unknown variants ['resident']" in bad.stderr


def test_detection_model_and_graph_options(tmp_path):
    """--model fasterrcnn trains fasterrcnn_mobilenet_v3_large_320_fpn on the scenes; --graph
    (a CUDA graph) goes with --train only, detection models with --detection only."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "OUT")}
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPT), "--detection", "--model", "fasterrcnn",
                          "--only", "synthetic,packer", "--dry-run", "--root", str(tmp_path / "data"),
                          "--out", str(out)], capture_output=True, text=True, timeout=400, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["args"]["model"] == "fasterrcnn" and res["runs"]["packer"][0]["rate"] > 0
    assert "fasterrcnn_mobilenet_v3_large_320_fpn step on detection scenes" in (
        out / "results.md").read_text()
    for bad in (["--graph"], ["--detection", "--graph"], ["--model", "fasterrcnn"],
                ["--detection", "--model", "resnet50"]):
        r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *bad], capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode != 0 and "--graph goes with --train" in r.stderr, bad
