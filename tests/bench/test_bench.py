"""``packer bench``: the library report, the CLI, the training harness (on the CPU), plots."""
import json
import math
import sys

import pytest
import torch
from click.testing import CliRunner

from packer.bench.run import BenchReport, run_bench
from packer.demo import FolderDataset
from packer import build
from packer.cli import main
from packer.bench.coldread import drop_page_cache
from packer.reading.dataset import PackedDataset
from packer.demo import make_image_folder
from packer.bench.models import make_model, resnet50

QUICK = dict(workers=[0], batch_size=8, repeats=2, seconds_per_variant=0.2, max_images=24,
             progress=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(source folder, packed dataset): 40 realistic JPEGs in 4 classes."""
    tmp = tmp_path_factory.mktemp("bench")
    src = make_image_folder(tmp / "src", images=40, classes=4)
    build(src, tmp / "packed", workers=0, progress=False)
    return src, tmp / "packed"


@pytest.fixture(scope="module")
def report(data, tmp_path_factory) -> BenchReport:
    """One quick bench over all three sources, with the page cache dropped (the default)."""
    src, dst = data
    staged = tmp_path_factory.mktemp("staged") / "copy"
    return run_bench(dst, folder=src, staged=staged, **QUICK)


def test_every_variant_measured_with_repeats_and_spread(report):
    names = [r["name"] for r in report.results]
    for want in ("read packed", "read folder", "read staged", "decode full-size + crop",
                 "decode reduced-size + crop", "decode reduced, packed --short-side 256",
                 "loader packed, 0 workers", "loader folder, 0 workers", "loader staged, 0 workers"):
        assert any(n.startswith(want) for n in names), (want, names)
    assert any(r["kind"] == "stage" and r["mb_per_s"] > 0 for r in report.results)
    for r in report.results:
        assert r["images_per_s"] > 0, r
        if r["kind"] != "stage":
            assert r["repeats"] == 2 and len(r["values"]) == 2, r
        lo, hi = r["spread"]
        assert lo <= r["images_per_s"] <= hi, r
    reads = report.of("read")
    assert all(r["mb_per_s"] > 0 for r in reads)
    assert report.environment["cache"] in ("cold (drop_caches)", "cold (fadvise DONTNEED)",
                                           "warm cache (could not drop it)")
    for d in report.of("decode"):
        assert math.isclose(d["ceiling_images_per_s"], d["images_per_s"] * report.environment["cores"])


def test_table_verdict_and_json(report):
    table = report.table()
    lines = table.splitlines()
    assert lines[0].startswith("| variant | images/s | spread |")
    assert len(lines) == 2 + len(report.results)
    assert "(n=2)" in table
    verdict = report.verdict()
    assert "of the CPU decode ceiling" in verdict and "Packed vs folder: raw reads" in verdict
    assert "Staged vs packed: raw reads" in verdict
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["verdict"] == verdict
    assert doc["config"]["repeats"] == 2
    assert {"name", "kind", "images_per_s", "repeats", "spread"} <= set(doc["results"][0])
    assert "median of 2 interleaved repeats" in report.header()


def test_cli_prints_table_and_writes_json(data, tmp_path):
    src, dst = data
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", str(dst), "--folder", str(src), "-j", "0,1", "-b", "8",
                                    "-r", "2", "--seconds", "0.2", "--max-images", "24", "--warm",
                                    "--json", str(out), "-q"])
    assert res.exit_code == 0, res.output
    assert "| variant | images/s | spread |" in res.output
    assert "\nVerdict: " in res.output
    assert "page cache: warm (not dropped)" in res.output
    assert res.output.rstrip().endswith(f"wrote {out}")
    doc = json.loads(out.read_text())
    names = [r["name"] for r in doc["results"]]
    assert "loader packed, 1 worker" in names and "loader folder, 1 worker" in names
    assert "loader packed, 0 workers" in names
    for r in doc["results"]:
        assert isinstance(r["name"], str) and r["images_per_s"] > 0
        assert r["repeats"] == 2 and len(r["spread"]) == 2


def test_cli_usage_errors(data):
    _, dst = data
    res = CliRunner().invoke(main, ["bench", str(dst), "--workers", "one,two"])
    assert res.exit_code == 2 and "not a comma-separated list of integers" in res.output
    res = CliRunner().invoke(main, ["bench", str(dst), "--workers", "-1"])
    assert res.exit_code == 2 and "worker counts must be >= 0" in res.output
    for flag in ("--json", "--plot"):  # refused before minutes of measuring, not after
        res = CliRunner().invoke(main, ["bench", str(dst), flag, "/nonexistent/dir/x.out"])
        assert res.exit_code == 2 and "/nonexistent/dir is not a folder this user can write " \
            "to" in res.output and flag in res.output, res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown without CUDA")
def test_cuda_without_a_gpu_fails_at_once(data):
    _, dst = data
    res = CliRunner().invoke(main, ["bench", str(dst), "--cuda", "-q"])
    assert res.exit_code == 1
    assert res.output.startswith("Error: cuda=True needs a CUDA GPU, but torch ")
    assert "measure reading, decoding and loading only (cuda=False)" in res.output


def test_plot_without_matplotlib_fails_before_measuring(data, tmp_path, monkeypatch):
    _, dst = data
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr("packer.bench.run.run_bench", lambda *a, **k: pytest.fail("measured first"))
    res = CliRunner().invoke(main, ["bench", str(dst), "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 1
    assert "Error: --plot needs matplotlib: pip install matplotlib" in res.output
    assert not (tmp_path / "p.png").exists()


def test_plot(report, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    report.plot(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.fixture
def one_thread():
    """Tiny CPU ops on a busy 2-core machine: intra-op threads only spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_training_harness_on_cpu(data, one_thread):
    """The --cuda phase's loop, feeders and bookkeeping, run on the CPU with a tiny model."""
    _, dst = data
    rep = run_bench(dst, cuda=True, device="cpu", model="tiny", size=64, cold_cache=False, **QUICK)
    train = rep.of("train")
    feeds = [r["feed"] for r in train]
    assert feeds == ["synthetic", "plain", "pin_memory + non_blocking", "background thread",
                     "CUDAPrefetcher", "thread + CUDAPrefetcher"]
    for r in train:
        assert r["images_per_s"] > 0 and r["data_wait_ms"] >= 0 and r["host_wait_ms"] >= 0
        assert 0 <= r["starvation_pct"] <= 100
        assert r["repeats"] == 2
    assert "starved %" in rep.table() and "data wait ms/step" in rep.table()
    assert "Training: the model steps at" in rep.verdict()
    assert rep.environment["data_wait_method"].startswith("host clock")


def test_folder_dataset_matches_packed(data):
    src, dst = data
    from packer.transforms.decode import DecodeCenterCrop
    folder = FolderDataset(src, decode=DecodeCenterCrop(64))
    packed = PackedDataset(dst, decode=DecodeCenterCrop(64))
    assert folder.classes == packed.classes and len(folder) == len(packed)
    for i in (0, 17, 39):
        (a, la), (b, lb) = folder[i], packed[i]
        assert la == lb and torch.equal(a, b)  # same bytes, same deterministic decode


def test_builtin_resnet50_is_resnet50_sized():
    net = resnet50(1000)
    assert sum(p.numel() for p in net.parameters()) == 25_557_032  # torchvision's resnet50
    assert net(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)
    assert make_model("tiny", 7)(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def test_unknown_model_fails_before_measuring(data):
    _, dst = data
    from packer.errors import PackerError
    with pytest.raises(PackerError, match="no_such_net"):
        run_bench(dst, cuda=True, device="cpu", model="no_such_net", **QUICK)


def test_drop_page_cache_says_how(data):
    _, dst = data
    how = drop_page_cache([dst / "labels.bin"])
    assert how in ("cold (drop_caches)", "cold (fadvise DONTNEED)", "warm cache (could not drop it)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_feeding_variants(data):
    _, dst = data
    rep = run_bench(dst, cuda=True, model="tiny", cold_cache=False,
                    **dict(QUICK, workers=[1], max_images=40))
    feeds = {r["feed"]: r for r in rep.of("train")}
    assert {"synthetic", "plain", "pin_memory + non_blocking", "background thread",
            "CUDAPrefetcher", "thread + CUDAPrefetcher"} <= set(feeds)
    assert rep.environment["data_wait_method"].startswith("CUDA events")
    assert rep.environment["gpu"]
