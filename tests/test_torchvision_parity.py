"""A packed COCO dataset gives what torchvision gives: ``CocoDetection`` wrapped with
``wrap_dataset_for_transforms_v2`` (its default keys, ``"all"``, the detection reference's
list), the same v2 joint transforms on both, compared record by record: images, boxes, labels,
ids, area, iscrowd, segmentation and masks (pycocotools' pixels, polygons and crowd RLEs of
real photos); and ImageFolder's classes, labels and pixels on odd but real image files.
Needs torchvision and pycocotools; skipped without them."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

tv = pytest.importorskip("torchvision")
mask_api = pytest.importorskip("pycocotools.mask")

import numpy as np  # noqa: E402  (pycocotools needs it)
from PIL import Image  # noqa: E402
from torchvision import tv_tensors  # noqa: E402
from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from packer import PackedDataset, build  # noqa: E402
from packer.sources import Coco, ImageFolder as PackedFolder  # noqa: E402
from packer.demo.scenes import make_detection_folder  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools")
DEFAULT = ("boxes", "labels", "image_id")


def add_crowds(root) -> None:
    """Give every third image a crowd object: an RLE of its own darker pixels (COCO's
    uncompressed counts, or the compressed string every other time)."""
    coco = json.loads((root / "annotations.json").read_text())
    for k, im in enumerate(coco["images"][::3]):
        grey = Image.open(root / "images" / im["file_name"]).convert("L")
        a = np.asarray(grey) < np.median(np.asarray(grey)) - 30
        if not a.any():  # packer drops an empty object (a zero box), torchvision keeps it
            continue
        rle = mask_api.encode(np.asfortranarray(a.astype(np.uint8)))
        if k % 2:
            seg = {"size": rle["size"], "counts": rle["counts"].decode()}
        else:
            flat = a.T.reshape(-1).astype(np.int8)
            bounds = np.concatenate([[0], np.flatnonzero(np.diff(flat)) + 1, [len(flat)]])
            runs = ([0] if flat[0] else []) + np.diff(bounds).tolist()
            seg = {"size": rle["size"], "counts": runs}
        coco["annotations"].append({
            "id": 10 ** 6 + k, "image_id": im["id"], "category_id": coco["categories"][0]["id"],
            "bbox": mask_api.toBbox(rle).tolist(), "area": float(mask_api.area(rle)),
            "iscrowd": 1, "segmentation": seg})
    (root / "annotations.json").write_text(json.dumps(coco))


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = make_detection_folder(tmp_path_factory.mktemp("det") / "det", images=24, seed=3)
    add_crowds(root)
    dst = root.parent / "packed"
    build(Coco(root / "images", root / "annotations.json"), dst, progress=False, workers=0)
    return root, dst


def reference(root, transforms=None, keys=None):
    ds = CocoDetection(str(root / "images"), str(root / "annotations.json"), transforms=transforms)
    return wrap_dataset_for_transforms_v2(ds, target_keys=keys)


def plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else t


def same_target(got: dict, want: dict) -> None:
    """Equal to the bit: same keys, types, dtypes, values (the wrapper's lists as tensors)."""
    if set(want) == {"image_id"}:  # torchvision: an image without annotations has no other key
        assert got.get("image_id", want["image_id"]) == want["image_id"]
        assert all(len(v) == 0 for k, v in got.items() if k != "image_id")  # packer: empty
        return
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, w in want.items():
        g = got[k]
        if k in ("area", "iscrowd"):  # the wrapper passes them on as lists; packer, tensors
            w = torch.tensor(w, dtype=g.dtype)
        assert type(g) is type(w), (k, type(g), type(w))
        if isinstance(w, torch.Tensor):
            assert g.shape == w.shape and g.dtype == w.dtype, (k, g.shape, w.shape)
            assert torch.equal(plain(g), plain(w)), k
        else:
            assert g == w, k
    if "boxes" in want:
        assert got["boxes"].canvas_size == want["boxes"].canvas_size
        assert got["boxes"].format == want["boxes"].format


def test_default_targets_are_torchvisions(coco):
    root, dst = coco
    ref, ds = reference(root), PackedDataset(dst)
    assert len(ref) == len(ds)
    for i in range(len(ds)):
        (im, got), (ref_im, want) = ds[i], ref[i]
        assert im.size == ref_im.size and im.tobytes() == ref_im.tobytes()
        assert isinstance(got["boxes"], tv_tensors.BoundingBoxes)
        assert set(got) == set(DEFAULT)
        same_target(got, want)


@pytest.mark.parametrize("keys", [["boxes", "labels", "image_id", "masks"],  # detection reference
                                  ["masks", "iscrowd"], ["area", "segmentation", "labels"]])
def test_chosen_keys_are_torchvisions(coco, keys):
    root, dst = coco
    ref, ds = reference(root, keys=keys), PackedDataset(dst, target_keys=keys)
    for i in range(len(ds)):
        same_target(ds[i][1], ref[i][1])


def test_all_keys_masks_are_pycocotools_pixels(coco):
    """``"all"``: torchvision's keys but its raw ``bbox`` and ``category_id`` lists (packer
    has ``boxes`` and ``labels`` for them), plus the stored ``ann_ids``."""
    root, dst = coco
    ref, ds = reference(root, keys="all"), PackedDataset(dst, target_keys="all")
    crowds = 0
    for i in range(len(ds)):
        got, want = ds[i][1], ref[i][1]
        if set(want) == {"image_id"}:
            continue
        assert set(got) - set(want) == {"ann_ids"}
        assert set(want) - set(got) == {"bbox", "category_id"}
        assert isinstance(got["masks"], tv_tensors.Mask)
        same_target({k: got[k] for k in want if k in got},
                    {k: want[k] for k in want if k in got})
        assert got["labels"].tolist() == want["category_id"]
        crowds += int(got["iscrowd"].sum())
    assert crowds >= 6  # the RLEs were compared too


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


def test_ssd_preset_sanitizes_every_key(coco):
    """torchvision's SSD training preset ends in SanitizeBoundingBoxes, which drops boxes
    and ``labels``: with the default keys nothing else is left at its pre-crop length."""
    root, dst = coco
    t = v2.Compose([v2.RandomPhotometricDistort(p=1),
                    v2.RandomZoomOut(fill={tv_tensors.Image: (123, 117, 104), "others": 0}),
                    v2.RandomIoUCrop(), v2.RandomHorizontalFlip(p=0.5), v2.PILToTensor(),
                    v2.ToDtype(torch.float, scale=True), v2.SanitizeBoundingBoxes()])
    ref, ds = reference(root, t), PackedDataset(dst, transforms=t)
    coco = ref._dataset.coco  # the reference trains on images with objects only, as here
    for i in [i for i, image_id in enumerate(ref.ids) if coco.getAnnIds(imgIds=image_id)]:
        torch.manual_seed(i)
        im, got = ds[i]
        torch.manual_seed(i)
        ref_im, want = ref[i]
        assert torch.equal(im, ref_im)
        same_target(got, want)
        assert len(got["labels"]) == len(got["boxes"])


def test_get_height_and_width_reads_no_record(coco, tmp_path):
    """What torchvision's detection reference asks of a dataset for aspect-ratio grouping
    (``group_by_aspect_ratio.compute_aspect_ratios``) instead of decoding every image."""
    import shutil
    root, dst = coco
    ref = CocoDetection(str(root / "images"), str(root / "annotations.json"))
    copy = shutil.copytree(dst, tmp_path / "copy")
    ds = PackedDataset(copy)
    for shard in copy.glob("*.lmdb"):
        shard.write_bytes(b"")  # no record can be read now
    for i, image_id in enumerate(ref.ids):
        info = ref.coco.imgs[image_id]
        assert ds.get_height_and_width(i) == (info["height"], info["width"])
        assert ds.get_height_and_width(i) == ref[i][0].size[::-1]
    with pytest.raises(Exception):
        ds[0]


def test_target_keys_errors(coco, photo_src, tmp_path):
    _, dst = coco
    with pytest.raises(ValueError, match=r"\['bbox'\] are not available.*'boxes' \(XYXY"):
        PackedDataset(dst, target_keys=["boxes", "bbox"])
    with pytest.raises(ValueError, match="'all' or a collection"):
        PackedDataset(dst, target_keys="boxes")
    with pytest.raises(ValueError, match="not both"):
        PackedDataset(dst, target_keys=["boxes"], target_fields="labels")
    build(photo_src, tmp_path / "cls", progress=False, workers=0)
    with pytest.raises(ValueError, match="classification dataset"):
        PackedDataset(tmp_path / "cls", target_keys="all")
    assert set(PackedDataset(dst, masks=True)[0][1]) == set(DEFAULT) | {"masks"}


def decimal_coco(root) -> None:
    """COCO's own boxes have two decimals (``[473.07, 395.93, 38.65, 28.67]``)."""
    coco = json.loads((root / "annotations.json").read_text())
    rng = random.Random(0)
    for a in coco["annotations"]:  # inside the image: packer clips, torchvision does not
        x, y, w, h = a["bbox"]
        a["bbox"] = [round(x + rng.random() * 0.9, 2), round(y + rng.random() * 0.9, 2),
                     round(max(1.0, w - 2) + rng.random() * 0.9, 2),
                     round(max(1.0, h - 2) + rng.random() * 0.9, 2)]
    (root / "annotations.json").write_text(json.dumps(coco))


def test_boxes_with_coco_decimals_are_torchvisions_to_the_bit(tmp_path):
    """The build computes box ends as the wrapper does: float32(x) + float32(w)."""
    root = make_detection_folder(tmp_path / "det", images=8, seed=5)
    decimal_coco(root)
    build(Coco(root / "images", root / "annotations.json"), tmp_path / "packed",
          progress=False, workers=0)
    ref, ds = reference(root), PackedDataset(tmp_path / "packed")
    for i in range(len(ds)):
        got, want = ds[i][1], ref[i][1]
        if "boxes" in want:
            assert torch.equal(plain(got["boxes"]), plain(want["boxes"]))


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


# -- classification: odd but real image files -----------------------------------------------------

def saved(im: Image.Image, fmt: str, **kw) -> bytes:
    from io import BytesIO
    out = BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def exif_bytes(orientation: int, x_resolution=None) -> bytes:
    """A big-endian EXIF block with this orientation; ``x_resolution`` (num, den): also an
    SRATIONAL XResolution, which PIL reads but cannot write back when it is -1/0 (Pillow
    issue #8965), so ``ImageOps.exif_transpose`` raises on it."""
    import struct
    entries = [struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0)]
    tail = b""
    if x_resolution is not None:
        entries.append(struct.pack(">HHII", 0x011A, 10, 1, 8 + 2 + 12 * 2 + 4))
        tail = struct.pack(">ii", *x_resolution)
    ifd = struct.pack(">H", len(entries)) + b"".join(entries) + b"\0\0\0\0"
    return b"Exif\0\0MM\0*" + struct.pack(">I", 8) + ifd + tail


def icc_profile(size: int) -> bytes:
    """A well-formed empty display profile of ``size`` bytes (over 64 KiB: several APP2s)."""
    import struct
    head = struct.pack(">I4sI4s4s4s", size, b"none", 0x02100000, b"mntr", b"RGB ", b"XYZ ")
    return (head + b"\0" * 12 + b"acsp").ljust(128, b"\0") + b"\0\0\0\0" + b"\0" * (size - 132)


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    """An ImageFolder of the odd files real folders hold, made from the shipped photos, built:
    ``(src, dst, names)``, ``names``: the files' paths, by what they are."""
    from PIL import features
    from packer.demo import load_photos
    photos = load_photos()
    ph, frames = photos[0].resize((160, 120)), [p.resize((96, 72)) for p in photos[:3]]
    rgba = ph.copy()
    rgba.putalpha(ph.convert("L"))
    grey16 = Image.fromarray(np.asarray(ph.convert("L")).astype(np.uint16) * 257)  # "I;16"
    files = {
        "graphic/palette_trns.png": saved(ph.quantize(64), "PNG", transparency=3),
        "graphic/grey16.png": saved(grey16, "PNG"), "graphic/grey16.tif": saved(grey16, "TIFF"),
        "graphic/bilevel.bmp": saved(ph.convert("1"), "BMP"),
        "graphic/palette.bmp": saved(ph.quantize(16), "BMP"),
        "graphic/rgba.bmp": saved(rgba, "BMP"),
        "graphic/gif_named.png": saved(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        "graphic/apng.png": saved(frames[0], "PNG", save_all=True, append_images=frames[1:]),
        "graphic/pages.tif": saved(frames[0], "TIFF", save_all=True, append_images=frames[1:]),
        "graphic/one.png": saved(ph.resize((1, 1)), "PNG"),
        "graphic/tall.png": saved(ph.resize((1, 2000)), "PNG"),
        "graphic/exif8.png": saved(ph, "PNG", exif=exif_bytes(8)),
        "graphic/exif6.tif": saved(ph, "TIFF", tiffinfo={0x0112: 6}),
        "photo/cmyk.jpg": saved(ph.convert("CMYK"), "JPEG", quality=90),
        "photo/icc.jpg": saved(ph, "JPEG", icc_profile=icc_profile(70_000)),
        "photo/exif6.jpg": saved(ph, "JPEG", exif=exif_bytes(6)),
        "photo/exif6_bad_tag.jpg": saved(ph, "JPEG", exif=exif_bytes(6, (-1, 0))),
        "photo/mpo.jpg": saved(ph, "MPO", save_all=True, append_images=[frames[1]]),
        "photo/png_named.jpg": saved(ph, "PNG"),
        "photo/UPPER.JPG": saved(ph, "JPEG"),
        "photo/one.jpg": saved(ph.resize((1, 1)), "JPEG"),
        "photo/wide.jpg": saved(ph.resize((3000, 2)), "JPEG"),
        "photo/zero.jpg": b"",
        "photo/truncated.jpg": saved(ph, "JPEG")[:2000],
    }
    if features.check("webp"):
        files["graphic/lossless_alpha.webp"] = saved(rgba, "WEBP", lossless=True)
        files["graphic/animated.webp"] = saved(frames[0], "WEBP", save_all=True,
                                               append_images=frames[1:])
    src = tmp_path_factory.mktemp("odd") / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    dst = src.parent / "packed"
    build(src, dst, progress=False, workers=0)
    return src, dst, sorted(files)


def test_odd_files_are_imagefolders_item_by_item(odd_files):
    """The same classes, files, labels and pixels as ImageFolder, but for the two files
    ImageFolder cannot load: left out at build, each with its reason in the manifest."""
    from torchvision.datasets import ImageFolder
    src, dst, _ = odd_files
    ref, ds = ImageFolder(str(src)), PackedDataset(dst)
    assert ds.class_to_idx == ref.class_to_idx
    skipped = {s["path"]: s["reason"] for s in ds.manifest["skipped"]}
    assert set(skipped) == {"photo/zero.jpg", "photo/truncated.jpg"}
    assert skipped["photo/zero.jpg"] == "empty file"
    assert skipped["photo/truncated.jpg"].startswith("truncated: ")
    kept = [(i, p) for i, (p, _) in enumerate(ref.samples)
            if os.path.relpath(p, src) not in skipped]
    assert list(ds.samples) == [ref.samples[i] for i, _ in kept]
    assert ds.targets == [ref.targets[i] for i, _ in kept]
    for k, (i, path) in enumerate(kept):
        (im, y), (ref_im, ref_y) = ds[k], ref[i]
        assert y == ref_y and im.mode == "RGB" and ds.get_height_and_width(k) == im.size[::-1]
        assert np.array_equal(np.asarray(im), np.asarray(ref_im)), path
    for i, path in enumerate(p for p, _ in ref.samples):
        if os.path.relpath(path, src) in skipped:
            with pytest.raises(OSError):  # UnidentifiedImageError or "truncated"
                ref[i]


def test_odd_files_turn_as_exif_transpose_turns_them(odd_files):
    """``exif_orientation=True`` gives ``ImageOps.exif_transpose``'s pixels (JPEG and PNG
    orientations; a TIFF's PIL turns as it loads it, and only once); where exif_transpose
    itself raises (a tag it cannot write back), the photo is still turned by its orientation,
    as the build recorded it, not a crash."""
    from PIL import ImageOps
    from torchvision.datasets import ImageFolder
    src, dst, _ = odd_files
    upright = ImageFolder(str(src), loader=lambda p: ImageOps.exif_transpose(
        Image.open(p)).convert("RGB") if "bad_tag" not in p else
        Image.open(p).convert("RGB").transpose(Image.ROTATE_270))
    ds = PackedDataset(dst, exif_orientation=True)
    for k, (path, _) in enumerate(ds.samples):
        want = upright[upright.samples.index((path, ds.targets[k]))][0]
        assert np.array_equal(np.asarray(ds[k][0]), np.asarray(want)), path
    turned = {os.path.relpath(p, src): ds[k][0].size for k, (p, _) in enumerate(ds.samples)}
    assert turned["photo/exif6_bad_tag.jpg"] == turned["photo/exif6.jpg"] == (120, 160)
    assert turned["graphic/exif8.png"] == turned["graphic/exif6.tif"] == (120, 160)
