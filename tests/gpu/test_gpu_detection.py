"""The GPU path on detection datasets: targets collated per batch, boxes moved with the
GPU's crops, flips and letterbox, objects cut away dropped; against plain-Python references.

On the CPU with PIL standing in for nvJPEG here; the ``gpu``-marked tests run the same checks
with nvJPEG and the Triton kernel on a CUDA device.
"""
from __future__ import annotations

import pytest
import torch

from packer import PackedDataset, build
from packer.sources import Coco
from packer.demo.scenes import make_detection_folder
from packer.gpu import GPUDecoder, GPUOptions, make_gpu_loader
from packer.gpu.augment import random_resized_crop_boxes
from packer.gpu.detection import DetectionTargets

from helpers import cuda, pil_decoder

SIZE = (256, 320)


@pytest.fixture(scope="module")
def det(tmp_path_factory):
    root = make_detection_folder(tmp_path_factory.mktemp("det") / "det", images=12, seed=5)
    dst = root.parent / "packed"
    build(Coco(root / "images", root / "annotations.json"), dst, progress=False, workers=0)
    return dst


def decoder(det, device, min_visible=0.25, **kw):
    opts = dict(overlap=0, min_visible=min_visible)
    if device == "cpu":
        opts.update(decoder=pil_decoder)
    loader = make_gpu_loader(det, 6, num_workers=0, shuffle=False)
    return GPUDecoder(loader, size=SIZE, device=device, dtype=torch.uint8, seed=0,
                      options=GPUOptions(**opts), **kw)


def source_targets(det):
    ds = PackedDataset(det)
    return [ds[i][1] for i in range(len(ds))], [(r["height"], r["width"]) for r in map(ds.load, range(len(ds)))]


def reference_crop(box, crop, flipped, min_visible):
    """One box through one crop + resize + flip, in plain Python: (box, kept)."""
    x0, y0, x1, y1 = crop
    oh, ow = SIZE
    sx, sy = ow / (x1 - x0), oh / (y1 - y0)
    b = [(box[0] - x0) * sx, (box[1] - y0) * sy, (box[2] - x0) * sx, (box[3] - y0) * sy]
    if flipped:
        b = [ow - b[2], b[1], ow - b[0], b[3]]
    full = (b[2] - b[0]) * (b[3] - b[1])
    c = [min(max(b[0], 0), ow), min(max(b[1], 0), oh), min(max(b[2], 0), ow), min(max(b[3], 0), oh)]
    area = max(c[2] - c[0], 0) * max(c[3] - c[1], 0)
    return c, area > 0 and area >= min_visible * full


def check_crops(det, device):
    dec = decoder(det, device, min_visible=0.4)
    targets, _ = source_targets(det)
    batch = next(iter(dec.loader))
    assert isinstance(batch.labels, DetectionTargets)
    item = dec.decode_batch(batch)
    images, out = dec.augment_batch(item, seed=1234)
    gen = torch.Generator().manual_seed(1234)
    crops = random_resized_crop_boxes(batch.sizes, dec.options.scale, dec.options.ratio, generator=gen)
    flips = torch.rand(len(batch.sizes), generator=gen) < 0.5
    assert images.shape == (6, 3, *SIZE) and images.device.type == torch.device(device).type
    dropped = 0
    for i, got in enumerate(out):
        want = [reference_crop(b.tolist(), crops[i].tolist(), bool(flips[i]), 0.4)
                for b in targets[i]["boxes"]]
        kept = [b for b, k in want if k]
        dropped += len(want) - len(kept)
        assert got["boxes"].device.type == torch.device(device).type
        assert got["image_id"] == targets[i]["image_id"]
        assert len(got["boxes"]) == len(kept)
        if kept:
            torch.testing.assert_close(got["boxes"].as_subclass(torch.Tensor).cpu(),
                                       torch.tensor(kept, dtype=torch.float32), atol=1.0, rtol=0)
        keep = torch.tensor([k for _, k in want], dtype=torch.bool)
        assert torch.equal(got["labels"].cpu(), targets[i]["labels"][keep])
    return dropped


def check_letterbox(det, device):
    dec = decoder(det, device, letterbox=True, train=False)
    targets, sizes = source_targets(det)
    seen = 0
    for images, out in dec:
        for im, got in zip(images, out):
            h, w = sizes[seen]
            r = min(SIZE[0] / h, SIZE[1] / w)
            nh, nw = round(h * r), round(w * r)
            top, left = (SIZE[0] - nh) // 2, (SIZE[1] - nw) // 2
            pad = torch.ones(SIZE, dtype=torch.bool)
            pad[top:top + nh, left:left + nw] = False
            assert bool((im.cpu()[:, pad] == 114).all())  # the padding is YOLO's grey
            assert not bool((im.cpu()[:, ~pad] == 114).all())
            want = targets[seen]["boxes"] * r + torch.tensor([left, top, left, top])
            torch.testing.assert_close(got["boxes"].as_subclass(torch.Tensor).cpu(), want,
                                       atol=1.0, rtol=0)
            seen += 1
    assert seen == len(targets)


def test_crops_move_boxes_on_cpu(det):
    check_crops(det, "cpu")


def test_letterbox_on_cpu(det):
    check_letterbox(det, "cpu")


@pytest.mark.gpu
@cuda
def test_crops_move_boxes_on_gpu(det):
    check_crops(det, "cuda")


@pytest.mark.gpu
@cuda
def test_letterbox_on_gpu(det):
    check_letterbox(det, "cuda")


def eval_targets(ds):
    """(per-image targets out of the GPU path, evaluation crops on the CPU with PIL for
    nvJPEG; the dataset's own targets)."""
    dec = GPUDecoder(make_gpu_loader(ds, 6, num_workers=0, shuffle=False), size=SIZE,
                     device="cpu", dtype=torch.uint8, seed=0, train=False,
                     options=GPUOptions(overlap=0, decoder=pil_decoder))
    return [t for _, targets in dec for t in targets], [ds[i][1] for i in range(len(ds))]


def test_target_keys_follow_the_kept_boxes(det):
    """What ``target_keys`` asks the dataset for crosses the GPU path, cut with the boxes;
    masks (which a crop cannot move here) are refused with a clear error."""
    keys = ["boxes", "labels", "image_id", "area", "iscrowd"]
    ds = PackedDataset(det, target_keys=keys)
    got, want = eval_targets(ds)
    assert [list(t) for t in got] == [keys] * len(want)
    for g, w in zip(got, want):
        assert len(g["area"]) == len(g["iscrowd"]) == len(g["boxes"]) <= len(w["boxes"])
    with pytest.raises(Exception, match="not masks"):
        next(iter(make_gpu_loader(PackedDataset(det, target_keys="all"), 6, num_workers=0)))



@pytest.mark.parametrize("keys", [["boxes", "labels"], ["boxes", "image_id"], ["boxes"],
                                  ["labels", "boxes", "iscrowd", "image_id"]])
def test_any_target_keys_cross_the_gpu_path_as_the_cpu_path_gives_them(det, keys):
    # without labels or image_id this was a KeyError; the key order is the dataset's
    ds = PackedDataset(det, target_keys=keys)
    got, want = eval_targets(ds)
    assert [list(t) for t in got] == [list(w) for w in want]
    for g, w in zip(got, want):
        if "image_id" in keys:
            assert g["image_id"] == w["image_id"]
        for k in set(keys) & {"labels", "iscrowd"}:
            assert len(g[k]) == len(g["boxes"])


def test_per_image_fields_cross_whole_and_per_object_ones_are_cut(tmp_path):
    # a per-image array as long as the boxes was cut like them; an int field crashed
    import random
    import packer
    from packer.demo import load_photos, make_image
    rng, photos = random.Random(0), load_photos()
    samples = [{"image": make_image(rng, photos, size=(320, 256)), "image_id": k,
                "boxes": [[0.0, 0.0, 40.0, 40.0], [200.0, 150.0, 320.0, 256.0]],
                "labels": [1, 2], "cam": [100 + k, 200], "scene": 7 * k,
                "keypoints": [[5, 5], [250, 200]], "K": [[1.0, 0.0], [0.0, 1.0]]}
               for k in range(6)]
    packer.write(tmp_path / "d", samples, progress=False)
    ds = PackedDataset(tmp_path / "d", target_keys="all")
    dec = GPUDecoder(make_gpu_loader(ds, 3, num_workers=0, shuffle=False), size=(64, 64),
                     device="cpu", dtype=torch.uint8, seed=1, train=True,
                     options=GPUOptions(overlap=0, decoder=pil_decoder,
                                        scale=(0.2, 0.3)))
    got = [t for _, targets in dec for t in targets]
    assert [t["scene"] for t in got] == [7 * k for k in range(6)]
    assert [t["cam"].tolist() for t in got] == [[100 + k, 200] for k in range(6)]
    assert all(len(t["labels"]) == len(t["boxes"]) == len(t["keypoints"]) for t in got)
    assert all(t["K"].tolist() == [[1.0, 0.0], [0.0, 1.0]] for t in got)  # the image's
    assert any(len(t["boxes"]) < 2 for t in got)  # some crops cut a box away


def test_boxes_move_per_batch_not_per_image():
    """``place_boxes`` copies each field to the device once per batch, whatever the number of
    images (a copy per image stalled the decode thread, and every torch call made there
    waits for the training loop's GIL)."""
    from torch.overrides import TorchFunctionMode

    from packer.gpu.detection import place_boxes

    class Copies(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += getattr(func, "__name__", "") in ("to", "cuda", "copy_", "pin_memory")
            return func(*args, **(kwargs or {}))

    def copies(images):
        counts = torch.tensor([2] * images)
        boxes = torch.tensor([[10.0, 10, 50, 40], [0, 0, 300, 200]]).repeat(images, 1)
        targets = DetectionTargets(boxes, counts,
                                   {"labels": torch.arange(2 * images), "area": boxes[:, 0]},
                                   {"image_id": list(range(images))},
                                   ("boxes", "labels", "image_id", "area"))
        crops = torch.tensor([[0.0, 0, 320, 256]]).repeat(images, 1).double()
        with Copies() as mode:
            out = place_boxes(targets, crops, SIZE, None, 0.25, torch.device("cpu"))
        assert [len(t["boxes"]) for t in out] == [2] * images
        assert [t["labels"].tolist() for t in out] == [[2 * i, 2 * i + 1] for i in range(images)]
        return mode.n
    assert copies(2) == copies(16)


def test_targets_of_fields_cross_the_gpu_path_as_collated(det):
    # dict targets (target_fields) were an AttributeError: labels.to on a dict
    ds = PackedDataset(det, target_fields=["image_id"])
    dec = GPUDecoder(make_gpu_loader(ds, 6, num_workers=0, shuffle=False), size=SIZE,
                     device="cpu", dtype=torch.uint8, seed=0, train=False,
                     options=GPUOptions(overlap=0, decoder=pil_decoder))
    got = [targets for _, targets in dec]
    assert [t["image_id"].tolist() for t in got] == [
        [ds[i][1]["image_id"] for i in range(k, k + 6)] for k in range(0, len(ds), 6)]
