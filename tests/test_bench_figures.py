"""``packer bench``'s PIL line and issue 16's three figures (build rate ratio, loader
efficiency, epoch-boundary wait), measured on a copy of a sample of the dataset's own images
in the system's temporary folder. Real shards, real photo JPEGs; no timing thresholds."""
from __future__ import annotations

import io
import json
import math
import statistics
import tempfile

import pytest
from click.testing import CliRunner
from PIL import Image

from packer import build, write
from packer._util.system import pil_info
from packer.bench.build import sample_folder
from packer.bench.efficiency import steady_loader_rate
from packer.bench.phases import FIGURE_EPOCHS, FIGURE_IMAGES, figure_plan
from packer.bench.run import run_bench
from packer.cli import main
from packer.reading.dataset import PackedDataset
from packer.transforms.decode import DecodeRandomResizedCrop
from packer.errors import PackerError

QUICK = dict(workers=[1], batch_size=8, repeats=2, seconds_per_variant=0.2, max_images=24,
             cold_cache=False, progress=False)
FIGURES = ("build_ratio", "loader_efficiency", "epoch_wait_ms")


@pytest.fixture(scope="module")
def packed(photo_src, tmp_path_factory):
    """``photo_src`` (48 photo JPEGs, 4 classes) built into a dataset."""
    dst = tmp_path_factory.mktemp("figures") / "packed"
    build(photo_src, dst, workers=0, progress=False)
    return dst


@pytest.fixture(scope="module")
def own_tmp(tmp_path_factory):
    """The system's temporary folder, pointed at a folder of this test's own."""
    tmp = tmp_path_factory.mktemp("systemp")
    before, tempfile.tempdir = tempfile.tempdir, str(tmp)
    yield tmp
    tempfile.tempdir = before


@pytest.fixture(scope="module")
def report(packed, own_tmp):
    listing = sorted(p.name for p in packed.parent.iterdir())
    rep = run_bench(packed, **QUICK)
    assert sorted(p.name for p in packed.parent.iterdir()) == listing  # nothing beside the data
    # the copy went to the temporary folder, and is gone (multiprocessing's own pymp-* folders,
    # made for the build's shared counter, are removed when the interpreter exits)
    assert [p for p in own_tmp.iterdir() if not p.name.startswith("pymp-")] == []
    return rep


def test_pil_line_says_which_pil_ran(report):
    info = pil_info()
    env = report.environment
    assert env["pil_flavour"] == info["flavour"] and env["pil_version"] == info["version"]
    assert env["pil_simd"] is info["simd"]
    line = next(s for s in report.header().splitlines() if s.startswith("PIL: "))
    want = "PIL: Pillow-SIMD " if info["simd"] else "PIL: Pillow "
    assert line.startswith(want + info["version"]), line
    assert ("(stock, not Pillow-SIMD)" in line) is (not info["simd"])


def test_build_ratio(report):
    b = report.figures["build_ratio"]
    assert b["images"] == 24 and b["workers"] == b["cores"] == report.environment["cores"]
    assert len(b["values"]) == 2 and all(v > 0 for v in b["values"])
    assert b["median"] == statistics.median(b["values"])
    assert b["spread"] == [min(b["values"]), max(b["values"])] and b["goal"] == 0.8
    assert b["build_images_per_s"] > 0 and b["decode_images_per_s"] > 0


def test_loader_efficiency(report):
    e = report.figures["loader_efficiency"]
    assert e["images"] == 24 and e["workers"] == 1 and e["batch_size"] == 8 and e["goal"] == 0.9
    assert len(e["values"]) == 2 and all(v > 0 for v in e["values"])
    assert e["median"] == statistics.median(e["values"])
    assert e["loader_images_per_s"] > 0 and e["core_images_per_s"] > 0
    busy = e["all_cores_busy"]
    assert e["core_busy_images_per_s"] > 0 and len(busy["values"]) == 2
    assert busy["median"] == statistics.median(busy["values"])


def test_epoch_wait(report):
    w = report.figures["epoch_wait_ms"]
    assert w["epochs"] == FIGURE_EPOCHS and w["images"] == 24 and w["batch_size"] == 8
    assert w["workers"] == 1 and w["step_ms"] >= 0
    for key in ("make_loader", "plain_dataloader"):
        assert len(w[key]["values"]) == 2 * FIGURE_EPOCHS  # per repeat, one per epoch
        assert all(v > 0 for v in w[key]["values"])
        assert w[key]["median"] == statistics.median(w[key]["values"])
        assert 0 < w["kept"][key] <= 1.0


def test_json_and_text(report):
    doc = json.loads(json.dumps(report.to_json()))
    for key in ("packer", "results", "config", "environment", "notes", "verdict"):
        assert key in doc  # every key it had
    assert doc["build_ratio"] == report.figures["build_ratio"]
    assert doc["loader_efficiency"] == report.figures["loader_efficiency"]
    assert doc["epoch_wait_ms"]["plain_dataloader"]["values"] == \
        report.figures["epoch_wait_ms"]["plain_dataloader"]["values"]
    assert doc["config"]["figure_images"] == 24
    lines = report.figures_text().splitlines()
    assert lines[0].startswith("figures (a copy of 24 of the dataset's images")
    assert lines[1].startswith(f"  build rate ratio     {report.figures['build_ratio']['median']:.2f}")
    assert lines[2].startswith("  loader efficiency    ")
    assert lines[3].startswith("  epoch-boundary wait  ") and "plain DataLoader" in lines[3]


def test_skipped_with_zero(packed):
    rep = run_bench(packed, figure_images=0, **QUICK)
    assert rep.figures == {} and rep.figures_text() == ""
    doc = rep.to_json()
    assert all(doc[k] is None for k in FIGURES) and doc["config"]["figure_images"] == 0
    with pytest.raises(PackerError, match="figure_images must be >= 0"):
        run_bench(packed, figure_images=-1, **QUICK)


def test_no_room_for_the_copy_fails_before_measuring(packed, monkeypatch):
    monkeypatch.setattr("packer.bench.run.free_bytes", lambda path: 0)
    monkeypatch.setattr("packer.bench.phases.Runner.read_phase",
                        lambda *a, **k: pytest.fail("measured first"))
    with pytest.raises(PackerError, match="set TMPDIR to a folder with room"):
        run_bench(packed, **QUICK)


def test_cli(packed, own_tmp, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", str(packed), "-j", "1", "-b", "8", "-r", "1", "--seconds", "0.2",
            "--max-images", "24", "--warm", "-q"]
    res = CliRunner().invoke(main, args + ["--json", str(out)])
    assert res.exit_code == 0, res.output
    info = pil_info()
    assert f"\nPIL: {'Pillow-SIMD' if info['simd'] else 'Pillow'} {info['version']}" in res.output
    for label in ("build rate ratio", "loader efficiency", "epoch-boundary wait"):
        assert f"\n  {label} " in res.output
    assert res.output.index("epoch-boundary wait") < res.output.index("\nVerdict: ")
    doc = json.loads(out.read_text())
    assert all(doc[k] for k in FIGURES) and doc["environment"]["pil_version"] == info["version"]

    res = CliRunner().invoke(main, args + ["--figure-images", "0"])
    assert res.exit_code == 0, res.output
    assert "build rate ratio" not in res.output and "\nPIL: " in res.output
    res = CliRunner().invoke(main, args + ["--figure-images", "-1"])
    assert res.exit_code == 2 and "--figure-images" in res.output


def test_sample_folder_copies_stored_bytes(packed, tmp_path):
    ds = PackedDataset(packed)
    out = sample_folder(packed, tmp_path / "s", 10)
    files = sorted(out.rglob("*.jpg"))
    assert len(files) == 10
    for f in files:
        i = int(f.stem)
        assert f.read_bytes() == ds.load(i)["image"]
        assert f.parent.name == f"{ds.target(i):05d}"  # one folder per class label
    assert len({int(f.stem) for f in files}) == 10 and max(int(f.stem) for f in files) >= 40
    assert len(list(sample_folder(packed, tmp_path / "all", 1000).rglob("*.jpg"))) == len(ds)


def test_sample_folder_without_labels(photos, tmp_path):
    samples = []
    for k, im in enumerate(photos[:3]):
        buf = io.BytesIO()
        im.convert("RGB").save(buf, "PNG")
        samples.append({"image": buf.getvalue(), "path": f"p/{k}.PNG", "caption": f"photo {k}"})
    write(tmp_path / "d", samples, workers=0, progress=False)
    out = sample_folder(tmp_path / "d", tmp_path / "s", 5)
    files = sorted(out.rglob("*"))
    assert [f.relative_to(out).as_posix() for f in files if f.is_file()] == [
        "images/000000000.png", "images/000000001.png", "images/000000002.png"]
    assert Image.open(files[1]).format == "PNG"


def test_figure_plan():
    # default: FIGURE_IMAGES, or two batches per worker when more; workers at most the cores
    assert figure_plan(100_000, None, None, [1, 2], 64, 2) == (FIGURE_IMAGES, 2, 64)
    assert figure_plan(100_000, None, None, [0, 8, 16], 256, 16) == (8192, 16, 256)
    assert figure_plan(100_000, None, None, [4, 8], 64, 2) == (FIGURE_IMAGES, 2, 64)
    assert figure_plan(100_000, None, None, [0], 64, 2)[1] == 1
    assert figure_plan(100_000, None, 300, [2], 64, 2) == (300, 2, 64)  # --max-images caps
    assert figure_plan(100_000, 5000, 300, [2], 64, 2) == (5000, 2, 64)  # unless given
    assert figure_plan(40, None, None, [2], 64, 2) == (40, 2, 10)  # small: smaller batches
    assert figure_plan(3, 500, None, [2], 64, 2) == (3, 2, 1)


def test_steady_loader_rate(packed):
    ds = PackedDataset(packed, decode=DecodeRandomResizedCrop(64))
    rate = steady_loader_rate(ds, list(range(len(ds))), 8, 2)
    assert rate > 0 and math.isfinite(rate)
    short = steady_loader_rate(ds, list(range(16)), 8, 2)  # two batches: the whole run
    assert short > 0 and math.isfinite(short)
