"""A batch crosses from a worker to the main process as one shared block
(``packer.loading.sharedbatch``) and reads back exactly as the worker made it."""
import pickle

import pytest
import torch
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

from packer import PackedDataset, build, make_loader
from packer.sources import Coco
from packer.transforms.decode import DecodeLetterbox
from packer.demo.scenes import make_detection_folder
from packer.loading.sharedbatch import SharedBatch


@pytest.fixture(scope="module")
def detection(tmp_path_factory):
    pytest.importorskip("torchvision.tv_tensors")  # detection targets are tv_tensors
    base = tmp_path_factory.mktemp("shared")
    src = make_detection_folder(base / "coco", images=24, seed=5)
    build(Coco(src / "images", src / "annotations.json"), base / "packed", workers=0,
          progress=False)
    return PackedDataset(base / "packed", decode=DecodeLetterbox(160))


def tensors_of(targets):
    return [v for t in targets for v in t.values() if isinstance(v, torch.Tensor)]


def test_workers_hand_over_all_targets_of_a_batch_in_one_block(detection):
    """Every target tensor of a batch from a worker lies in one storage; without
    ``SharedBatch`` each had its own (a socket round trip each in the main process)."""
    loader = make_loader(detection, 8, num_workers=2, shuffle=False, pin_memory=False,
                         persistent_workers=False)
    local = make_loader(detection, 8, num_workers=0, shuffle=False, pin_memory=False)
    batches = 0
    for (images, targets), (want_images, want) in zip(loader, local):
        batches += 1
        assert type(targets) is list
        assert torch.equal(images, want_images)
        storages = {t.untyped_storage().data_ptr() for t in tensors_of(targets)}
        assert len(storages) == 1, "each target tensor crossed on its own"
        for got, exp in zip(targets, want):
            assert got.keys() == exp.keys()
            for k, v in exp.items():
                if isinstance(v, torch.Tensor):
                    assert type(got[k]) is type(v) and got[k].dtype == v.dtype
                    assert torch.equal(got[k].as_subclass(torch.Tensor), v.as_subclass(torch.Tensor))
                else:
                    assert got[k] == v
            assert got["boxes"].canvas_size == exp["boxes"].canvas_size
            assert got["boxes"].format == exp["boxes"].format
    assert batches == 3


def test_any_structure_round_trips_through_the_worker_pickler():
    tv_tensors = pytest.importorskip("torchvision.tv_tensors")
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[1.0, 2, 30, 40]]), format="XYXY",
                                     canvas_size=(50, 60))
    odd = torch.arange(12, dtype=torch.int16).reshape(3, 4)[:, ::2]  # not contiguous
    batch = SharedBatch([
        {"boxes": boxes, "labels": torch.tensor([3]), "image_id": 7, "caption": "a cat"},
        {"boxes": boxes[:0], "labels": torch.zeros(0, dtype=torch.int64), "image_id": 8,
         "nested": [odd, (torch.tensor(True), "x")]},
        torch.rand(3, 5, 7),
        torch.eye(3).to_sparse(),  # not dense: pickled on its own, unchanged
    ])
    out = pickle.loads(ForkingPickler.dumps(batch))
    assert type(out) is list and len(out) == 4
    assert out[3].is_sparse and torch.equal(out[3].to_dense(), torch.eye(3))
    assert isinstance(out[0]["boxes"], tv_tensors.BoundingBoxes)
    assert out[0]["boxes"].canvas_size == (50, 60) and torch.equal(out[0]["boxes"], boxes)
    assert (out[0]["image_id"], out[0]["caption"]) == (7, "a cat")
    assert out[1]["boxes"].shape == (0, 4) and out[1]["labels"].dtype == torch.int64
    assert torch.equal(out[1]["nested"][0], odd) and out[1]["nested"][0].dtype == torch.int16
    assert type(out[1]["nested"][1]) is tuple and out[1]["nested"][1][0].item() is True
    assert torch.equal(out[2], batch[2])
    ptrs = {t.untyped_storage().data_ptr() for t in (out[0]["boxes"], out[1]["nested"][0], out[2])}
    assert len(ptrs) == 1
    assert all(t.data_ptr() % 8 == 0 for t in (out[0]["labels"], out[2]))


def test_in_the_worker_it_is_the_list_it_holds():
    batch = SharedBatch([{"a": torch.ones(2)}])
    assert isinstance(batch, list) and len(batch) == 1
    assert torch.equal(batch[0]["a"], torch.ones(2))
