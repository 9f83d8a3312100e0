"""The GPU-decode benchmark (benchlib.gpu, benchmarks/bench_gpu_decode.py) on the CPU: its
dry run end to end (PIL stands in for nvJPEG), its options, and its run state."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchlib.gpu import SECTIONS, GPUBench, GPUBenchArgs

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_dry_run_end_to_end(tmp_path):
    """Data, decode, augment, GPUDecoder under GPUOptions (the settings rows), baseline vs
    progressive and the correctness section run through the script and write their rows."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu_decode.py"), "--dry-run",
                          "--only", "variants,progressive,agreement", "--skip", "transcoded",
                          "--root", str(tmp_path / "data"), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert "errors" not in results, results["errors"]
    assert results["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"  # reserve_cuda_queues ran
    assert results["env"]["args"]["images"] == 96 and results["data"]["stored"]["count"] == 96
    agree = results["agreement"]
    assert agree["labels_match"] is True
    assert agree["decoder_vs_pil_full_decode"]["pil"]["max_abs"] == 0
    assert agree["eval_vs_pil_full_decode_same_resize"]["max_abs"] <= 1
    rows = (out / "results.md").read_text()
    for row in ("decode only (pil), batches in memory [stored]",
                "crop+resize+flip+normalize only, CPU reference, train [stored]",
                "GPUDecoder train, pil, 1 decode thread [stored]",
                "GPUDecoder eval, pil, 1 decode thread [stored]",
                "decode_jpeg batch of 16 progressive JPEGs"):
        assert row in rows
    assert "[max512]" not in rows and "CPU path" not in rows  # skipped, and not in --only


@pytest.mark.parametrize("script", ["bench_gpu_decode.py", "profile_gpu_augment.py", "bench_decode_beside.py",
                                    "profile_gpu_detection.py"])
def test_scripts_help(script):
    run = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "python3 benchmarks/" + script in run.stdout  # the docstring says how to run it


def test_options():
    a = GPUBenchArgs(only="agreement,cpu", skip="transcoded", cpus=16)
    assert a.skipped() == (set(SECTIONS) - {"agreement", "cpu"}) | {"transcoded"}
    assert a.resolved().loader_workers == 12 and a.loader_workers is None
    tiny = GPUBenchArgs(dry_run=True).resolved()
    assert (tiny.images, tiny.batch, tiny.cpus, tiny.loader_workers) == (96, 16, 2, 1)
    assert "resnet" in tiny.skipped()


def test_a_failing_section_leaves_the_others_and_its_error(tmp_path):
    b = GPUBench(GPUBenchArgs(out=str(tmp_path)))
    with b.section("breaks"):
        raise ValueError("boom")
    with b.section("works"):
        b.row("1", "something", 1234.0, "note")
    results = json.loads((tmp_path / "results.json").read_text())
    assert [e["section"] for e in results["errors"]] == ["breaks"]
    assert "boom" in results["errors"][0]["error"]
    assert "| 1 | something | 1,234 | note |" in (tmp_path / "results.md").read_text()
