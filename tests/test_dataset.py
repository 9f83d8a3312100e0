"""PackedDataset: an ImageFolder drop-in (same classes, targets and pixels), safe across
pickling, fork and spawn."""
from __future__ import annotations

import gc
import pickle

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from helpers import imagefolder_rule
from packer.reading.dataset import PackedDataset
from packer.errors import FormatError
from packer.transforms.decode import DecodeCenterCrop


def good_samples(odd_tree):
    _, _, samples = imagefolder_rule(odd_tree.root)
    return [(p, lab) for p, lab in samples if p in odd_tree.good]


def test_same_pixels_as_imagefolder_for_every_file(odd_tree, odd_built):
    ds = PackedDataset(odd_built)
    samples = good_samples(odd_tree)
    assert len(ds) == len(samples)
    for i, (rel, label) in enumerate(samples):
        img, target = ds[i]
        with open(odd_tree.root / rel, "rb") as f:
            ref = Image.open(f).convert("RGB")  # torchvision's pil_loader
        assert img.mode == "RGB" and img.size == ref.size, rel
        assert img.tobytes() == ref.tobytes(), rel
        assert target == label


def test_classes_and_targets_follow_imagefolder(odd_tree, odd_built):
    ds = PackedDataset(odd_built)
    classes, class_to_idx, _ = imagefolder_rule(odd_tree.root)
    assert ds.classes == classes
    assert ds.class_to_idx == class_to_idx
    assert ds.targets == [lab for _, lab in good_samples(odd_tree)]
    assert [ds.target(i) for i in range(len(ds))] == ds.targets
    assert [ds.load(i)["path"] for i in range(len(ds))] == [p for p, _ in good_samples(odd_tree)]


def test_transforms_exif_and_indexing(odd_tree, odd_built):
    rel = "Z10/exif_rotated.jpg"
    i = [p for p, _ in good_samples(odd_tree)].index(rel)
    assert PackedDataset(odd_built)[i][0].size == (180, 100)  # ImageFolder ignores EXIF
    assert PackedDataset(odd_built, exif_orientation=True)[i][0].size == (100, 180)
    with pytest.raises(ValueError, match="exif_orientation=True applies to the default decode"):
        PackedDataset(odd_built, exif_orientation=True, decode=DecodeCenterCrop(64))  # was ignored
    ds = PackedDataset(odd_built, transform=lambda im: im.size, target_transform=lambda t: -t)
    assert ds[i] == ((180, 100), -1)
    assert ds[-1] == ds[len(ds) - 1]
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert len(list(iter(PackedDataset(odd_built, transform=lambda im: 0)))) == len(ds)
    assert repr(ds) == f"PackedDataset({str(odd_built)!r}, {len(ds)} records, 10 classes, 1 shards)"


def test_pickle_after_reading(odd_built):
    ds = PackedDataset(odd_built)
    first = ds[0][0].tobytes()
    data = pickle.dumps(ds)
    assert len(data) < 64 << 10  # no image data, no environments
    clone = pickle.loads(data)
    assert clone[0][0].tobytes() == first
    assert clone.targets == ds.targets
    del ds
    gc.collect()
    assert clone[1][1] == clone.targets[1]
    assert pickle.loads(pickle.dumps(clone))[2][1] == clone.targets[2]


def test_two_datasets_over_one_root(odd_built):
    a, b = PackedDataset(odd_built), PackedDataset(odd_built)
    assert a[0][0].tobytes() == b[0][0].tobytes()
    assert a[3][1] == b[3][1]
    del a
    gc.collect()
    assert b[4][0].size  # b's shard stays open after a is gone
    c = PackedDataset(odd_built)
    assert c[5][0].tobytes() == b[5][0].tobytes()


def check_loader(root, context):
    ds = PackedDataset(root, decode=DecodeCenterCrop(32))
    ds[0]  # opened in the parent first: workers must not reuse its environments
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    labels, shapes = [], set()
    for x, y in loader:
        assert x.dtype == torch.uint8
        shapes.add(tuple(x.shape[1:]))
        labels += y.tolist()
    assert shapes == {(3, 32, 32)}
    assert labels == ds.targets


def test_dataloader_fork(odd_built):
    check_loader(odd_built, "fork")


@pytest.mark.slow
def test_dataloader_spawn(odd_built):
    check_loader(odd_built, "spawn")


def test_refuses_unfinished_or_missing(tmp_path, odd_built):
    with pytest.raises(FormatError, match="not a packer dataset"):
        PackedDataset(tmp_path)
    import shutil
    shutil.copytree(odd_built, tmp_path / "d")
    (tmp_path / "d" / "shard-00000.lmdb").unlink()
    with pytest.raises(FormatError, match=r"shard .*shard-00000\.lmdb listed in .* is missing"):
        PackedDataset(tmp_path / "d")


def test_truncated_shard_is_refused_not_a_crash(tmp_path, odd_built):
    """A short shard (an interrupted copy) would be mapped and read past its end: SIGBUS."""
    import shutil
    shutil.copytree(odd_built, tmp_path / "d")
    shard = tmp_path / "d" / "shard-00000.lmdb"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(FormatError, match=r"shard-00000\.lmdb is \d+ bytes but .*manifest\.json says "
                                          r"\d+ \(an incomplete copy\?\); re-stage or rebuild"):
        PackedDataset(tmp_path / "d")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_turns_detection_boxes_and_masks(tmp_path, orientation):
    """A phone photo stored landscape with an EXIF orientation: with ``exif_orientation=True``
    the image turns (PIL's ``exif_transpose``) and its boxes, ``canvas_size`` and masks
    with it, to where the object is in the upright image."""
    import io
    import json
    from PIL import ImageOps
    from packer import build
    from packer.demo import load_photos
    from packer.sources import Coco
    w, h, box = 200, 120, (30, 20, 80, 50)  # the object, in the stored pixels
    exif = Image.Exif()
    exif[0x0112] = orientation
    (tmp_path / "images").mkdir()
    load_photos()[2].resize((w, h)).save(tmp_path / "images" / "a.jpg", exif=exif.tobytes())
    x0, y0, x1, y1 = box
    coco = {"images": [{"id": 1, "file_name": "a.jpg", "width": w, "height": h}],
            "categories": [{"id": 1, "name": "thing"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1,
                             "bbox": [x0, y0, x1 - x0, y1 - y0],
                             "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]]}]}
    (tmp_path / "a.json").write_text(json.dumps(coco))
    build(Coco(tmp_path / "images", tmp_path / "a.json"), tmp_path / "ds", progress=False,
          workers=0)
    # Where the object is upright: its stored mask turned by PIL itself.
    stored = Image.new("L", (w, h))
    stored.paste(255, box)
    buf = io.BytesIO()
    stored.save(buf, "PNG", exif=exif.tobytes())
    upright = ImageOps.exif_transpose(Image.open(buf))
    want_mask = torch.tensor(list(upright.tobytes()), dtype=torch.uint8).view(
        upright.size[1], upright.size[0]) > 0
    image, t = PackedDataset(tmp_path / "ds", exif_orientation=True,
                             target_keys=["boxes", "labels", "masks"])[0]
    assert image.size == upright.size
    assert t["boxes"].canvas_size == (upright.size[1], upright.size[0])
    assert t["boxes"].tolist() == [list(map(float, upright.getbbox()))]
    assert torch.equal(t["masks"][0].bool(), want_mask)
    _, no_boxes = PackedDataset(tmp_path / "ds", exif_orientation=True,
                                target_keys=["labels", "masks"])[0]
    assert torch.equal(no_boxes["masks"][0].bool(), want_mask)  # turned without boxes too
    _, plain = PackedDataset(tmp_path / "ds", target_keys=["boxes", "masks"])[0]
    assert plain["boxes"].tolist() == [list(map(float, box))]  # as stored, as torchvision reads
