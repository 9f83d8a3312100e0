"""The small things a newcomer tripped on (issue 27's list), each as the user meets it."""
from __future__ import annotations

import json
import os
import re

import pytest
from click.testing import CliRunner

from helpers import imagefolder_rule
from packer import PackedDataset, build
from packer._util.system import busy_cores
from packer.bench.run import BenchReport
from packer.bench.verdict import explain
from packer.cli import main
from packer.demo.scenes import make_detection_folder


def invoke(*args, code=0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == code, f"exit {res.exit_code}, want {code}\n{res.output}\n{res.exception!r}"
    return res


@pytest.fixture(scope="module")
def classified(photo_src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("newcomer") / "ds"
    build(photo_src, dst, workers=0, progress=False)
    return PackedDataset(dst)


def test_indices_as_for_a_list(classified):
    n = len(classified)
    assert classified[-n][1] == classified[0][1]
    with pytest.raises(IndexError, match=rf"^record -{n + 1} out of range for a dataset of {n}$"):
        classified[-n - 1]
    with pytest.raises(IndexError, match=rf"^record {n} out of range for a dataset of {n}$"):
        classified.samples[n]
    with pytest.raises(TypeError, match="^record indices must be integers, not str$"):
        classified["x"]
    assert classified.samples[-1] == classified.samples[n - 1]


def test_samples_equal_imagefolders(classified, photo_src):
    """``ImageFolder(root).samples`` is this list (helpers.imagefolder_rule is torchvision's
    rule; tests/test_torchvision_parity.py compares with torchvision itself)."""
    _, _, samples = imagefolder_rule(photo_src)
    want = [(os.path.join(str(photo_src.resolve()), p), label) for p, label in samples]
    assert classified.samples == want and want == classified.samples
    assert classified.samples != want[:-1] and classified.samples != "x"


def test_a_meta_build_says_it_has_no_class_labels(photo_src, tmp_path):
    meta = tmp_path / "meta.jsonl"
    rows = [{"path": p, "caption": f"photo {i}"} for i, p in
            enumerate(p for p, _ in imagefolder_rule(photo_src)[2])]
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = invoke("build", photo_src, tmp_path / "d", "--meta", meta, "-q").stdout
    assert re.fullmatch(r"packed 48 images with no class labels into 1 shard\(s\), [\d.]+ (?:KiB|MiB); "
                        r"skipped 0; [\d.]+ s -> .*\n", out), out
    assert invoke("info", tmp_path / "d").stdout.startswith(
        f"{tmp_path / 'd'}: 48 images, no class labels, 1 shard(s), ")


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    return make_detection_folder(tmp_path_factory.mktemp("coco") / "c", 10, workers=1)


def test_coco_info_lists_category_ids_and_skip_empty_counts(coco, tmp_path):
    ann = json.loads((coco / "annotations.json").read_text())
    out = invoke("build", coco / "images", tmp_path / "d", "--coco", coco / "annotations.json",
                 "--skip-empty", "-q", "-j", "0").stdout
    assert re.fullmatch(rf"packed 9 images in {len(ann['categories'])} categories into 1 "
                        r"shard\(s\), [\d.]+ (?:KiB|MiB); skipped 0, left out 1 without annotations "
                        r"\(--skip-empty\); [\d.]+ s -> .*\n", out), out
    text = invoke("info", tmp_path / "d").stdout
    assert "\ncategories (labels are these ids):\n" + "".join(
        f"  {c['id']:>5}  {c['name']}\n" for c in ann["categories"]) in text
    assert "\nleft out (--skip-empty): 1 images without annotations\n" in text
    i = json.loads(invoke("info", tmp_path / "d", "--json").stdout)
    assert i["skipped_empty"] == 1 and [c["id"] for c in i["categories"]] == \
        [c["id"] for c in ann["categories"]]


def bench_report(core_alone: float, core_busy: float, all_busy: float) -> BenchReport:
    """An idle 2-core box whose loader reaches 60 % of 2 x one core's rate alone."""
    rep = BenchReport(environment={"cores": 2, "storage": {}})
    rep.results = [
        {"name": "decode reduced-size", "kind": "decode", "images_per_s": core_alone,
         "ceiling_images_per_s": 2 * core_alone},
        {"name": "loader packed 2 workers", "kind": "loader", "source": "packed", "workers": 2,
         "images_per_s": 1.2 * core_alone}]
    rep.figures = {"loader_efficiency": {"core_images_per_s": core_alone, "workers": 2,
                                         "core_busy_images_per_s": core_busy,
                                         "all_cores_busy": {"median": all_busy}}}
    return rep


def test_bench_blames_cores_that_do_not_scale_not_the_loader():
    verdict = explain(bench_report(500, 310, 0.97))
    assert ("the rest is lost to cores that slow down when all are busy (one core's ds[i] loop: "
            "500 images/s alone, 310 with 2 at once).") in verdict
    assert "loader overhead" not in verdict and "Caution" not in verdict
    assert "the rest is lost to loader overhead" in explain(bench_report(500, 490, 0.6))


def test_busy_cores_counts_other_processes_not_this_one():
    busy = busy_cores(0.2)
    assert busy is None or 0 <= busy <= os.cpu_count()
