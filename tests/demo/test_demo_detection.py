"""``packer demo --detection`` / ``run_detection_demo`` and its baseline, ``CocoFolderDataset``:
the folder loader gives the packed loader's targets, image for image."""
import random
import tempfile

import pytest
import torch
from click.testing import CliRunner

from packer import build
from packer.sources import Coco
from packer.cli import main
from packer.reading.dataset import PackedDataset
from packer.transforms.decode import DecodeLetterbox, DecodeRandomResizedCrop
from packer.demo import DEMO_MARKER, CocoFolderDataset, run_detection_demo
from packer.demo.detection import compare_targets
from packer.demo.scenes import make_detection_folder
from packer.errors import PackerError
from packer.reading.targets import DETECTION_KEYS

SMALL = dict(images=48, batch_size=8, workers=1, rounds=1, progress=False)
STEPS = ["make scenes", "build --coco", "verify", "stage", "folder loader", "packed loader"]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """(temp root, stage root): the demo's temporary folder and RAM copy land in tmp_path."""
    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    tmp.mkdir()
    shm.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp, shm


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """(scenes folder, packed dataset) of 24 scenes, 2 of them empty."""
    root = make_detection_folder(tmp_path_factory.mktemp("det") / "coco", images=24, seed=5)
    dst = root.parent / "packed"
    build(Coco(root / "images", root / "annotations.json"), dst, progress=False, workers=0)
    return root, dst


def ours(folder):
    """What the demo left in ``folder`` (importing torchvision may leave torch's own cache)."""
    return [p for p in folder.iterdir() if p.name.startswith("packer-")]


def plain(target: dict) -> dict:
    return {k: v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v
            for k, v in target.items()}


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want) == set(DETECTION_KEYS)
    g, w = plain(got), plain(want)
    assert g["image_id"] == w["image_id"]
    for k in ("boxes", "labels", "area", "iscrowd"):
        assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k


def test_demo_measures_both_loaders_checks_targets_and_leaves_nothing(sandbox):
    tmp, shm = sandbox
    seen = []
    res = run_detection_demo(stage_dir=shm, on_step=seen.append, **SMALL)
    assert seen == STEPS and [s.name for s in res.steps] == STEPS
    assert res.folder_images_per_s > 0 and res.packed_images_per_s > 0
    assert res.images_checked == 48 and res.mismatched == [] and res.targets_equal
    assert res.classes == 7 and res.objects > 48
    assert ours(tmp) == [] and list(shm.iterdir()) == []
    text = res.report()
    assert text.splitlines()[0].startswith(
        f"packer demo --detection: 48 scenes, {res.objects} objects in 7 categories; "
        f"1 loader worker, batch 8, letterbox 640; ")
    assert f"{res.ratio:.2f}x" in text
    assert "Targets: equal for all 48 images" in text
    assert "OK: 1 shard(s), 48 records" in text and "Nothing was kept" in text


def test_kept_dir_holds_scenes_and_dataset(tmp_path, sandbox):
    _, shm = sandbox
    d = tmp_path / "demo"
    res = run_detection_demo(d, stage_dir=None, **dict(SMALL, images=16))
    assert (d / DEMO_MARKER).is_file() and res.dir == d
    assert (d / "coco" / "annotations.json").is_file()
    assert sum(1 for _ in (d / "coco" / "images").glob("*.jpg")) == 16
    ds = PackedDataset(d / "packed")
    assert len(ds) == 16 and ds.task == "detection"
    text = res.report()
    assert f"Kept in {d}: coco/" in text and f"packer info {d / 'packed'}" in text
    assert "PackedDataset (shards)" in text
    res2 = run_detection_demo(d, stage_dir=None, **dict(SMALL, images=12))  # replaced
    assert len(PackedDataset(d / "packed")) == 12 and res2.targets_equal


def test_refuses_a_folder_it_did_not_make(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("precious")
    with pytest.raises(PackerError, match="not made by `packer demo`"):
        run_detection_demo(d, **SMALL)
    assert [p.name for p in d.iterdir()] == ["notes.txt"]


def test_failed_run_cleans_up(sandbox):
    tmp, shm = sandbox

    def boom(step):
        if step == "packed loader":
            raise RuntimeError("stop here")
    with pytest.raises(RuntimeError):
        run_detection_demo(stage_dir=shm, on_step=boom, **SMALL)
    assert ours(tmp) == [] and list(shm.iterdir()) == []


def test_workers_is_also_the_scene_makers(sandbox, monkeypatch):
    """``-j 1`` (one process makes and packs) held for the scenes too: they were made on
    every usable core whatever ``workers`` said."""
    from packer.demo import detection
    asked = []

    def spy(*args, **kwargs):
        asked.append(kwargs.get("workers"))
        raise RuntimeError("made")
    monkeypatch.setattr(detection, "make_detection_folder", spy)
    with pytest.raises(RuntimeError, match="made"):
        run_detection_demo(stage_dir=sandbox[1], **dict(SMALL, workers=1))
    assert asked == [1]


def test_compare_targets_names_what_differs():
    box = torch.tensor([[0.0, 0.0, 4.0, 4.0]])
    a = {7: (box, torch.tensor([1])), 14: (box, torch.tensor([3])), 21: (box, torch.tensor([5]))}
    b = {7: (box, torch.tensor([1])), 14: (box + 1, torch.tensor([3])),
         28: (box, torch.tensor([5]))}
    assert compare_targets(a, a) == (3, [])
    assert compare_targets(a, b) == (2, [14, 21, 28])


def test_coco_folder_targets_equal_packed_for_every_index(coco):
    root, dst = coco
    folder = CocoFolderDataset(root / "images", root / "annotations.json")
    packed = PackedDataset(dst, target_keys=DETECTION_KEYS)
    assert len(folder) == len(packed) == 24
    assert folder.ids == sorted(folder.ids) and folder.categories[0]["id"] == 1
    empty = 0
    for i in range(len(packed)):
        (im, want), (fim, got) = packed[i], folder[i]
        assert fim.size == im.size  # PIL, as ImageFolder / CocoDetection give
        assert_same(got, want)
        empty += len(got["boxes"]) == 0
    assert empty == 2


@pytest.mark.parametrize("decode", [DecodeLetterbox(320), DecodeRandomResizedCrop(160)],
                         ids=["letterbox", "random-resized-crop"])
def test_boxes_move_the_same_way(coco, decode):
    root, dst = coco
    folder = CocoFolderDataset(root / "images", root / "annotations.json", decode=decode)
    packed = PackedDataset(dst, decode=decode, target_keys=DETECTION_KEYS)
    for i in range(len(packed)):
        random.seed(i)  # the same crop and flip for both
        im, want = packed[i]
        random.seed(i)
        fim, got = folder[i]
        assert torch.equal(im, fim)
        assert_same(got, want)


def test_joint_transforms_run_after_the_decode(coco):
    root, _ = coco
    calls = []

    def transforms(image, target):
        calls.append(target["image_id"])
        return image, dict(target, seen=True)
    folder = CocoFolderDataset(root / "images", root / "annotations.json",
                               decode=DecodeLetterbox(64), transforms=transforms)
    image, target = folder[3]
    assert tuple(image.shape) == (3, 64, 64) and target["seen"] and calls == [folder.ids[3]]


def test_matches_torchvision_coco_detection(coco):
    pytest.importorskip("torchvision")
    pytest.importorskip("pycocotools")
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
    root, _ = coco
    ref = wrap_dataset_for_transforms_v2(
        CocoDetection(str(root / "images"), str(root / "annotations.json")),
        target_keys=set(DETECTION_KEYS))
    folder = CocoFolderDataset(root / "images", root / "annotations.json")
    for i in range(len(folder)):
        (ref_im, want), (im, got) = ref[i], folder[i]
        assert im.size == ref_im.size and got["image_id"] == want["image_id"]
        if set(want) == {"image_id"}:  # torchvision: an image without objects has no boxes key
            assert len(got["boxes"]) == 0
            continue
        torch.testing.assert_close(plain(got)["boxes"], plain(want)["boxes"], atol=1e-3, rtol=0)
        assert torch.equal(got["labels"], want["labels"])
        assert got["boxes"].canvas_size == want["boxes"].canvas_size


def test_cli_demo_detection(tmp_path, sandbox):
    d = tmp_path / "kept"
    r = CliRunner().invoke(main, ["demo", "--detection", str(d), "--images", "16", "-b", "8",
                                  "-j", "1", "--no-stage", "-q"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("packer demo --detection: 16 scenes, ")
    assert "1 loader worker, batch 8, letterbox 640" in lines[0]
    assert any(line.startswith("packed loader ") and "COCO folder loader" in line for line in lines)
    assert "Targets: equal for all 16 images" in r.output
    assert (d / "coco" / "annotations.json").is_file() and (d / "packed").is_dir()
