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
from packer.demo.scenes import make_detection_folder  # noqa: E402

KEYS = ("boxes", "labels", "image_id", "area", "iscrowd")


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = make_detection_folder(tmp_path_factory.mktemp("det") / "det", images=24, seed=3)
    dst = root.parent / "packed"
    build(root / "images", dst, coco=root / "annotations.json", progress=False, workers=0)
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
