"""End to end: ``build`` with --coco / --yolo / --meta on demo scenes, read back through
PackedDataset, checked by ``verify``, interrupted and resumed, built in parts and merged,
and driven from the command line.

The scenes come from ``packer.demo.scenes``: realistic JPEGs whose objects sit at known
boxes, with odd COCO category ids and non-contiguous image ids, so an id confused with an
index shows. Every expected value here is computed from the source files (the COCO JSON,
the YOLO label files, the JSONL/CSV rows), never from packer's own parsers.
"""
from __future__ import annotations

import json
import random
import shutil
from array import array
from pathlib import Path

import pytest
import torch

from helpers import packer_env, run_packer
import packer
from packer import Checks, PackedDataset, build, merge
from packer.demo import load_photos, make_image
from packer.transforms.decode import DecodeLetterbox, DecodeRandomResizedCrop
from packer.demo.scenes import make_detection_folder
from packer.errors import FormatError, PackerError
from packer.format.manifest import column_file, file_sha256, read_manifest
from packer.info import verify
from packer.reading.reader import ShardReader
from packer.sources import Coco, Table, Yolo
from packer.writing.shard import ShardWriter

N_IMAGES = 40  # ~2.5 MB of JPEGs: three shards at shard_size=1 MiB
EMPTY = round(N_IMAGES * 0.1)  # make_detection_folder's default empty_fraction
KEYS = ["boxes", "labels", "image_id", "area", "iscrowd"]  # more than the default three
MiB = 1 << 20


def quiet(src, dst, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 0)
    return build(src, dst, **kw)


def plain(t) -> torch.Tensor:
    """A tensor without torchvision's tv_tensors subclass (where torchvision is installed)."""
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else torch.as_tensor(t)


def int64s(raw: bytes) -> list:
    out = array("q")
    out.frombytes(raw)
    return out.tolist()


def records(root):
    r = ShardReader(root)
    try:
        return [r.record(i) for i in range(len(r))]
    finally:
        r.close()


# -- the source data, made once per module (read-only) --------------------------------------

@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    return make_detection_folder(tmp_path_factory.mktemp("scenes"), images=N_IMAGES, seed=11)


@pytest.fixture(scope="module")
def coco(scenes) -> dict:
    return json.loads((scenes / "annotations.json").read_text())


@pytest.fixture(scope="module")
def by_name(coco):
    """file name -> (image entry, its annotations in JSON order)."""
    anns = {}
    for a in coco["annotations"]:
        anns.setdefault(a["image_id"], []).append(a)
    return {im["file_name"]: (im, anns.get(im["id"], [])) for im in coco["images"]}


@pytest.fixture(scope="module")
def coco_built(scenes, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("coco") / "dst"
    quiet(Coco(scenes / "images", scenes / "annotations.json"), dst, workers=2, shard_size=MiB)
    return dst


@pytest.fixture(scope="module")
def yolo_built(scenes, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("yolo") / "dst"
    quiet(Yolo(scenes / "images", scenes / "labels", scenes / "names.txt"), dst)
    return dst


def with_bad_annotations(coco: dict, bad: dict) -> dict:
    """A copy of ``coco`` with extra annotations: ``bad`` maps an image index to a list of
    ``(kind, ...)``: "zero" (a box of zero width), "outside" (a box right of the image),
    "category" (an id no category has), "segmentation" (neither polygons nor RLE)."""
    out = json.loads(json.dumps(coco))
    next_id = max(a["id"] for a in out["annotations"]) + 1
    cats = {c["id"] for c in out["categories"]}
    for k, kinds in bad.items():
        im = out["images"][k]
        for kind in kinds:
            bbox, cid = [12.0, 14.0, 30.0, 25.0], out["categories"][0]["id"]
            seg = {"counts": "x"} if kind == "segmentation" else []  # an RLE without size
            if kind == "zero":
                bbox = [12.0, 14.0, 0.0, 25.0]
            elif kind == "outside":
                bbox = [im["width"] + 40.0, 14.0, 30.0, 25.0]
            elif kind == "category":
                cid = next(c for c in range(2, 100, 2) if c not in cats)  # demo ids are odd
            out["annotations"].append({"id": next_id, "image_id": im["id"], "category_id": cid,
                                       "bbox": bbox, "area": 750.0, "iscrowd": 0,
                                       "segmentation": seg})
            next_id += 1
    return out


def write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


# -- COCO and YOLO: every record equals its source annotations --------------------------------

def test_coco_every_record_equals_the_json(coco_built, coco, by_name):
    ds = PackedDataset(coco_built, target_keys=KEYS)
    assert ds.task == "detection" and len(ds) == N_IMAGES
    assert ds.categories == coco["categories"]  # odd ids, supercategory kept
    assert ds.classes == [c["name"] for c in sorted(coco["categories"], key=lambda c: c["id"])]
    ids = []
    for i in range(len(ds)):
        rec = ds.load(i)
        im, anns = by_name[rec["path"]]
        ids.append(rec["image_id"])
        assert (rec["width"], rec["height"]) == (im["width"], im["height"])
        image, t = ds[i]
        assert image.size == (im["width"], im["height"])
        assert t["image_id"] == im["id"]
        want = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)],
                            dtype=torch.float32).reshape(-1, 4)
        boxes = plain(t["boxes"])
        assert boxes.dtype == torch.float32 and torch.equal(boxes, want), rec["path"]
        assert t["labels"].dtype == torch.int64
        assert t["labels"].tolist() == [a["category_id"] for a in anns]  # ids, not indices
        assert torch.equal(t["area"], torch.tensor([a["area"] for a in anns], dtype=torch.float32))
        assert t["iscrowd"].dtype == torch.int64 and t["iscrowd"].tolist() == [0] * len(anns)
        assert int64s(rec["ann_ids"]) == [a["id"] for a in anns]  # stored little-endian
        assert rec["segmentation"] == [a["segmentation"] for a in anns]
    assert ids == sorted(im["id"] for im in coco["images"])  # ascending image id
    assert sum(len(anns) > 0 for _, anns in by_name.values()) == N_IMAGES - EMPTY


def yolo_lines(scenes: Path, rel: str):
    """(class, cx, cy, w, h) of each line of the image's label file ([] if it has none)."""
    f = scenes / "labels" / (Path(rel).stem + ".txt")
    if not f.exists():
        return []
    out = []
    for line in f.read_text().splitlines():
        if line.strip():
            c, *xywh = line.split()
            out.append((int(c), *map(float, xywh)))
    return out


def test_yolo_every_record_equals_the_label_files(scenes, yolo_built, by_name):
    ds = PackedDataset(yolo_built, target_keys=KEYS)
    names = (scenes / "names.txt").read_text().split()
    assert ds.task == "detection" and len(ds) == N_IMAGES
    assert ds.classes == names
    assert ds.categories == [{"id": i, "name": n} for i, n in enumerate(names)]
    assert sum(not (scenes / "labels" / f"{i:06d}.txt").exists() for i in range(N_IMAGES)) > 0
    for i in range(len(ds)):
        rec = ds.load(i)
        _, t = ds[i]
        w, h = rec["width"], rec["height"]
        lines = yolo_lines(scenes, rec["path"])
        assert t["image_id"] == i  # YOLO has no ids: the record's index
        assert t["labels"].tolist() == [c for c, *_ in lines]  # class indices
        want = torch.tensor([[max((cx - bw / 2) * w, 0), max((cy - bh / 2) * h, 0),
                              min((cx + bw / 2) * w, w), min((cy + bh / 2) * h, h)]
                             for _, cx, cy, bw, bh in lines], dtype=torch.float64).reshape(-1, 4)
        boxes = plain(t["boxes"])
        assert boxes.dtype == torch.float32 and boxes.shape == want.shape
        if len(want):
            assert (boxes.double() - want).abs().max().item() <= 1e-3, rec["path"]
        # and the same objects as the COCO truth (6 decimals in the label files)
        truth = by_name[rec["path"]][1]
        assert [2 * c + 1 for c, *_ in lines] == [a["category_id"] for a in truth]
        coco_xyxy = torch.tensor([[x, y, x + bw, y + bh] for x, y, bw, bh in
                                  (a["bbox"] for a in truth)], dtype=torch.float64).reshape(-1, 4)
        assert len(truth) == 0 or (boxes.double() - coco_xyxy).abs().max().item() <= 2e-3
        area = (want[:, 2] - want[:, 0]) * (want[:, 3] - want[:, 1])
        assert torch.allclose(t["area"].double(), area, rtol=1e-5, atol=1e-2)
        assert t["iscrowd"].tolist() == [0] * len(lines)
        assert "segmentation" not in rec


def test_masks_match_the_boxes(coco_built, by_name):
    ds = PackedDataset(coco_built, masks=True, target_keys=KEYS)
    checked = 0
    for i in range(len(ds)):
        _, t = ds[i]
        rec = ds.load(i)
        m = plain(t["masks"])
        n = len(by_name[rec["path"]][1])
        assert m.dtype == torch.uint8 and m.shape == (n, rec["height"], rec["width"])
        assert set(m.unique().tolist()) <= {0, 1}
        for k, (x0, y0, x1, y1) in enumerate(plain(t["boxes"]).tolist()):
            ys, xs = torch.nonzero(m[k], as_tuple=True)
            got = (xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1)
            assert all(abs(a - b) <= 2 for a, b in zip(got, (x0, y0, x1, y1))), (rec["path"], k)
            # the mask covers the object, not its box: the area the JSON gives, roughly
            assert m[k].sum().item() == pytest.approx(t["area"][k].item(), rel=0.1)
            checked += 1
    assert checked > N_IMAGES  # several objects per image
    with pytest.raises(ValueError, match="crop decoder"):
        PackedDataset(coco_built, masks=True, decode=DecodeRandomResizedCrop(64))
    with pytest.raises(ValueError, match=r"masks \(masks=True, or in target_keys\) with a crop"):
        PackedDataset(coco_built, target_keys="all", decode=DecodeRandomResizedCrop(64))


def test_masks_need_segmentation(yolo_built):
    with pytest.raises(ValueError, match="segmentation"):
        PackedDataset(yolo_built, masks=True)


def test_images_without_annotations_are_kept_or_skipped(scenes, coco_built, yolo_built, by_name,
                                                        tmp_path):
    empty = sorted(n for n, (_, anns) in by_name.items() if not anns)
    assert len(empty) == EMPTY
    coco = json.loads((scenes / "annotations.json").read_text())
    annotated = {a["image_id"] for a in coco["annotations"]}
    assert empty == sorted(im["file_name"] for im in coco["images"] if im["id"] not in annotated)
    for root in (coco_built, yolo_built):
        ds = PackedDataset(root, target_keys=KEYS)
        paths = [ds.load(i)["path"] for i in range(len(ds))]
        for name in empty:
            _, t = ds[paths.index(name)]
            assert plain(t["boxes"]).shape == (0, 4) and t["boxes"].dtype == torch.float32
            assert t["labels"].shape == (0,) and t["labels"].dtype == torch.int64
            assert t["area"].shape == (0,) and t["iscrowd"].shape == (0,)
    m = quiet(Coco(scenes / "images", scenes / "annotations.json", skip_empty=True),
              tmp_path / "d").manifest
    assert m["count"] == N_IMAGES - EMPTY and m["skipped_empty"] == EMPTY
    ds = PackedDataset(tmp_path / "d")
    kept = [ds.load(i)["path"] for i in range(len(ds))]
    assert kept == sorted(set(by_name) - set(empty))
    assert all(len(ds[i][1]["boxes"]) for i in range(len(ds)))
    assert verify(tmp_path / "d", progress=False).ok


def test_side_tables_equal_the_records(coco_built, yolo_built):
    for root in (coco_built, yolo_built):
        ds = PackedDataset(root, target_keys=KEYS)
        recs = records(root)
        for name in ("width", "height", "image_id"):
            col = ds.column(name)
            assert isinstance(col, array) and col.tolist() == [r[name] for r in recs], name
        assert ds.column("image_id").typecode == "q"
        ratios = ds.aspect_ratios()
        assert ratios.dtype == torch.float64
        assert ratios.tolist() == [r["width"] / r["height"] for r in recs]
        with pytest.raises(KeyError, match="boxes"):  # arrays have no side table
            ds.column("boxes")


# -- bad annotations: dropped with a reason, the image kept; strict refuses ------------------

def test_bad_boxes_are_dropped_and_their_images_kept(scenes, coco, by_name, tmp_path):
    ann = write_json(tmp_path / "bad.json", with_bad_annotations(coco, {3: ["zero", "outside"],
                                                                       9: ["outside",
                                                                           "segmentation"]}))
    m = quiet(Coco(scenes / "images", ann), tmp_path / "d").manifest
    assert m["count"] == N_IMAGES and m["skipped"] == []
    name3, name9 = coco["images"][3]["file_name"], coco["images"][9]["file_name"]
    assert m["dropped_count"] == 4
    assert [d["path"] for d in m["dropped"]] == [name3, name3, name9, name9]
    reasons = [d["reason"] for d in m["dropped"]]
    assert "zero or negative size box" in reasons[0]
    assert "lies outside the" in reasons[1] and "lies outside the" in reasons[2]
    assert "'segmentation' must be polygons" in reasons[3]
    ds = PackedDataset(tmp_path / "d")
    paths = [ds.load(i)["path"] for i in range(len(ds))]
    for name in (name3, name9):  # kept, with exactly its good objects
        _, t = ds[paths.index(name)]
        good = by_name[name][1]
        assert t["labels"].tolist() == [a["category_id"] for a in good]
        assert plain(t["boxes"]).tolist() == [[x, y, x + w, y + h] for x, y, w, h in
                                              (a["bbox"] for a in good)]
        assert len(ds.load(paths.index(name))["segmentation"]) == len(good)
    assert verify(tmp_path / "d", progress=False).ok


@pytest.mark.parametrize("workers", [0, 2])
def test_a_damaged_polygon_stops_the_build(scenes, coco, tmp_path, workers):
    """A polygon that is not JSON makes the file not JSON: the build stops before it
    starts, naming where, and leaves nothing behind."""
    text = json.dumps(coco)
    first = json.dumps(coco["annotations"][0]["segmentation"])
    assert first.startswith("[[") and first in text
    ann = tmp_path / "damaged.json"
    ann.write_text(text.replace(first, first[:-2] + ",]]", 1))
    with pytest.raises(PackerError, match=r"damaged\.json:1:\d+: not valid JSON \(trailing "
                                          r"comma in array\).* fetch it again"):
        quiet(Coco(scenes / "images", ann), tmp_path / "d", workers=workers)
    assert not (tmp_path / "d").exists()


def test_unknown_category_is_dropped_with_a_reason(scenes, coco, by_name, tmp_path):
    ann = write_json(tmp_path / "bad.json", with_bad_annotations(coco, {5: ["category"]}))
    m = quiet(Coco(scenes / "images", ann), tmp_path / "d").manifest
    name = coco["images"][5]["file_name"]
    ds = PackedDataset(tmp_path / "d")
    paths = [ds.load(i)["path"] for i in range(len(ds))]
    assert len(ds) == N_IMAGES
    _, t = ds[paths.index(name)]  # kept, with its good objects only
    assert t["labels"].tolist() == [a["category_id"] for a in by_name[name][1]]
    # ... and the annotation left out is listed, like every other dropped one
    assert m.get("dropped_count") == 1, m.get("dropped")
    assert m["dropped"][0]["path"] == name
    assert "category id" in m["dropped"][0]["reason"]


@pytest.mark.parametrize("kind", ["zero", "outside", "category", "segmentation"])
def test_strict_refuses_a_bad_annotation(scenes, coco, tmp_path, kind):
    ann = write_json(tmp_path / "bad.json", with_bad_annotations(coco, {7: [kind]}))
    with pytest.raises(PackerError, match="strict"):
        quiet(Coco(scenes / "images", ann), tmp_path / "d", checks=Checks(strict=True))
    assert not (tmp_path / "d" / "manifest.json").exists()
    with pytest.raises(FormatError):
        read_manifest(tmp_path / "d")


def test_yolo_bad_lines_leave_the_image_out_or_are_dropped(scenes, tmp_path):
    """By ultralytics' rules (the default) an image with an invalid label line is skipped,
    listed with the line and why, and shown by `packer info`; --yolo-rules lines drops the
    line alone and keeps the image."""
    labels = tmp_path / "labels"
    shutil.copytree(scenes / "labels", labels)
    f = sorted(labels.glob("*.txt"))[1]
    n = len(f.read_text().splitlines()) + 1
    f.write_text(f.read_text() + "99 0.5 0.5 0.1 0.1\n")  # class out of range
    m = quiet(Yolo(scenes / "images", labels, scenes / "names.txt"), tmp_path / "d").manifest
    assert m["count"] == N_IMAGES - 1 and m.get("dropped_count", 0) == 0
    assert m["options"]["yolo_rules"] == "ultralytics"
    (skip,) = m["skipped"]
    assert skip["path"] == f"{f.stem}.jpg"
    assert skip["reason"] == (f"annotation: labels/{f.name}:{n}: class 99 is out of range: NAMES "
                              f"has 7 classes (0..6); the image is left out, as ultralytics does "
                              f"(rules='lines' drops the line alone)")
    proc = run_packer("info", tmp_path / "d", env=packer_env())
    assert f"skipped: 1\n  {f.stem}.jpg: annotation: labels/{f.name}:{n}: class 99" in proc.stdout
    proc = run_packer("build", scenes / "images", tmp_path / "e", "--yolo", labels, "--names",
                      scenes / "names.txt", "--yolo-rules", "lines", "-q", "-j", "0",
                      env=packer_env())
    m = read_manifest(tmp_path / "e")
    assert m["count"] == N_IMAGES and m["skipped"] == []
    assert m["dropped"] == [{"path": f"{f.stem}.jpg", "reason": f"labels/{f.name}:{n}: class 99 is out of range: NAMES "
                                       f"has 7 classes (0..6)"}]
    assert "1 annotation(s) dropped" in proc.stderr


# -- verify ---------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["coco_built", "yolo_built"])
def test_verify_is_ok(request, which):
    rep = verify(request.getfixturevalue(which), progress=False)
    assert rep.ok, rep.problems
    assert rep.checked_records == N_IMAGES


def test_verify_reports_a_column_that_disagrees_with_the_records(coco_built, tmp_path):
    dst = tmp_path / "d"
    shutil.copytree(coco_built, dst)
    name = column_file("image_id", "int64")
    col = array("q")
    col.frombytes((dst / name).read_bytes())
    col.reverse()  # 40 distinct ids: every position now holds another record's
    (dst / name).write_bytes(col.tobytes())
    man = json.loads((dst / "manifest.json").read_text())
    entry = man["columns"]["image_id"]
    assert entry["path"] == name
    entry["sha256"], entry["bytes"] = file_sha256(dst / name), (dst / name).stat().st_size
    (dst / "manifest.json").write_text(json.dumps(man))
    assert PackedDataset(dst).column("image_id").tolist() == col.tolist()  # checksums fine
    rep = verify(dst, progress=False)
    assert not rep.ok
    assert len(rep.problems) == N_IMAGES, rep.problems
    first = PackedDataset(coco_built).load(0)
    assert f"image_id {first['image_id']} != its image_id column {col[0]}" in rep.problems[0]
    proc = run_packer("verify", "-q", dst, check=False, env=packer_env())
    assert proc.returncode == 1 and "image_id column" in proc.stderr


# -- box-aware decoders ---------------------------------------------------------------------

def expected_crop_boxes(boxes, crop, size, flipped, min_visible=0.25):
    """Boxes after crop + resize to ``size`` (h, w) + flip, computed here in plain Python:
    (kept indices, their boxes)."""
    oh, ow = size
    cx0, cy0, cx1, cy1 = crop
    sx, sy = ow / (cx1 - cx0), oh / (cy1 - cy0)
    keep, out = [], []
    for k, (x0, y0, x1, y1) in enumerate(boxes):
        nx0, nx1 = (x0 - cx0) * sx, (x1 - cx0) * sx
        ny0, ny1 = (y0 - cy0) * sy, (y1 - cy0) * sy
        if flipped:
            nx0, nx1 = ow - nx1, ow - nx0
        full = (nx1 - nx0) * (ny1 - ny0)
        c = [min(max(nx0, 0), ow), min(max(ny0, 0), oh), min(max(nx1, 0), ow),
             min(max(ny1, 0), oh)]
        seen = max(c[2] - c[0], 0) * max(c[3] - c[1], 0)
        assert abs(seen - min_visible * full) > 1e-6 * full  # no coin toss at the threshold
        if seen > 0 and seen >= min_visible * full:
            keep.append(k)
            out.append(c)
    return keep, out


def test_random_resized_crop_moves_the_boxes(coco_built, by_name):
    dec = DecodeRandomResizedCrop(128)
    ds = PackedDataset(coco_built, decode=dec, target_keys=KEYS + ["ann_ids", "segmentation"])
    whole = PackedDataset(coco_built, target_keys=["segmentation"])
    flips = dropped = kept = 0
    state = random.getstate()
    try:
        for i in range(len(ds)):
            rec = ds.load(i)
            anns = by_name[rec["path"]][1]
            truth = [[x, y, x + w, y + h] for x, y, w, h in (a["bbox"] for a in anns)]
            for seed in range(3):
                random.seed(1000 * seed + i)
                image, t = ds[i]
                random.seed(1000 * seed + i)
                _, crop, flipped = dec.decode_crop(rec["image"])
                assert image.shape == (3, 128, 128) and image.dtype == torch.uint8
                keep, want = expected_crop_boxes(truth, crop, (128, 128), flipped)
                boxes = plain(t["boxes"])
                assert boxes.shape == (len(keep), 4)
                assert ((boxes >= 0) & (boxes <= 128)).all()
                if keep:
                    assert torch.allclose(boxes.double(), torch.tensor(want, dtype=torch.float64),
                                          atol=1e-3), (rec["path"], seed)
                assert t["labels"].tolist() == [anns[k]["category_id"] for k in keep]
                assert t["area"].tolist() == [float(anns[k]["area"]) for k in keep]
                assert len(t["iscrowd"]) == len(keep) and t["image_id"] == rec["image_id"]
                assert t["ann_ids"].tolist() == [anns[k]["id"] for k in keep]
                segs = whole[i][1]["segmentation"]  # a list: it was kept whole before
                assert t["segmentation"] == [segs[k] for k in keep]
                flips += flipped
                kept += len(keep)
                dropped += len(truth) - len(keep)
    finally:
        random.setstate(state)
    assert flips and kept and dropped  # the check saw flips, kept boxes and dropped ones



def test_a_crop_keeps_per_image_arrays_whatever_their_length(tmp_path):
    # a per-image array as long as the boxes was cut like a per-object one; a name decides
    photo = make_image(random.Random(1), load_photos(), size=(320, 240))
    sample = {"image": photo, "boxes": [[0.0, 0.0, 30.0, 30.0], [200.0, 150.0, 320.0, 240.0]],
              "labels": [1, 2], "image_id": 0, "tags": [7, 9], "keypoints": [[5, 5], [250, 200]],
              "K": [[1.0, 0.0, 3.0], [0.0, 1.0, 4.0]]}  # rows, as many as the boxes: the image's
    packer.write(tmp_path / "d", [sample], progress=False)
    ds = PackedDataset(tmp_path / "d", target_keys="all",
                       decode=DecodeRandomResizedCrop(64, scale=(0.3, 0.3)))
    counts = set()
    for seed in range(40):
        random.seed(seed)
        _, t = ds[0]
        counts.add(len(t["boxes"]))
        assert t["tags"].tolist() == [7, 9] and len(t["labels"]) == len(t["boxes"])
        assert len(t["keypoints"]) == len(t["boxes"])  # a per-object name: cut with them
        assert t["K"].tolist() == [[1.0, 0.0, 3.0], [0.0, 1.0, 4.0]]
    assert 1 in counts  # some crops kept one box of two
def test_letterbox_moves_the_boxes(coco_built, by_name):
    ds = PackedDataset(coco_built, decode=DecodeLetterbox(160), target_keys=KEYS)
    for i in range(len(ds)):
        rec = ds.load(i)
        anns = by_name[rec["path"]][1]
        image, t = ds[i]
        assert image.shape == (3, 160, 160)
        w, h = rec["width"], rec["height"]
        r = min(160 / h, 160 / w)
        left, top = (160 - round(w * r)) // 2, (160 - round(h * r)) // 2
        want = torch.tensor([[x * r + left, y * r + top, (x + bw) * r + left, (y + bh) * r + top]
                             for x, y, bw, bh in (a["bbox"] for a in anns)],
                            dtype=torch.float64).reshape(-1, 4)
        boxes = plain(t["boxes"]).double()
        assert boxes.shape == want.shape  # nothing is cut away, nothing dropped
        assert t["labels"].tolist() == [a["category_id"] for a in anns]
        if len(want):
            # equal to box * r + pad; an edge on the image's far side may be clipped to the
            # canvas (the resized image is round(h * r) tall: at most half a pixel)
            assert torch.allclose(boxes, want.clamp(0, 160), atol=1e-3), rec["path"]
            assert (boxes - want).abs().max().item() <= 0.5 + 1e-3


# -- --meta: JSONL / CSV columns as typed fields ---------------------------------------------

@pytest.fixture(scope="module")
def meta_rows(by_name):
    names = sorted(by_name)[:8]
    return [{"path": n, "caption": f"scène {k}: {'a ' * k}cat", "tags": list(range(k % 4)),
             "emb": [0.25 * k, -1.5, 3.0, k / 3], "night": k % 3 == 0,
             "score": k if k % 2 else k + 0.125, "kind": ["cat", "dog", "bird"][k % 3]}
            for k, n in enumerate(names)]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


def test_meta_jsonl_fields(scenes, meta_rows, tmp_path):
    meta = write_jsonl(tmp_path / "meta.jsonl", meta_rows)
    m = quiet(Table(scenes / "images", meta), tmp_path / "d").manifest
    assert m["schema"] == {"task": "generic", "fields": [
        {"name": "caption", "type": "str"},
        {"name": "tags", "type": "array", "dtype": "int64", "shape": [-1]},
        {"name": "emb", "type": "array", "dtype": "float32", "shape": [4]},
        {"name": "night", "type": "bool"},
        {"name": "score", "type": "float"},
        {"name": "kind", "type": "str"}]}
    ds = PackedDataset(tmp_path / "d")
    assert ds.task == "generic" and len(ds) == len(meta_rows)
    for i, row in enumerate(meta_rows):
        rec = ds.load(i)
        assert rec["path"] == row["path"]
        _, t = ds[i]
        assert isinstance(t, dict) and set(t) == set(row) - {"path"}
        assert t["caption"] == row["caption"] and t["kind"] == row["kind"]
        assert t["tags"].dtype == torch.int64 and t["tags"].tolist() == row["tags"]
        assert t["emb"].dtype == torch.float32 and t["emb"].shape == (4,)
        assert torch.equal(t["emb"], torch.tensor(row["emb"], dtype=torch.float32))
        assert t["night"] is row["night"]
        assert type(t["score"]) is float and t["score"] == row["score"]
    assert ds.column("night").tolist() == [int(r["night"]) for r in meta_rows]
    assert ds.column("score").tolist() == [float(r["score"]) for r in meta_rows]
    with pytest.raises(KeyError):
        ds.column("caption")  # str has no side table
    with pytest.raises(AttributeError):
        ds.targets  # no class label
    assert PackedDataset(tmp_path / "d", target_fields="caption")[2][1] == meta_rows[2]["caption"]
    two = PackedDataset(tmp_path / "d", target_fields=["caption", "night"])[3][1]
    assert two == {"caption": meta_rows[3]["caption"], "night": meta_rows[3]["night"]}
    with pytest.raises(ValueError, match="nope"):
        PackedDataset(tmp_path / "d", target_fields="nope")
    assert verify(tmp_path / "d", progress=False).ok


def test_meta_label_column_makes_a_classification_dataset(scenes, meta_rows, tmp_path):
    rows = [{"path": r["path"], "kind": r["kind"]} for r in meta_rows]
    meta = write_jsonl(tmp_path / "labels.jsonl", rows)
    m = quiet(Table(scenes / "images", meta, label="kind"), tmp_path / "d").manifest
    classes = sorted({r["kind"] for r in rows})
    ds = PackedDataset(tmp_path / "d")
    assert ds.task == "classification" and m["schema"]["task"] == "classification"
    assert ds.classes == classes == ["bird", "cat", "dog"]
    assert ds.targets == [classes.index(r["kind"]) for r in rows]
    assert [ds[i][1] for i in range(len(ds))] == ds.targets  # the label alone
    assert m["class_counts"] == [sum(r["kind"] == c for r in rows) for c in classes]
    assert verify(tmp_path / "d", progress=False).ok
    # with other columns too: the label is one more field, targets still equal the column
    meta = write_jsonl(tmp_path / "all.jsonl", meta_rows)
    quiet(Table(scenes / "images", meta, label="kind"), tmp_path / "e")
    ds = PackedDataset(tmp_path / "e")
    assert ds.targets == [classes.index(r["kind"]) for r in meta_rows]
    assert ds.column("label").tolist() == ds.targets
    _, t = ds[1]
    assert t["label"] == ds.targets[1] and t["caption"] == meta_rows[1]["caption"]
    assert "kind" not in t


def test_meta_csv(scenes, meta_rows, tmp_path):
    lines = ["path,cls,weight,flag,note,box"]
    for k, r in enumerate(meta_rows):
        lines.append(f"{r['path']},{k % 3},{k * 0.5},{'true' if k % 2 else 'false'},"
                     f"\"hi, {k}\",\"[{k}, {k + 1}]\"")
    meta = tmp_path / "meta.csv"
    meta.write_text("\n".join(lines) + "\n")
    m = quiet(Table(scenes / "images", meta, label="cls"), tmp_path / "d").manifest
    assert [f["name"] for f in m["schema"]["fields"]] == ["label", "weight", "flag", "note", "box"]
    ds = PackedDataset(tmp_path / "d")
    n = len(meta_rows)
    assert ds.classes == ["0", "1", "2"] and ds.targets == [k % 3 for k in range(n)]
    assert ds.column("weight").tolist() == [k * 0.5 for k in range(n)]
    assert ds.column("flag").tolist() == [k % 2 for k in range(n)]
    _, t = ds[4]
    assert t["note"] == "hi, 4" and t["flag"] is False and t["box"].tolist() == [4, 5]
    assert verify(tmp_path / "d", progress=False).ok


# -- resume and merge -----------------------------------------------------------------------

def test_killed_coco_build_resumes_to_the_same_dataset(scenes, coco, tmp_path, monkeypatch):
    # bad boxes before the kill, in the shard being written when it comes, and after it
    ann = write_json(tmp_path / "bad.json", with_bad_annotations(
        coco, {2: ["zero"], 20: ["outside"], N_IMAGES - 3: ["zero", "outside"]}))
    kw = dict(shard_size=MiB, workers=2)
    ref = quiet(Coco(scenes / "images", ann), tmp_path / "ref", **kw).manifest
    assert len(ref["shards"]) >= 3 and ref["dropped_count"] == 4
    real, calls = ShardWriter.finish, []

    def finish(self):  # each worker (forked: its own list) finishes one shard, then is stopped
        calls.append(self.path.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self)
    dst = tmp_path / "d"
    with monkeypatch.context() as mp:
        mp.setattr(ShardWriter, "finish", finish)
        with pytest.raises(KeyboardInterrupt):
            quiet(Coco(scenes / "images", ann), dst, **kw)
    assert not (dst / "manifest.json").exists()
    left = sorted(p.name for p in dst.glob("shard-*.lmdb"))
    assert "shard-00000.lmdb" in left and len(left) <= 2  # at most one finished per worker
    r = quiet(Coco(scenes / "images", ann), dst, **kw)
    assert r.resumed_shards >= 1
    m = r.manifest
    assert records(dst) == records(tmp_path / "ref")
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in ref["shards"]]
    assert m["dropped"] == ref["dropped"] and m["dropped_count"] == ref["dropped_count"]
    assert m["columns"] == ref["columns"] and m["categories"] == ref["categories"]
    assert verify(dst, progress=False).ok


def targets_by_image_id(root):
    ds = PackedDataset(root, target_keys=KEYS)
    out = {}
    for i in range(len(ds)):
        rec = ds.load(i)
        t = ds.make_target(rec)
        out[rec["image_id"]] = (rec["path"], plain(t["boxes"]).tolist(), t["labels"].tolist(),
                                t["area"].tolist(), t["iscrowd"].tolist(), rec["segmentation"])
    return out


def test_merged_parts_read_like_one_build(scenes, coco, tmp_path):
    ann = write_json(tmp_path / "bad.json", with_bad_annotations(coco, {1: ["zero"], 6: ["outside"]}))
    single = quiet(Coco(scenes / "images", ann), tmp_path / "single").manifest
    for k in range(2):
        quiet(Coco(scenes / "images", ann), tmp_path / f"part{k}", part=f"{k}/2")
    m = merge([tmp_path / "part0", tmp_path / "part1"], tmp_path / "merged")
    assert m["count"] == N_IMAGES
    assert m["schema"] == single["schema"]
    assert m["categories"] == single["categories"] and m["classes"] == single["classes"]
    assert set(m["columns"]) == set(single["columns"]) == {"width", "height", "image_id"}
    assert sorted(map(json.dumps, m["dropped"])) == sorted(map(json.dumps, single["dropped"]))
    ds = PackedDataset(tmp_path / "merged", target_keys=KEYS)
    assert ds.task == "detection" and ds.categories == coco["categories"]
    merged, one = targets_by_image_id(tmp_path / "merged"), targets_by_image_id(tmp_path / "single")
    assert merged == one and len(one) == N_IMAGES
    recs = records(tmp_path / "merged")
    assert ds.column("image_id").tolist() == [r["image_id"] for r in recs]
    assert ds.column("width").tolist() == [r["width"] for r in recs]
    assert verify(tmp_path / "merged", progress=False).ok


# -- the command line -----------------------------------------------------------------------

def test_cli_build_coco(scenes, coco_built, tmp_path):
    dst = tmp_path / "d"
    proc = run_packer("build", scenes / "images", dst, "--coco", scenes / "annotations.json",
                      "-q", "-j", "0", env=packer_env())
    assert f"packed {N_IMAGES} images" in proc.stdout
    assert targets_by_image_id(dst) == targets_by_image_id(coco_built)
    proc = run_packer("verify", "-q", dst, env=packer_env())
    assert proc.stdout.startswith("OK:")


def test_cli_coco_and_yolo_exclude_each_other(scenes, tmp_path):
    dst = tmp_path / "d"
    proc = run_packer("build", scenes / "images", dst, "--coco", scenes / "annotations.json",
                      "--yolo", scenes / "labels", "--names", scenes / "names.txt", "-q",
                      check=False, env=packer_env())
    assert proc.returncode == 2, proc.stderr
    assert "--coco and --yolo" in proc.stderr and "exclude each other" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (dst / "manifest.json").exists()


def test_build_arguments_that_do_not_go_together(scenes, tmp_path):
    """The CLI's flags that need each other; from Python, each source takes what it needs."""
    for args, message in [(["--yolo", scenes / "labels"], "--yolo LABELS_DIR and --names NAMES"),
                          (["--yolo-rules", "lines"], "--yolo-rules applies to --yolo datasets"),
                          (["--label", "kind"], "--label COLUMN picks a column of --meta FILE"),
                          (["--skip-empty"], "--skip-empty applies to --coco datasets")]:
        proc = run_packer("build", scenes / "images", tmp_path / "d", *args, "-q",
                          check=False, env=packer_env())
        assert proc.returncode == 2 and f"Error: {message}" in proc.stderr, proc.stderr  # usage
    assert not (tmp_path / "d").exists()
    with pytest.raises(PackerError, match=r"build\(source, dst\): source must be a folder path"):
        build(42, tmp_path / "d")
