"""``make_detection_folder``: real files whose boxes, labels and ids can be trusted by tests."""
import io
import json

import pytest
from PIL import Image, ImageChops

from packer.demo.images import load_photos
from packer.demo.scenes import category_id, image_id, make_detection_folder, photo_names, render_scene

ARGS = dict(images=24, seed=3, max_objects=6, empty_fraction=0.25)
ASPECTS = [4 / 3, 3 / 2, 1.0, 16 / 9, 3 / 4]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_detection_folder(tmp_path_factory.mktemp("det") / "data", **ARGS)


@pytest.fixture(scope="module")
def coco(folder):
    return json.loads((folder / "annotations.json").read_text())


def by_image(coco):
    """{image id: [annotation, ...]} in file order."""
    out = {im["id"]: [] for im in coco["images"]}
    for a in coco["annotations"]:
        out[a["image_id"]].append(a)
    return out


def boxes_of(coco):
    """{file_name: [(category_id, [x0, y0, x1, y1]), ...]}, every image listed."""
    names = {im["id"]: im["file_name"] for im in coco["images"]}
    out = {n: [] for n in names.values()}
    for a in coco["annotations"]:
        x, y, w, h = a["bbox"]
        out[names[a["image_id"]]].append((a["category_id"], [x, y, x + w, y + h]))
    return out


def shoelace(poly):
    xs, ys = poly[0::2], poly[1::2]
    return abs(sum(xs[i] * ys[i - 1] - xs[i - 1] * ys[i] for i in range(len(xs)))) / 2


def test_jpegs_are_imagenet_like_and_match_the_annotations(folder, coco):
    assert len(coco["images"]) == ARGS["images"]
    for im in coco["images"]:
        data = (folder / "images" / im["file_name"]).read_bytes()
        with Image.open(io.BytesIO(data)) as pic:
            assert pic.format == "JPEG" and pic.mode == "RGB"
            w, h = pic.size
        assert (w, h) == (im["width"], im["height"])
        assert 300 <= min(w, h) <= 500
        assert min(abs(w / h - a) for a in ASPECTS) < 0.01
        assert 10_000 < len(data) < 400_000  # photo-like, not flat colour or noise


def test_every_box_is_inside_its_image_and_fits_its_mask(coco):
    sizes = {im["id"]: (im["width"], im["height"]) for im in coco["images"]}
    touching = 0
    for a in coco["annotations"]:
        W, H = sizes[a["image_id"]]
        x, y, w, h = a["bbox"]
        assert all(isinstance(v, float) for v in a["bbox"])
        assert x >= 0 and y >= 0 and x + w <= W and y + h <= H and w > 0 and h > 0
        assert 0.05 * min(W, H) * 0.5 < max(w, h) and w <= 0.6 * W and h <= 0.6 * H
        touching += x == 0 or y == 0 or x + w == W or y + h == H
        assert a["iscrowd"] == 0 and 0.5 * w * h < a["area"] <= w * h
        (poly,) = a["segmentation"]
        xs, ys = poly[0::2], poly[1::2]
        assert len(xs) == len(ys) >= 4
        assert x <= min(xs) and max(xs) <= x + w and y <= min(ys) and max(ys) <= y + h
        assert max(xs) - min(xs) >= w - 2 and max(ys) - min(ys) == h
        assert shoelace(poly) == pytest.approx(a["area"], rel=0.03)
    assert touching > 0, "some objects should touch the image border"


def test_ids_are_not_indices(coco):
    cats = coco["categories"]
    assert [c["name"] for c in cats] == photo_names()
    assert [c["id"] for c in cats] == [category_id(k) for k in range(len(cats))]
    assert [c["id"] for c in cats] != list(range(len(cats)))
    assert [c["id"] for c in cats] != list(range(1, len(cats) + 1))
    assert {c["supercategory"] for c in cats} == {"photo"}
    ids = [im["id"] for im in coco["images"]]
    assert ids == [image_id(i) for i in range(len(ids))] and ids[0] != 0 and ids[1] - ids[0] > 1
    assert [im["file_name"] for im in coco["images"]] == [f"{i:06d}.jpg" for i in range(len(ids))]
    ann_ids = [a["id"] for a in coco["annotations"]]
    assert len(set(ann_ids)) == len(ann_ids)
    assert {a["category_id"] for a in coco["annotations"]} <= {c["id"] for c in cats}


def test_some_images_are_empty_and_yolo_labels_match_coco(folder, coco):
    index = {c["id"]: k for k, c in enumerate(sorted(coco["categories"], key=lambda c: c["id"]))}
    names = [c["name"] for c in sorted(coco["categories"], key=lambda c: c["id"])]
    assert (folder / "names.txt").read_text().splitlines() == names
    yaml = (folder / "data.yaml").read_text()
    assert yaml.split("names:\n")[1].splitlines() == [f"  - {n}" for n in names]
    missing = empty_files = 0
    anns = by_image(coco)
    for im in coco["images"]:
        path = folder / "labels" / im["file_name"].replace(".jpg", ".txt")
        if not anns[im["id"]]:
            missing += not path.exists()
            empty_files += path.exists() and path.read_text() == ""
            continue
        rows = [line.split() for line in path.read_text().splitlines()]
        assert len(rows) == len(anns[im["id"]])
        for row, a in zip(rows, anns[im["id"]]):
            assert int(row[0]) == index[a["category_id"]]
            x, y, w, h = a["bbox"]
            W, H = im["width"], im["height"]
            want = [(x + w / 2) / W, (y + h / 2) / H, w / W, h / H]
            assert [float(v) for v in row[1:]] == pytest.approx(want, abs=1e-6)
            assert all(0 <= float(v) <= 1 for v in row[1:])
    empty = round(ARGS["images"] * ARGS["empty_fraction"])
    assert (missing, empty_files) == (empty // 2, empty - empty // 2)
    assert sum(len(v) > 1 for v in anns.values()) > ARGS["images"] // 2


def test_same_arguments_give_the_same_bytes(folder, tmp_path):
    again = make_detection_folder(tmp_path / "again", **ARGS)
    files = sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (folder / rel).read_bytes() == (again / rel).read_bytes(), rel
    other = make_detection_folder(tmp_path / "other", **dict(ARGS, images=2, seed=4))
    assert (other / "images/000000.jpg").read_bytes() != (folder / "images/000000.jpg").read_bytes()


def test_each_box_frames_exactly_the_pixels_its_object_changed(folder, coco):
    """Render each scene again without one object: every changed pixel lies in its box, and
    an object no later one overlaps changed pixels out to (nearly) every side of the box."""
    photos, boxes = load_photos(), boxes_of(coco)
    checked = 0
    for i in range(8):
        scene = render_scene(ARGS["seed"], i, photos, max_objects=ARGS["max_objects"])
        name = f"{i:06d}.jpg"
        if not boxes[name]:
            continue  # empty in the folder; rendered here with objects, so not comparable
        assert [(category_id(o.label), list(map(float, o.box))) for o in scene.objects] == \
            boxes[name]
        with Image.open(folder / "images" / name) as pic:  # the file is this scene, encoded
            diff = ImageChops.difference(pic.convert("RGB"), scene.image).convert("L")
            assert sum(k * n for k, n in enumerate(diff.histogram())) / diff.width / diff.height < 8
        for k, obj in enumerate(scene.objects):
            without = render_scene(ARGS["seed"], i, photos, max_objects=ARGS["max_objects"],
                                   without={k})
            assert [o.box for o in without.objects] == [o.box for o in scene.objects]
            changed = ImageChops.difference(scene.image, without.image).convert("L")
            x0, y0, x1, y1 = obj.box
            c0, c1, c2, c3 = changed.getbbox()
            assert x0 <= c0 and y0 <= c1 and c2 <= x1 and c3 <= y1
            moved = sum(changed.crop(obj.box).point(lambda v: v > 0 and 255).histogram()[255:])
            assert moved > 0.5 * obj.area  # later objects hide at most 30%
            later = [o.box for o in scene.objects[k + 1:]]
            if not any(max(a[0], x0) < min(a[2], x1) and max(a[1], y0) < min(a[3], y1)
                       for a in later):
                assert max(c0 - x0, c1 - y0, x1 - c2, y1 - c3) <= 3
                checked += 1
    assert checked > 5


def test_scenes_made_by_several_processes_are_the_same_bytes(tmp_path):
    def contents(root):
        return {p.relative_to(root).as_posix(): p.read_bytes()
                for p in sorted(root.rglob("*")) if p.is_file()}
    one = make_detection_folder(tmp_path / "one", 130, seed=3, workers=1)
    two = make_detection_folder(tmp_path / "two", 130, seed=3, workers=2)  # 65 scenes each
    assert contents(two) == contents(one)
