"""``benchlib.detection`` (``benchmarks/bench_detection.py``): tiny runs of the cpu and build
sections, the table made of them, and the sections that must skip cleanly here."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchlib import detection as det
from benchlib.detection import DetectionBenchOptions, bench_detection, detection_table, torchvision_baseline, write_json

REPO = Path(__file__).resolve().parents[2]
TINY = dict(images=32, workers=0, rounds=1, batch_size=8, size=160)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    opts = DetectionBenchOptions(**TINY, root=str(tmp_path_factory.mktemp("bench_det")))
    lines = []
    return bench_detection(["cpu", "build"], opts, log=lines.append), lines, Path(opts.root)


def ratio(cell: str) -> float:
    if cell == "baseline":
        return 1.0
    m = re.fullmatch(r"([0-9.]+)(x|%)", cell)
    assert m, cell
    return float(m.group(1))


def test_cpu_and_build_rows(tiny):
    out, lines, root = tiny
    assert list(root.iterdir()) == []  # the data folder is removed
    assert not [n for n in out["notes"] if "failed" in n], out["notes"]
    rows = {(r["section"], r["name"]): r for r in out["rows"]}
    base = ("folder: torchvision CocoDetection + v2 letterbox" if torchvision_baseline()
            else "folder: CocoFolderDataset + DecodeLetterbox")
    cpu = [name for section, name in rows if section == "cpu (warm cache)"]
    assert cpu[0] == base and "packed: DecodeLetterbox" in cpu
    assert "folder: CocoFolderDataset + DecodeLetterbox" in cpu
    assert [name for section, name in rows if section == "build"] == [
        "build --list (label 0)", "build --coco"]
    for r in out["rows"]:
        assert len(r["values"]) == 1 and r["images_per_s"] > 0 and r["ratio"] > 0
        assert r["baseline"] == (r["name"] in (base, "build --list (label 0)"))
    assert lines[0].startswith("made and built 32 scenes")


def test_table_has_every_row_and_positive_ratios(tiny):
    out, _, _ = tiny
    table = detection_table(out).splitlines()
    assert table[0] == ("| section | variant | images/s (median of 1) | spread | "
                        "vs baseline |")
    body = [line for line in table[2:] if line.startswith("| ")]
    assert len(body) == len(out["rows"])
    for line in body:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[2].replace(",", "")) > 0 and ratio(cells[4]) > 0
    assert any(line.startswith("folder baseline: ") for line in table)


def test_json_round_trips(tiny, tmp_path):
    out, _, _ = tiny
    write_json(out, tmp_path / "det.json")
    back = json.loads((tmp_path / "det.json").read_text())
    assert back["rows"] == out["rows"] and back["options"]["images"] == 32


def test_gpu_section_skips_cleanly_without_cuda_or_torchvision():
    if torch.cuda.is_available() and importlib.util.find_spec("torchvision"):
        pytest.skip("CUDA and torchvision are here: the section would run")
    out, lines = {"rows": [], "notes": [], "environment": {}}, []
    det.gpu_section(Path("no-such-dataset"), DetectionBenchOptions(**TINY), out, lines.append)
    assert out["rows"] == [] and len(out["notes"]) == 1
    assert out["notes"][0].startswith("gpu skipped: ") and lines == out["notes"]


def test_slow_disk_skips_without_a_throttle(monkeypatch, tmp_path):
    class NoThrottle:
        throttled, how = False, "no throttle: not root"

        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass
    monkeypatch.setattr(det, "SlowDisk", NoThrottle)
    out, lines = {"rows": [], "notes": [], "environment": {}}, []
    det.slow_disk_section(tmp_path, tmp_path, DetectionBenchOptions(**TINY), out, lines.append)
    assert out["rows"] == []
    assert out["notes"] == ["slow-disk skipped: no throttle: not root (run as root, with --root "
                            "on a block device)"]


def test_gpu_dry_run_on_the_cpu(tmp_path):
    """The whole gpu section, tiny, on the CPU with PIL for nvJPEG (needs torchvision)."""
    pytest.importorskip("torchvision")
    opts = DetectionBenchOptions(images=16, workers=0, rounds=1, gpu_batch=2, gpu_size=96,
                                 steps=1, warmup=1, dry_run=True, root=str(tmp_path))
    out = bench_detection(["gpu"], opts, log=lambda _: None)
    names = [r["name"] for r in out["rows"]]
    assert names[0] == "resident batch (on the GPU)" and len(names) == 5
    assert all(r["ratio"] > 0 for r in out["rows"])


def test_unknown_section_is_refused():
    with pytest.raises(ValueError, match="unknown sections"):
        bench_detection(["cpu", "fast"], DetectionBenchOptions(**TINY))


def test_script_help():
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_detection.py"), "--help"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--cpu", "--build", "--gpu", "--slow-disk", "--images", "--workers", "--rounds",
                 "--json"):
        assert flag in proc.stdout


def test_packer_bench_runs_on_a_detection_dataset(tmp_path):
    """`packer bench` (its training harness run on the CPU) feeds a detection dataset's
    images to the step; the targets (lists of dicts) do not break it."""
    from packer import build
    from packer.sources import Coco
    from packer.bench.run import run_bench
    from packer.demo.scenes import make_detection_folder
    root = make_detection_folder(tmp_path / "det", images=24, seed=2)
    build(Coco(root / "images", root / "annotations.json"), tmp_path / "p", progress=False,
          workers=0)
    rep = run_bench(tmp_path / "p", cuda=True, device="cpu", model="tiny", repeats=1,
                    seconds_per_variant=0.3, workers=[1], batch_size=4, progress=False,
                    max_images=16, cold_cache=False)
    trained = [r for r in rep.results if r["kind"] == "train" and "synthetic" not in r["name"]]
    assert trained and all(r["images_per_s"] > 0 for r in trained)
