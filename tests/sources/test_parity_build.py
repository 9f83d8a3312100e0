"""Build-side parity with the references, on real files: YOLO labels on EXIF-rotated photos
as ultralytics reads them (against the image as shown), COCO boxes as torchvision's
``CocoDetection`` + ``wrap_dataset_for_transforms_v2`` gives them (the stored pixels, float32
arithmetic, files without ``categories``, image ids sharing a file), and segmentations that
cannot belong to their image dropped at build, so that a fresh dataset always verifies."""
from __future__ import annotations

import io
import json
from array import array
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps

from packer import PackedDataset, build
from packer.demo.images import load_photos
from packer.info import verify
from packer.sources import Coco, Yolo
from packer.writing.check import Transcode

# What turns the stored pixels into the image as shown (PIL's exif_transpose), and back.
SHOWN = {2: Image.FLIP_LEFT_RIGHT, 3: Image.ROTATE_180, 4: Image.FLIP_TOP_BOTTOM,
         5: Image.TRANSPOSE, 6: Image.ROTATE_270, 7: Image.TRANSVERSE, 8: Image.ROTATE_90}
STORED = {**SHOWN, 6: Image.ROTATE_90, 8: Image.ROTATE_270}
W, H = 320, 200                # the photo as shown
BOX = (40, 30, 140, 90)        # the object, XYXY pixels of the photo as shown
MAGENTA = (255, 0, 255)


def quiet(src, dst, **kw):
    return build(src, dst, progress=False, workers=0, **kw)


def plain(t) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def shown_photo() -> Image.Image:
    """A real photo, as shown, with a magenta object at ``BOX``."""
    im = load_photos()[2].resize((W, H), Image.BICUBIC)
    im.paste(MAGENTA, BOX)
    return im


def stored_jpeg(shown: Image.Image, orientation: int) -> bytes:
    """A JPEG whose pixels are ``shown`` turned the other way, with the EXIF orientation
    that turns them back (as a phone camera writes it)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    im = shown.transpose(STORED[orientation]) if orientation in STORED else shown
    im.save(out, "JPEG", quality=95, subsampling=0, exif=exif.tobytes())
    return out.getvalue()


def box_in_stored_pixels(orientation: int):
    """``BOX`` where PIL puts it in the stored pixels: a mask turned as the photo was."""
    mask = Image.new("L", (W, H))
    mask.paste(255, BOX)
    return mask.transpose(STORED[orientation]).getbbox() if orientation in STORED \
        else mask.getbbox()


def magenta_box(image: Image.Image):
    """The XYXY box (pixel edges) of the magenta pixels of a decoded image."""
    r, g, b = image.convert("RGB").split()
    hot = Image.merge("RGB", (r.point(lambda v: 255 * (v > 200)), g.point(lambda v: 255 * (v < 60)),
                              b.point(lambda v: 255 * (v > 200)))).convert("L").point(
        lambda v: 255 * (v == 255))
    return hot.getbbox()


@pytest.fixture(scope="module")
def rotated(tmp_path_factory) -> Path:
    """One photo stored in each of the 8 EXIF orientations, with its YOLO label (against the
    photo as shown) and a COCO file whose boxes are in the stored pixels (as torchvision
    reads COCO: no EXIF turn)."""
    root = tmp_path_factory.mktemp("rotated")
    (root / "images").mkdir()
    (root / "labels").mkdir()
    shown = shown_photo()
    x0, y0, x1, y1 = BOX
    label = f"0 {(x0 + x1) / 2 / W} {(y0 + y1) / 2 / H} {(x1 - x0) / W} {(y1 - y0) / H}\n"
    images, anns = [], []
    for o in range(1, 9):
        (root / "images" / f"o{o}.jpg").write_bytes(stored_jpeg(shown, o))
        (root / "labels" / f"o{o}.txt").write_text(label)
        sx0, sy0, sx1, sy1 = box_in_stored_pixels(o)
        images.append({"id": o, "file_name": f"o{o}.jpg"})
        anns.append({"id": o, "image_id": o, "category_id": 1, "area": 1.0,
                     "bbox": [sx0, sy0, sx1 - sx0, sy1 - sy0]})
    (root / "names.txt").write_text("thing\n")
    (root / "coco.json").write_text(json.dumps({"images": images, "annotations": anns,
                                                "categories": [{"id": 1, "name": "thing"}]}))
    return root


@pytest.mark.parametrize("transcode", [None, Transcode(max_side=160)])
def test_yolo_boxes_on_exif_rotated_photos_are_in_the_stored_pixels(rotated, tmp_path, transcode):
    """ultralytics reads a label against the photo as shown (OpenCV applies the EXIF turn);
    packer stores the box in the stored pixels' frame, like the image and like COCO's, so
    without ``exif_orientation`` the box covers the object in the pixels handed out, with
    the stored size as ``canvas_size``. Transcoding keeps the EXIF tag, and the boxes follow
    the resize."""
    m = quiet(Yolo(rotated / "images", rotated / "labels", rotated / "names.txt"), tmp_path / "d",
              transcode=transcode).manifest
    assert m["count"] == 8 and m["skipped"] == [] and m.get("dropped_count", 0) == 0
    ds = PackedDataset(tmp_path / "d")
    for i in range(len(ds)):
        image, t = ds[i]
        o = int(ds.load(i)["path"][1])
        scale = image.width / (H if o >= 5 else W)  # 1, or the transcode's
        want = [v * scale for v in box_in_stored_pixels(o)]
        assert t["boxes"].canvas_size == (image.height, image.width)
        assert plain(t["boxes"]).tolist() == [pytest.approx(want, abs=1e-3)], o
        assert magenta_box(image) == pytest.approx(want, abs=2), o  # the object is there
        area = array("f", ds.load(i)["area"]).tolist()  # (not in torchvision's default keys)
        assert area == [pytest.approx(100 * 60 * scale * scale, rel=1e-5)]


def reader_turns_targets() -> bool:
    from packer.reading import targets
    return hasattr(targets, "oriented")


@pytest.mark.skipif(not reader_turns_targets(), reason="this reader does not turn detection "
                    "targets with exif_orientation=True yet (the read side's change)")
def test_yolo_boxes_with_exif_orientation_are_ultralytics_boxes(rotated, tmp_path):
    """With ``exif_orientation=True`` the image is turned as shown, and the boxes with it:
    the box is then the label's, in the photo as shown: what ultralytics trains on."""
    quiet(Yolo(rotated / "images", rotated / "labels", rotated / "names.txt"), tmp_path / "d")
    ds = PackedDataset(tmp_path / "d", exif_orientation=True)
    for i in range(len(ds)):
        image, t = ds[i]
        assert image.size == (W, H)
        assert t["boxes"].canvas_size == (H, W)
        assert plain(t["boxes"]).tolist() == [pytest.approx(list(BOX), abs=1e-3)]
        assert magenta_box(image) == pytest.approx(list(BOX), abs=2)


def test_coco_boxes_on_exif_rotated_photos_are_torchvisions(rotated, tmp_path):
    """torchvision's CocoDetection does not apply the EXIF turn: COCO boxes are in the
    stored pixels, and packer's equal its wrapper's (boxes, canvas_size) bit for bit."""
    datasets = pytest.importorskip("torchvision.datasets")
    pytest.importorskip("pycocotools")
    quiet(Coco(rotated / "images", rotated / "coco.json"), tmp_path / "d")
    ref = datasets.wrap_dataset_for_transforms_v2(
        datasets.CocoDetection(str(rotated / "images"), str(rotated / "coco.json")))
    ds = PackedDataset(tmp_path / "d")
    assert len(ds) == len(ref) == 8
    for i in range(len(ds)):
        (image, got), (ref_image, want) = ds[i], ref[i]
        assert image.size == ref_image.size
        assert got["boxes"].canvas_size == want["boxes"].canvas_size
        assert torch.equal(plain(got["boxes"]), plain(want["boxes"]).float())
        assert magenta_box(image) == pytest.approx(plain(want["boxes"])[0].tolist(), abs=2)


def test_the_test_photos_are_what_a_camera_writes(rotated):
    """The fixture's files: PIL's exif_transpose gives the photo as shown."""
    for o in range(1, 9):
        im = Image.open(rotated / "images" / f"o{o}.jpg")
        assert im.getexif().get(0x0112) == o
        assert ImageOps.exif_transpose(im).size == (W, H)
        assert magenta_box(ImageOps.exif_transpose(im)) == pytest.approx(list(BOX), abs=2)


# -- COCO files as torchvision reads them -----------------------------------------------------

@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Five real JPEGs of ImageNet-like sizes."""
    import random
    from packer.demo import make_image
    root = tmp_path_factory.mktemp("photos")
    rng, base = random.Random(5), load_photos()
    for k in range(5):
        (root / f"{k:012d}.jpg").write_bytes(make_image(rng, base))
    return root


def sizes(images: Path) -> dict:
    return {p.name: Image.open(p).size for p in sorted(images.glob("*.jpg"))}


def torchvision_style_file(images: Path, path: Path, seed: int) -> None:
    """An instances file written the way torchvision's own dataset tests write theirs: no
    'categories', no image sizes, random float boxes and ids, random crowds; plus COCO-like
    decimal boxes and an image id sharing another's file."""
    g = torch.Generator().manual_seed(seed)
    names = sorted(sizes(images))
    imgs = [{"file_name": n, "id": int(n[:-4])} for n in names]
    imgs.append({"file_name": names[1], "id": 77})  # a second record of the same file
    anns = []
    for k, im in enumerate(imgs[1:] * 2):  # the first image has none
        box = torch.rand(4, generator=g).tolist() if k % 2 else \
            [round(float(v), 2) for v in torch.rand(4, generator=g) * 150]
        anns.append({"image_id": im["id"], "id": k, "bbox": box,
                     "segmentation": [torch.rand(8, generator=g).tolist()],
                     "category_id": int(torch.randint(91, (), generator=g)),
                     "area": float(torch.rand(1, generator=g)),
                     "iscrowd": int(torch.randint(2, (), generator=g))})
    path.write_text(json.dumps({"images": imgs, "annotations": anns}))


@pytest.mark.parametrize("seed", [0, 1])
def test_torchvision_style_files_build_as_cocodetection_reads_them(photos, tmp_path, seed):
    """No 'categories', shared file names, decimal boxes: the same records, image ids,
    labels (category ids) and boxes as ``wrap_dataset_for_transforms_v2(CocoDetection)``,
    the boxes to the bit (float32(x) + float32(w), as its XYWH tensor adds them)."""
    datasets = pytest.importorskip("torchvision.datasets")
    pytest.importorskip("pycocotools")
    torchvision_style_file(photos, tmp_path / "ann.json", seed)
    m = quiet(Coco(photos, tmp_path / "ann.json"), tmp_path / "d").manifest
    assert m["skipped"] == [] and m.get("dropped_count", 0) == 0 and m["categories"] == []
    ref = datasets.wrap_dataset_for_transforms_v2(
        datasets.CocoDetection(str(photos), str(tmp_path / "ann.json")))
    ds = PackedDataset(tmp_path / "d")
    assert len(ds) == len(ref) == 6
    checked = 0
    for i in range(len(ds)):
        (image, got), (ref_image, want) = ds[i], ref[i]
        assert image.size == ref_image.size and got["image_id"] == want["image_id"]
        if set(want) == {"image_id"}:  # no objects: torchvision gives the id alone
            assert len(got["boxes"]) == 0
            continue
        assert got["boxes"].canvas_size == want["boxes"].canvas_size
        assert torch.equal(plain(got["boxes"]), plain(want["boxes"]))
        assert torch.equal(got["labels"], want["labels"])
        checked += len(want["labels"])
    assert checked == 10


def test_odd_but_valid_coco_builds_a_dataset_that_verifies(photos, tmp_path):
    """Segmentations of every kind a COCO file may hold, good and bad: the bad ones are
    dropped at build, each with its reason, and the dataset verifies and gives masks for
    every record."""
    mask_api = pytest.importorskip("pycocotools.mask")
    import numpy as np
    shape = sizes(photos)
    first = next(n for n, (w, h) in shape.items() if w != h)  # where (h, w) != (w, h)
    (w0, h0), (w1, h1) = shape[first], next(s for s in shape.values() if s != shape[first])
    full = mask_api.encode(np.asfortranarray(np.ones((h0, w0), dtype=np.uint8)))
    segs = {  # name: (segmentation, kept)
        "compressed RLE": ({"counts": full["counts"].decode(), "size": [h0, w0]}, True),
        "RLE of (width, height)": ({"counts": full["counts"].decode(), "size": [w0, h0]}, False),
        "RLE of another image": ({"counts": [0, w1 * h1], "size": [h1, w1]}, False),
        "runs short of the image": ({"counts": [5, 10], "size": [h0, w0]}, True),
        "runs past the image": ({"counts": [5, w0 * h0], "size": [h0, w0]}, False),
        "polygon a little outside": ([[-3.5, -2, w0 + 4, 0, w0 + 4, h0 + 1.25]], True),
        "polygon of another scale": ([[0, 0, 4 * w0, 0, 4 * w0, 4 * h0]], False),
        "one vertex": ([[5, 5]], True),
        "odd coordinate count": ([[5, 5, 50, 5, 50, 50, 7]], True),
        "no polygon": ([], True),
        "too many crossings": ([[v for k in range(3000) for v in (0, k % 2, w0, k % 2 + 1)]],
                               False),
    }
    anns = [{"id": k, "image_id": 0, "category_id": 1, "bbox": [10.25, 20.5, 100.125, 50.75],
             "iscrowd": int(isinstance(seg, dict)), "segmentation": seg}
            for k, (seg, _) in enumerate(segs.values())]
    imgs = [{"id": 0, "file_name": first}]
    (tmp_path / "ann.json").write_text(json.dumps({
        "images": imgs, "annotations": anns, "categories": [{"id": 1, "name": "thing"}]}))
    m = quiet(Coco(photos, tmp_path / "ann.json"), tmp_path / "d").manifest
    dropped = {int(d["reason"].split(":")[0].split()[1]) for d in m["dropped"]}
    assert dropped == {k for k, (_, kept) in enumerate(segs.values()) if not kept}, m["dropped"]
    rep = verify(tmp_path / "d", progress=False)
    assert rep.ok, rep.problems
    ds = PackedDataset(tmp_path / "d", masks=True)
    _, t = ds[0]
    assert t["masks"].shape == (len(segs) - len(dropped), h0, w0)
    assert int(t["masks"][0].sum()) == w0 * h0  # the compressed RLE: every pixel


@pytest.mark.skipif(not hasattr(__import__("packer.reading.masks").reading.masks, "parse"),
                    reason="this reader has no polygon work limits (the read side's change)")
def test_the_builds_segmentation_limits_are_the_readers():
    """What the build stores, the reader turns into masks: the same limits, the same count
    of column crossings (the reader's in torch, the build's without)."""
    import random
    from packer.reading import masks
    from packer.reading.polygons import crossings, outline
    from packer.sources import segmentation
    for name in ("MAX_POLYGON_VERTICES", "MAX_COORDINATE", "CROSSING_ALLOWANCE"):
        assert getattr(segmentation, name) == getattr(masks, name), name
    rng = random.Random(2)
    for _ in range(300):
        width = rng.randint(1, 700)
        polygons = [[rng.choice([rng.uniform(-50, width + 50), rng.randint(-9, width + 9),
                                 rng.randint(0, 3) + 0.4 * rng.randint(0, 3)])
                     for _ in range(rng.randint(0, 41))] for _ in range(rng.randint(1, 3))]
        want = int(crossings(outline([(0, polygons)], width), 1)[0])
        assert segmentation.crossings(polygons, width) == want, (polygons, width)


def test_yolo_boxes_on_a_tiff_with_an_orientation_tag_are_in_the_pixels_pil_gives(tmp_path):
    """PIL turns a TIFF upright as it opens it (its size is already the turned one), so its
    orientation tag must not turn the label's box a second time."""
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    shown = shown_photo()
    shown.transpose(STORED[6]).save(tmp_path / "images" / "t.tif", tiffinfo={274: 6})
    loaded = Image.open(tmp_path / "images" / "t.tif")
    loaded.load()  # (Pillow < 11 gives the stored size until the pixels are loaded)
    assert loaded.size == (W, H)  # as PIL hands it out
    x0, y0, x1, y1 = BOX
    (tmp_path / "labels" / "t.txt").write_text(
        f"0 {(x0 + x1) / 2 / W} {(y0 + y1) / 2 / H} {(x1 - x0) / W} {(y1 - y0) / H}\n")
    (tmp_path / "names.txt").write_text("thing\n")
    quiet(Yolo(tmp_path / "images", tmp_path / "labels", tmp_path / "names.txt"), tmp_path / "d")
    for turn in (False, True):
        image, t = PackedDataset(tmp_path / "d", exif_orientation=turn)[0]
        assert image.size == (W, H) and magenta_box(image) == pytest.approx(list(BOX), abs=2)
        assert plain(t["boxes"]).tolist() == [pytest.approx(list(BOX), abs=1e-3)], turn
