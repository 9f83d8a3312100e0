"""``scripts/train_example.py`` on the CPU: the same code path as on GPUs, with a tiny model
and a few steps; under ``torch.distributed.run`` (torchrun) with 2 gloo processes too."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packer import build

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_example.py"
QUICK = ["--cpu", "--model", "tiny", "--image-size", "64", "--batch-size", "8", "--workers", "1",
         "--log-every", "1"]
RESULT = re.compile(r"^RESULT (.*)$", re.M)


@pytest.fixture(scope="module")
def packed(photo_src, tmp_path_factory):
    """(train, val): the 48-image, 4-class photo folder built twice."""
    tmp = tmp_path_factory.mktemp("train_example")
    build(photo_src, tmp / "train", workers=0, progress=False)
    build(photo_src, tmp / "val", workers=0, progress=False)
    return tmp / "train", tmp / "val"


def run(*args, launcher=(), timeout=120):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, *launcher, str(SCRIPT), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def result(out: str) -> dict:
    lines = RESULT.findall(out)
    assert len(lines) == 1, out  # rank 0 only
    return dict(kv.split("=", 1) for kv in lines[0].split())


def test_cpu_run_trains_validates_and_reports(packed):
    train, val = packed
    out = run("--data", train, "--val", val, "--max-steps", "3", *QUICK)
    r = result(out)
    assert r["world_size"] == "1" and r["steps"] == "3" and r["device"] == "cpu"
    assert r["model"] == "tiny" and r["amp"] == "none"
    assert float(r["images_per_s"]) > 0
    assert "48 images, 4 classes" in out
    assert re.search(r"epoch 1/1: 3 steps, loss [\d.]+, \d+ images/s .*val top-1 [\d.]+%", out), out
    assert out.rstrip().splitlines()[-1].startswith("RESULT ")  # last line: machine-parsable


def test_checkpoint_resumes_mid_epoch_at_the_next_sample(packed, tmp_path):
    train, _ = packed
    ck = tmp_path / "ck.pt"
    run("--data", train, "--max-steps", "2", "--checkpoint", ck, *QUICK)
    state = torch.load(ck, weights_only=True)
    assert state["step"] == 2
    assert state["sampler"]["epoch"] == 0 and state["sampler"]["consumed"] == 16  # 2 steps x 8
    out = run("--data", train, "--checkpoint", ck, "--resume", *QUICK)
    assert f"resumed from {ck}: epoch 1, step 2" in out
    # 48 images / batch 8 = 6 steps per epoch: the resumed run does the 4 left, not 6.
    assert "epoch 1/1: 4 steps" in out
    assert result(out)["steps"] == "6"
    after = torch.load(ck, weights_only=True)
    assert after["step"] == 6 and after["sampler"]["epoch"] == 1 and after["sampler"]["consumed"] == 0


def test_torchrun_two_processes_gloo_with_staging(packed, tmp_path):
    train, val = packed
    stage_to = tmp_path / "staged"
    out = run("--data", train, "--val", val, "--stage-to", stage_to, "--max-steps", "2",
              "--sync-bn", *QUICK,
              launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])
    r = result(out)
    assert r["world_size"] == "2" and r["steps"] == "2"
    assert "2 process(es) on cpu, batch 8/process (16 global), 3 steps/epoch" in out
    assert "--sync-bn ignored: SyncBatchNorm needs CUDA" in out
    for name in ("train", "val"):  # staged once on this node, then read there
        assert len(list((stage_to / name).glob("shard-*.lmdb"))) >= 1
        assert (stage_to / name / "manifest.json").is_file()
    assert f"staged {train} -> {stage_to / 'train'}" in out


def test_resume_needs_a_checkpoint_path(packed):
    train, _ = packed
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(train), "--resume"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--resume needs --checkpoint PATH" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_run_with_amp_and_channels_last(packed):
    train, val = packed
    out = run("--data", train, "--val", val, "--model", "tiny", "--image-size", "64",
              "--batch-size", "8", "--max-steps", "3", "--amp", "bf16", "--channels-last")
    r = result(out)
    assert r["device"] == "cuda" and r["amp"] == "bf16" and r["channels_last"] == "1"


def fails(*args, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("flag,value,says", [
    ("--log-every", "0", "argument --log-every: must be >= 1, got 0"),
    ("--batch-size", "0", "argument --batch-size: must be >= 1, got 0"),
    ("--epochs", "0", "argument --epochs: must be >= 1, got 0"),
    ("--max-steps", "0", "argument --max-steps: must be >= 1, got 0"),
    ("--image-size", "0", "argument --image-size: must be >= 1, got 0"),
    ("--workers", "-1", "argument --workers: must be >= 0, got -1"),
    ("--lr", "-1", "argument --lr: must be > 0, got -1"),
    ("--weight-decay", "-1", "argument --weight-decay: must be >= 0, got -1"),
    ("--label-smoothing", "2", "argument --label-smoothing: must be in [0, 1], got 2"),
    ("--checkpoint", "/nonexistent/dir/ck.pt", "--checkpoint /nonexistent/dir/ck.pt: its folder does not exist"),
])
def test_bad_flag_is_a_usage_error_in_one_line(packed, flag, value, says):
    """Not a traceback after the model is built (or a silent run of 0 steps, or a negative
    weight decay taken as given): argparse's usage line and exit 2, before any work."""
    train, _ = packed
    proc = fails("--data", train, *QUICK, "--max-steps", "2", flag, value)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines()[-1] == f"train_example.py: error: {says}", proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_dataset_and_damaged_checkpoint_are_one_line(packed, tmp_path):
    train, _ = packed
    for args, says in [
        (["--data", tmp_path / "nope"], f"error: {tmp_path / 'nope'} does not exist"),
        (["--data", train, "--val", tmp_path / "nope"], f"error: {tmp_path / 'nope'} does not exist"),
    ]:
        proc = fails(*args, *QUICK)
        assert proc.returncode == 1 and proc.stderr.startswith(says), proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
    ck = tmp_path / "ck.pt"
    ck.write_text("not a checkpoint")
    proc = fails("--data", train, "--checkpoint", ck, "--resume", *QUICK)
    assert proc.returncode == 1 and proc.stderr == (
        f"error: --checkpoint {ck}: not a checkpoint this script wrote, or a damaged one: "
        "remove it or give another path\n"), proc.stderr
    assert ck.read_text() == "not a checkpoint"  # left for the user to look at


def test_help_lists_every_flag():
    proc = fails("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for flag in ("--data", "--val", "--stage-to", "--max-steps", "--checkpoint", "--resume",
                 "--cpu", "--amp", "--channels-last", "--no-channels-last"):
        assert flag in proc.stdout
    assert "torchrun --standalone --nproc_per_node=8 scripts/train_example.py \\" in proc.stdout
