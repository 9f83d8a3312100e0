"""The DDP worker-count benchmark end to end on the CPU: two real ranks (torchrun, gloo) per
run, each --workers value its own run, the rates parsed from train_example's RESULT line."""
from __future__ import annotations

import json

import bench_worker_count


def test_two_ranks_per_worker_count(tmp_path, capsys):
    out = tmp_path / "rates.json"
    assert bench_worker_count.main([
        "--data", str(tmp_path / "wc"), "--make", "48", "--ranks", "2", "--cpu",
        "--workers", "default,1", "--rounds", "1", "--epochs", "1", "--json", str(out),
        "--extra", "--model tiny --image-size 32 --batch-size 8"]) == 0
    rates = json.loads(out.read_text())["rates"]
    assert set(rates) == {"default", "1"} and all(len(r) == 1 and r[0] > 0 for r in rates.values())
    table = capsys.readouterr().out
    assert "2 ranks" in table and "| default |" in table and "| 1 |" in table
