"""A packed COCO dataset gives what torchvision gives: ``CocoDetection`` wrapped with
``wrap_dataset_for_transforms_v2``, the same v2 joint transforms on both, compared record by
record (images, boxes, labels, ids, area, iscrowd, masks). Needs torchvision and pycocotools;
skipped without them."""
from __future__ import annotations

import pytest
import torch

tv = pytest.importorskip("torchvision")
pytest.importorskip("pycocotools")

from torchvision import tv_tensors  # noqa: E402
from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from packer import PackedDataset, build  # noqa: E402
from packer.sources import Coco, ImageFolder as PackedFolder  # noqa: E402
from packer.demo.scenes import make_detection_folder  # noqa: E402

KEYS = ("boxes", "labels", "image_id", "area", "iscrowd")


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = make_detection_folder(tmp_path_factory.mktemp("det") / "det", images=24, seed=3)
    dst = root.parent / "packed"
    build(Coco(root / "images", root / "annotations.json"), dst, progress=False, workers=0)
    return root, dst


def reference(root, transforms=None, keys=KEYS):
    ds = CocoDetection(str(root / "images"), str(root / "annotations.json"), transforms=transforms)
    return wrap_dataset_for_transforms_v2(ds, target_keys=set(keys))


def same_target(got: dict, want: dict, keys=KEYS) -> None:
    if set(want) == {"image_id"}:  # torchvision: an image without annotations has no other key
        assert got["image_id"] == want["image_id"] and len(got["boxes"]) == 0
        return
    for k in keys:
        g, w = got[k], want[k]
        if k == "image_id":
            assert g == w
            continue
        if isinstance(w, list):  # the wrapper passes area and iscrowd as lists; packer gives
            w = torch.tensor(w, dtype=g.dtype)  # tensors, as the detection references do
        assert type(g) is type(w), (k, type(g), type(w))
        assert g.shape == w.shape and g.dtype == w.dtype, (k, g.shape, w.shape, g.dtype, w.dtype)
        torch.testing.assert_close(g.as_subclass(torch.Tensor), w.as_subclass(torch.Tensor),
                                   atol=1e-3, rtol=0)
    assert got["boxes"].canvas_size == want["boxes"].canvas_size
    assert got["boxes"].format == want["boxes"].format


def test_targets_equal_torchvision_without_transforms(coco):
    root, dst = coco
    ref, ds = reference(root), PackedDataset(dst)
    assert len(ref) == len(ds)
    for i in range(len(ds)):
        (im, got), (ref_im, want) = ds[i], ref[i]
        assert im.size == ref_im.size
        assert isinstance(got["boxes"], tv_tensors.BoundingBoxes)
        same_target(got, want)


def test_v2_transforms_move_boxes_the_same(coco):
    root, dst = coco
    t = v2.Compose([v2.ToImage(), v2.RandomHorizontalFlip(0.5),
                    v2.RandomResizedCrop(320, scale=(0.3, 1.0), antialias=True)])
    ref, ds = reference(root, t), PackedDataset(dst, transforms=t)
    for i in range(len(ds)):
        torch.manual_seed(i)
        im, got = ds[i]
        torch.manual_seed(i)
        ref_im, want = ref[i]
        assert torch.equal(im, ref_im)
        same_target(got, want)


def test_masks_match_pycocotools(coco):
    root, dst = coco
    ref = reference(root, keys=KEYS + ("masks",))
    ds = PackedDataset(dst, masks=True)
    for i in range(len(ds)):
        got, want = ds[i][1], ref[i][1]
        if "masks" not in want:
            continue
        assert isinstance(got["masks"], tv_tensors.Mask) and got["masks"].shape == want["masks"].shape
        for g, w in zip(got["masks"].bool(), want["masks"].bool()):
            # PIL and pycocotools fill polygons by different rules: they may disagree on the
            # pixels along the outline, nowhere else.
            assert not bool(((g ^ w) & ~near_outline(w)).any())
            assert (g & w).sum() / (g | w).sum().clamp(min=1) > 0.9


def near_outline(m: torch.Tensor) -> torch.Tensor:
    """Pixels within one pixel of the edge of mask ``m``."""
    f = m[None, None].float()
    grown = torch.nn.functional.max_pool2d(f, 3, 1, 1)[0, 0] > 0
    shrunk = -torch.nn.functional.max_pool2d(-f, 3, 1, 1)[0, 0] > 0
    return grown & ~shrunk


# -- classification: the ImageFolder surface -------------------------------------------------------

def test_imagefolder_surface_attribute_by_attribute(tmp_path):
    from torchvision.datasets import ImageFolder
    from packer.demo import make_image_folder
    src = make_image_folder(tmp_path / "src", images=30, classes=3, seed=2).resolve()
    (src / "class_01" / "notes.txt").write_text("not an image")
    build(src, tmp_path / "p", progress=False, workers=0)
    ref, ds = ImageFolder(str(src)), PackedDataset(tmp_path / "p")
    assert len(ds) == len(ref)
    assert ds.classes == ref.classes and ds.class_to_idx == ref.class_to_idx
    assert ds.targets == ref.targets
    assert list(ds.samples) == ref.samples and list(ds.imgs) == ref.imgs
    assert ds.samples[-1] == ref.samples[-1] and ds.samples[:2] == ref.samples[:2]
    assert ds.find_classes(str(src)) == ref.find_classes(str(src))
    assert ds.find_classes() == (ref.classes, ref.class_to_idx)
    for i in (0, len(ds) // 2, len(ds) - 1):
        (im, y), (ref_im, ref_y) = ds[i], ref[i]
        assert y == ref_y and im.size == ref_im.size and im.tobytes() == ref_im.tobytes()
    # The same file choices: extensions and is_valid_file as torchvision's.
    pick = ImageFolder(str(src), is_valid_file=lambda p: p.endswith("0.jpg"), allow_empty=True)
    build(PackedFolder(src, is_valid_file=lambda p: p.endswith("0.jpg"), allow_empty=True),
          tmp_path / "q", progress=False, workers=0)
    assert list(PackedDataset(tmp_path / "q").samples) == pick.samples
