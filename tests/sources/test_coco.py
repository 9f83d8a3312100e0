"""COCO instances JSON: entries, schema, fitted targets, and every bad input's outcome."""
from __future__ import annotations

import hashlib
import json
import math
import pickle
import random
import threading
from pathlib import Path

import msgpack
import msgspec
import pytest
import torch

from packer.writing.builder import build
from packer.demo import load_photos, make_image
from packer.errors import PackerError
from packer.format.fields import data_problem, encode, field_of
from packer.format.records import pack_fields
from packer.sources.coco import Annotation, Coco, Row, coco_schema, fit_box, fit_coco, read_coco, stored_segmentation

RLE = {"counts": "0`0Q0", "size": [40, 60]}
POLY = [[10.0, 10.0, 30.0, 10.0, 30.0, 20.0]]


def fitted(fit, row, width, height):
    """``fit``'s values as a reader sees them (the stored arrays as lists, segmentations
    stored as bytes already unpacked), to compare with the JSON's numbers."""
    values, reasons = fit(row, width, height)
    out = dict(values)
    out["segmentation"] = [msgpack.unpackb(bytes(x)) for x in values["segmentation"]]
    for f in map(field_of, coco_schema()):
        if f.type == "array":
            v = f.values(values[f.name]).tolist()
            out[f.name] = [v[i:i + 4] for i in range(0, len(v), 4)] if f.name == "boxes" else v
    return out, reasons


def obj(aid, cid, box, area=None, crowd=0, seg=()):
    """An object as the read gives it; ``seg`` as JSON text, or a value to write as JSON."""
    text = seg if isinstance(seg, str) else json.dumps(list(seg) if seg == () else seg)
    return Annotation(aid, 1, cid, tuple(map(float, box)), area, crowd,
                      msgspec.Raw(text.encode()))


def coco(**over):
    """A small valid instances dict: non-contiguous category ids given out of order, image
    ids out of order, a polygon, a crowd RLE, an object without area, an image without
    objects."""
    data = {
        "images": [{"id": 7, "file_name": "b/seven.jpg", "width": 60, "height": 40},
                   {"id": 2, "file_name": "two.jpg"},
                   {"id": 5, "file_name": "./five.png"}],
        "annotations": [
            {"id": 11, "image_id": 2, "category_id": 90, "bbox": [10, 10, 20, 10],
             "area": 100.0, "iscrowd": 0, "segmentation": POLY},
            {"id": 12, "image_id": 7, "category_id": 1, "bbox": [0.5, 1.5, 5, 4]},
            {"id": 10, "image_id": 2, "category_id": 3, "bbox": [0, 0, 60, 40],
             "area": 2400, "iscrowd": 1, "segmentation": RLE},
        ],
        "categories": [{"id": 90, "name": "toothbrush", "supercategory": "indoor"},
                       {"id": 1, "name": "person", "supercategory": "person"},
                       {"id": 3, "name": "car"}],
    }
    data.update(over)
    return data


def write(tmp_path, data, name="instances.json"):
    (tmp_path / "img").mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return tmp_path / "img", path


def read(tmp_path, data, **kw):
    return read_coco(*write(tmp_path, data), **kw)


def test_classes_entries_schema_and_rows(tmp_path):
    src = read(tmp_path, coco())
    assert src.classes == ["person", "car", "toothbrush"]  # ascending category id
    assert src.entries == [("two.jpg", -1), ("five.png", -1), ("b/seven.jpg", -1)]
    ann = src.annotations
    assert ann.task == "detection"
    assert [f["name"] for f in ann.schema] == ["image_id", "boxes", "labels", "area", "iscrowd",
                                               "ann_ids", "segmentation"]
    assert ann.schema[1] == {"name": "boxes", "type": "array", "dtype": "float32",
                             "shape": [-1, 4]}
    assert ann.schema[2]["dtype"] == "int64" and ann.schema[6] == {"name": "segmentation",
                                                                   "type": "data"}
    assert ann.extra == {"categories": [
        {"id": 1, "name": "person", "supercategory": "person"},
        {"id": 3, "name": "car"},
        {"id": 90, "name": "toothbrush", "supercategory": "indoor"}]}
    assert ann.dropped == []
    assert ann.rows[1] == Row(5, [])  # kept, no objects


def test_fit_gives_torchvision_style_targets(tmp_path):
    ann = read(tmp_path, coco()).annotations
    values, reasons = fitted(ann.fit, ann.rows[0], 60, 40)
    assert reasons == []
    assert values == {
        "image_id": 2,
        "boxes": [[10.0, 10.0, 30.0, 20.0], [0.0, 0.0, 60.0, 40.0]],
        "labels": [90, 3],  # COCO category ids, in the JSON's order
        "area": [100.0, 2400.0],
        "iscrowd": [0, 1],
        "ann_ids": [11, 10],
        "segmentation": [POLY, RLE]}
    values, _ = fitted(ann.fit, ann.rows[2], 60, 40)
    assert values["boxes"] == [[0.5, 1.5, 5.5, 5.5]]
    assert values["area"] == [20.0]  # no area in the JSON: the box's
    assert values["iscrowd"] == [0] and values["segmentation"] == [[]]
    assert fitted(ann.fit, ann.rows[1], 60, 40)[0]["boxes"] == []
    assert pickle.loads(pickle.dumps(ann.fit)) is fit_coco


def test_fit_clips_and_drops_bad_boxes_keeping_arrays_aligned():
    boxes = [[-10, 5, 30, 20], [0, 0, 0, 5], [1, 1, 4, -2], [float("nan"), 0, 1, 1],
             [200, 10, 5, 5], [90, 40, 20, 20], [100, 0, 5, 5], [0, 0, 1e308, 1e308],
             [1, 1, 2, 2], [1, 1, 2, 2]]
    areas = [None, 1.0, 1.0, 1.0, 1.0, 7.5, 1.0, 1.0, 10 ** 400, 2]
    rle = {"counts": [10, 20, 4970], "size": [50, 100]}
    segs = [[[1, 2, 3, 4.5, 5, 6]], [], [], [], [], rle, [], [], "poly", [[1]]]
    row = Row(1, [obj(31 + k, 1 + k, box, area, int(k == 5), [seg]) if seg == "poly" else
                  obj(31 + k, 1 + k, box, area, int(k == 5), seg)
                  for k, (box, area, seg) in enumerate(zip(boxes, areas, segs))])
    values, reasons = fitted(fit_coco, row, 100, 50)
    assert values == {"image_id": 1, "boxes": [[0.0, 5.0, 20.0, 25.0], [90.0, 40.0, 100.0, 50.0],
                                               [1.0, 1.0, 3.0, 3.0]],
                      "labels": [1, 6, 10], "area": [400.0, 7.5, 2.0], "iscrowd": [0, 1, 0],
                      "ann_ids": [31, 36, 40],
                      "segmentation": [[[1, 2, 3, 4.5, 5, 6]], rle, [[1]]]}
    assert reasons == [
        "annotation 32: zero or negative size box [0, 0, 0, 5]",
        "annotation 33: zero or negative size box [1, 1, 4, -2]",
        "annotation 34: box [nan, 0, 1, 1] holds a non-finite number",
        "annotation 35: box [200, 10, 5, 5] lies outside the 100x50 image",
        "annotation 37: box [100, 0, 5, 5] lies outside the 100x50 image",
        "annotation 38: box [0, 0, 1e+308, 1e+308] holds a non-finite number",
        "annotation 39: 'segmentation' must be polygons [[x1, y1, ...], ...] of finite "
        "numbers or an RLE {\"counts\", \"size\"}"]


def test_skip_empty_leaves_out_images_without_objects(tmp_path):
    src = read(tmp_path, coco(), skip_empty=True)
    assert [p for p, _ in src.entries] == ["two.jpg", "b/seven.jpg"]
    assert src.annotations.extra["skipped_empty"] == 1
    assert [r.image_id for r in src.annotations.rows] == [2, 7]
    assert "skipped_empty" not in read(tmp_path, coco()).annotations.extra


def test_skip_empty_counts_images_whose_objects_were_all_unusable(tmp_path):
    anns = [{"id": 1, "image_id": 2, "category_id": 4, "bbox": [0, 0, 1, 1]}]
    src = read(tmp_path, coco(annotations=anns), skip_empty=False)
    assert len(src.entries) == 3
    with pytest.raises(PackerError, match="no image has a usable annotation"):
        read(tmp_path, coco(annotations=anns), skip_empty=True)


def test_only_listed_images_are_packed_and_files_are_not_checked(tmp_path):
    img, path = write(tmp_path, coco())
    (img / "two.jpg").write_bytes(b"x")
    (img / "unlisted.jpg").write_bytes(b"x")  # not in the JSON: not packed
    src = read_coco(img, path)  # five.png, b/seven.jpg do not exist: still listed
    assert [p for p, _ in src.entries] == ["two.jpg", "five.png", "b/seven.jpg"]


@pytest.mark.parametrize("name, why", [
    ("/etc/passwd", "file_name is absolute"),
    ("../outside.jpg", "file_name contains '..'"),
    ("a/../../x.jpg", "file_name contains '..'"),
    (17, "file_name must be a string, not int"),
    ("", "file_name is empty"),
    ("nul\0.jpg", "file_name contains a NUL"),
])
def test_unsafe_file_names_drop_the_image(tmp_path, name, why):
    imgs = [{"id": 2, "file_name": "two.jpg"}, {"id": 3, "file_name": name}]
    anns = [{"id": 1, "image_id": 3, "category_id": 1, "bbox": [0, 0, 1, 1]}]
    src = read(tmp_path, coco(images=imgs, annotations=anns))  # json escapes \0
    assert src.entries == [("two.jpg", -1)]
    (drop,) = src.annotations.dropped  # its annotation goes with it, unreported
    assert drop["reason"].startswith(f"image id 3: {why}")


def test_text_that_is_no_unicode_is_not_json(tmp_path):
    """A lone surrogate escape (``"\\udcff"``) holds no Unicode text: the file is refused
    with where it is, not read with a name no file system has."""
    imgs = [{"id": 2, "file_name": "two.jpg"}, {"id": 3, "file_name": "bad\udcff.jpg"}]
    text = json.dumps(coco(images=imgs))
    with pytest.raises(PackerError, match=r"instances\.json:1:\d+: not valid JSON \(invalid "
                                          r"utf-16 surrogate pair\)"):
        read(tmp_path, text)


def test_unknown_image_and_category_drop_the_object(tmp_path):
    anns = [{"id": 1, "image_id": 99, "category_id": 1, "bbox": [0, 0, 1, 1]},
            {"id": 2, "image_id": 2, "category_id": 4, "bbox": [0, 0, 1, 1]},
            {"id": 3, "image_id": 2, "category_id": 3, "bbox": [0, 0, 1, 1]}]
    src = read(tmp_path, coco(annotations=anns))
    assert src.annotations.dropped == [
        {"path": "instances.json", "reason": "annotation 1: image id 99 is not in 'images'"},
        {"path": "two.jpg", "reason": "annotation 2: category id 4 is not in 'categories'"}]
    assert [o.id for o in src.annotations.rows[0].objects] == [3]


@pytest.mark.parametrize("change, message", [
    (lambda d: d["images"].append({"id": 7, "file_name": "x.jpg"}),
     "image id 7 appears twice"),
    (lambda d: d["annotations"].append({"id": 11, "image_id": 2, "category_id": 1,
                                        "bbox": [0, 0, 1, 1]}),
     r"\$\.annotations\[3\]\.id: annotation id 11 appears twice \(\$\.annotations\[0\] and "
     r"\[3\]\)"),
    (lambda d: d["categories"].append({"id": 3, "name": "bus"}), "category id 3 appears twice"),
    (lambda d: d["categories"].append({"id": 4, "name": "car"}),
     "categories 3 and 4 are both named 'car'"),
    (lambda d: d.pop("annotations"), r"\$: object missing required field annotations "
                                     r"\(annotations: a list of"),
    (lambda d: d.update(images={}), r"\$\.images: expected array, got object \(images: a list"),
    (lambda d: d.update(images=[]), r"\$\.images is empty"),
    (lambda d: d["images"][0].pop("file_name"),
     r"\$\.images\[0\]: object missing required field file_name"),
    (lambda d: d["images"].append("x.jpg"), r"\$\.images\[3\]: expected object, got str"),
    (lambda d: d["images"][1].update(id="2"),
     r"\$\.images\[1\]\.id: expected int, got str \(id: a non-negative integer id\)"),
    (lambda d: d["images"][1].update(id=-2), r"\$\.images\[1\]\.id: expected int >= 0"),
    (lambda d: d["annotations"][1].pop("bbox"),
     r"\$\.annotations\[1\]: object missing required field bbox \(bbox: \[x, y, width, "
     r"height\] numbers\)"),
    (lambda d: d["annotations"][1].update(bbox=[1, 2, 3]),
     r"\$\.annotations\[1\]\.bbox: expected array of length 4"),
    (lambda d: d["annotations"][1].update(bbox=[1, 2, 3, "4"]),
     r"\$\.annotations\[1\]\.bbox\[3\]: expected float, got str"),
    (lambda d: d["annotations"][1].update(image_id=None),
     r"\$\.annotations\[1\]\.image_id: expected int, got null"),
    (lambda d: d["annotations"][1].update(iscrowd=2),
     r"\$\.annotations\[1\]\.iscrowd: expected int <= 1 \(iscrowd: 0 or 1\)"),
    (lambda d: d["annotations"][1].update(iscrowd=1.0),
     r"\$\.annotations\[1\]\.iscrowd: expected bool \| int, got float \(iscrowd: 0 or 1"),
    (lambda d: d["categories"][0].pop("name"),
     r"\$\.categories\[0\]: object missing required field name"),
    (lambda d: d["categories"][0].update(name=""),
     r"\$\.categories\[0\]\.name: expected str of length >= 1"),
])
def test_ambiguous_or_malformed_json_is_an_error(tmp_path, change, message):
    data = coco()
    change(data)
    with pytest.raises(PackerError, match=message) as e:
        read(tmp_path, data)
    assert "instances.json" in str(e.value)


def test_the_digest_is_the_files_sha256_and_a_failed_read_leaves_no_thread(tmp_path):
    """The file is hashed in a thread while it is parsed; an error while parsing still
    reaches the caller, after the thread is done."""
    img, path = write(tmp_path, coco())
    assert read_coco(img, path).annotations.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    threads = threading.active_count()
    path.write_text('{"images": [', encoding="utf-8")
    with pytest.raises(PackerError, match="not valid JSON"):
        read_coco(img, path)
    assert threading.active_count() == threads


def test_truncated_json_names_line_and_column(tmp_path):
    text = json.dumps(coco(), indent=1)
    with pytest.raises(PackerError, match=r"instances\.json:\d+:\d+: not valid JSON") as e:
        read(tmp_path, text[:len(text) // 2])
    assert "fetch it again" in str(e.value)


@pytest.mark.parametrize("data, message", [
    ([1, 2], r"\$: expected object, got array \(a COCO instances object with images, "),
    ("", "not valid JSON"),
    ("null", r"\$: expected object, got null"),
])
def test_wrong_top_level(tmp_path, data, message):
    with pytest.raises(PackerError, match=message):
        read(tmp_path, json.dumps(data) if not isinstance(data, str) else data)


def test_not_utf8_missing_file_and_missing_folder(tmp_path):
    img, path = write(tmp_path, coco())
    path.write_bytes(b'{"images": "caf\xe9"}')
    with pytest.raises(PackerError, match="is not UTF-8 text"):
        read_coco(img, path)
    with pytest.raises(PackerError, match="does not exist"):
        read_coco(img, tmp_path / "nope.json")
    with pytest.raises(PackerError, match=r"Coco\(images, annotations\): images .* does not"):
        read_coco(tmp_path / "nope", path)


def test_bad_area_falls_back_to_the_box(tmp_path):
    anns = [{"id": 1, "image_id": 2, "category_id": 1, "bbox": [0, 0, 2, 3], "area": "big"},
            {"id": 2, "image_id": 2, "category_id": 1, "bbox": [0, 0, 2, 3], "area": -4}]
    ann = read(tmp_path, coco(annotations=anns)).annotations
    assert fitted(ann.fit, ann.rows[0], 10, 10)[0]["area"] == [6.0, 6.0]


@pytest.mark.parametrize("text, message", [
    ('{"info": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),
    ('{"images": [' + "[" * 5000 + "]" * 5000 + "]}", r"\$\.images\[0\]: expected object"),
    ('{"images": [{"id": ' + "7" * 5000 + "}]}", r"\$\.images\[0\]\.id: integer value out of"),
    ('{"annotations": [{"segmentation": [[1, 2]]]}', "not valid JSON"),  # a stray ]
    ('{"annotations": [{"segmentation": ' + "[" * 100000 + "]]}]}", "nested too deeply"),
    ('{"annotations": [{"segmentation": [[1, NaN]]}]}', r"1:40: not valid JSON \(invalid "
                                                        r"character\)"),
])
def test_hostile_json_is_an_error_not_a_crash(tmp_path, text, message):
    with pytest.raises(PackerError, match=message):
        read(tmp_path, text)


def test_polygons_reach_the_workers_as_text_and_read_back_the_same(tmp_path):
    polys = [[[1, 2.5, 3e1, 4, 5, 6]], [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]]
    anns = [{"id": k + 1, "image_id": 2, "category_id": 1, "bbox": [0, 0, 9, 9],
             "segmentation": p} for k, p in enumerate(polys)]
    text = json.dumps(coco(annotations=anns), indent=2)  # newlines inside the lists too
    ann = read(tmp_path, text).annotations
    assert all(type(o.segmentation) is msgspec.Raw for o in ann.rows[0].objects)  # not parsed
    assert fitted(ann.fit, ann.rows[0], 50, 50)[0]["segmentation"] == polys


@pytest.mark.parametrize("broken", ["[[10.0, 10.0, 30.0,, 20.0]]", "[[10 10 30]]",
                                    "[[10, 10, 30, 20]\f]", "[[10, 10, 30, 20]"])
@pytest.mark.parametrize("where", ["stored", "unknown image", "bad file name",
                                   "unknown category"])
def test_a_broken_polygon_stops_the_read_whatever_its_object(tmp_path, broken, where):
    """Polygon text that is not JSON means the file is not JSON: the read stops, naming the
    line and column, whether or not its object would be stored."""
    images = [{"id": 2, "file_name": "two.jpg"}, {"id": 3, "file_name": "../three.jpg"}]
    ann = {"id": 11, "image_id": {"unknown image": 9, "bad file name": 3}.get(where, 2),
           "category_id": 4 if where == "unknown category" else 90, "bbox": [1, 1, 5, 5],
           "segmentation": POLY}
    good = json.dumps(coco(images=images, annotations=[ann]))
    read(tmp_path, good)  # stored, or dropped with a reason
    with pytest.raises(PackerError, match=r"instances\.json:1:\d+: not valid JSON"):
        read(tmp_path, good.replace(json.dumps(POLY), broken))


def test_a_broken_file_stops_the_build_before_dst_is_made(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    (img / "one.jpg").write_bytes(make_image(random.Random(1), load_photos()))
    path = tmp_path / "instances.json"
    good = json.dumps(coco(images=[{"id": 2, "file_name": "one.jpg"}]))
    for workers in (0, 2):
        path.write_text(good)
        assert build(Coco(img, path), tmp_path / f"ok-{workers}", workers=workers,
                     progress=False).manifest["count"] == 1
        path.write_text(good.replace(json.dumps(POLY), "[[10 10 30]]"))
        with pytest.raises(PackerError, match="not valid JSON"):
            build(Coco(img, path), tmp_path / f"bad-{workers}", workers=workers, progress=False)
        assert not (tmp_path / f"bad-{workers}").exists()


def annotation_variants():
    """An annotation, then each field (one, or the three ids together) at the edges of what
    the read takes, and a few records that are not objects."""
    base = {"id": 5, "image_id": 2, "category_id": 3, "bbox": [1, 2.5, 3, 4], "area": 1,
            "iscrowd": 0, "segmentation": POLY}
    yield base
    ids = [0, 2 ** 62, 2 ** 63 - 1, 2 ** 63, -1, -2 ** 63, True, 1.0, "5", None]
    values = {"id": ids, "image_id": ids, "category_id": ids,
              "bbox": [[1.0, 2, 3, 4], [True, 1, 1, 1], ["1", 1, 1, 1], [None, 1, 1, 1],
                       [1, True, 1, 1], [1, 1, "1", 1], [1, 1, 1, None], [1, 1, 1, False],
                       [1, 2, 3], [1, 2, 3, 4, 5], {"x": 1}, "1,2,3,4"],
              "iscrowd": [1, True, False, 1.0, 0.0, 2, -1, None, "1"]}
    for key, options in values.items():
        for v in options:
            yield dict(base, **{key: v})
        yield {k: v for k, v in base.items() if k != key}
    for a, b, c in [(-1, 2 ** 63 - 1, 0), (2 ** 63, 0, 0), (0, 0, 2 ** 64), (2 ** 62, 2 ** 62, 1)]:
        yield dict(base, id=a, image_id=b, category_id=c)
    yield from ([base], "x", None, {})


def is_id(v) -> bool:
    return type(v) is int and 0 <= v < 2 ** 63


def usable(ann) -> bool:
    """Whether an annotation record is one the read takes (what it checks, written out)."""
    if type(ann) is not dict or not all(k in ann for k in ("id", "image_id", "category_id", "bbox")):
        return False
    box, crowd = ann["bbox"], ann.get("iscrowd", 0)
    return (all(is_id(ann[k]) for k in ("id", "image_id", "category_id"))
            and type(box) is list and len(box) == 4
            and all(type(v) in (int, float) for v in box) and type(crowd) in (int, bool)
            and crowd in (0, 1))


@pytest.mark.parametrize("ann", list(annotation_variants()))
def test_each_annotation_is_read_or_refused_naming_its_path(tmp_path, ann):
    data = coco(annotations=[ann])
    if usable(ann):
        ann_list = read(tmp_path, data).annotations
        got = [(o.id, o.category_id, list(o.bbox), o.iscrowd) for o in ann_list.rows[0].objects]
        if ann["image_id"] != 2 or ann["category_id"] not in (1, 3, 90):
            assert got == [] and len(ann_list.dropped) == 1
        else:
            assert got == [(ann["id"], ann["category_id"], [float(v) for v in ann["bbox"]],
                            ann.get("iscrowd", 0))]
    else:
        with pytest.raises(PackerError, match=r"instances\.json: \$\.annotations\[0\]"):
            read(tmp_path, data)


IDS = [7, 0, 2 ** 63 - 1, 2 ** 63, -1, True, 7.0, "7", None]
NAMES = ["a.jpg", "", None, 5, ["a.jpg"], "../a.jpg"]


@pytest.mark.parametrize("img", [{"id": i, "file_name": n} for i in IDS for n in NAMES]
                         + [{"id": 7}, {"file_name": "a.jpg"}, {}, [7, "a.jpg"], "a.jpg", None])
def test_each_image_is_read_dropped_or_refused_naming_its_path(tmp_path, img):
    data = coco(images=[img])
    if type(img) is not dict or not is_id(img.get("id")) or "file_name" not in img:
        with pytest.raises(PackerError, match=r"instances\.json: \$\.images\[0\]"):
            read(tmp_path, data)
    elif img["file_name"] == "a.jpg":
        assert read(tmp_path, data).entries == [("a.jpg", -1)]
    else:
        with pytest.raises(PackerError, match=r"\$\.images is empty|image id .* file_name"):
            src = read(tmp_path, data)
            raise PackerError(src.annotations.dropped[0]["reason"])


@pytest.mark.parametrize("seg", ["[[1, 2, 9223372036854775808]]", "[[1, 2, " + "9" * 19 + "]]",
                                 '{"counts": [1, 18446744073709551616], "size": [2, 2]}',
                                 '{"counts": [1, -2], "size": [2, 2]}',
                                 '{"counts": "0`0Q0", "size": [2]}',
                                 '{"counts": "0`0Q0", "size": [2, 2], "note": 1e400}',
                                 '{"counts": "0`0Q0", "size": [2, 2], "n": 9223372036854775808}',
                                 "[[1, 2, " + "1" * 400 + ".5]]", "[[1, 2, 1e400]]",
                                 "[[1, 2, " + "7" * 5000 + "]]",
                                 "[[1, 2], 3]", "[[[1]], 3]", '[[1, "2"]]', "[[1, true]]",
                                 "[[1, null]]", '"poly"', "7", "null"])
def test_an_unstorable_segmentation_drops_its_object_not_the_image(seg):
    row = Row(1, [obj(7, 1, [0, 0, 5, 5], 25.0, 0, seg),
                  obj(8, 1, [0, 0, 5, 5], 1e39, 0, [[0, 0, 5, 0, 5, 5]])])
    values, reasons = fitted(fit_coco, row, 10, 10)
    assert values["ann_ids"] == [8] and values["area"] == [25.0]  # 1e39 overflows float32
    assert reasons == ["annotation 7: 'segmentation' must be polygons [[x1, y1, ...], ...] of "
                       "finite numbers or an RLE {\"counts\", \"size\"}"]


def polygon_texts(n: int):
    """JSON texts of polygons as files write them: ints, decimals, exponents, negative zero,
    any spacing."""
    rng = random.Random(7)
    numbers = [lambda: str(rng.randint(-10 ** 6, 10 ** 6)), lambda: repr(rng.uniform(-700, 700)),
               lambda: str(round(rng.uniform(0, 640), rng.randint(0, 6))), lambda: "-0",
               lambda: "-0.0", lambda: f"{rng.uniform(-9, 9):.3e}", lambda: "1E2",
               lambda: str(rng.randint(-2 ** 63, 2 ** 63 - 1)), lambda: repr(rng.random() * 1e-300)]
    for _ in range(n):
        polys = [[rng.choice(numbers)() for _ in range(rng.randint(0, 40))]
                 for _ in range(rng.randint(0, 4))]
        space = rng.choice(["", " ", "\n  ", "\t"])
        yield "[" + ("," + space).join("[" + ("," + space).join(p) + "]" for p in polys) + "]"


def test_stored_polygons_are_the_bytes_msgpack_gives_for_the_parsed_json():
    """Records stay byte-for-byte what a msgpack of ``json.loads``'s value gives: ints stay
    ints, floats parse to the same double."""
    stored = 0
    for text in polygon_texts(3000):
        seg, problem = stored_segmentation(msgspec.Raw(text.encode()), 1 << 21, 1 << 21)
        if seg is None:  # a coordinate beyond 2 ** 22 (a random int64): not this image's
            assert "further outside the 2097152x2097152 image" in problem, text
            continue
        assert bytes(seg) == msgpack.packb(json.loads(text), use_bin_type=True), text
        stored += 1
    assert stored > 500


def test_fitted_values_pack_as_the_checked_way_packs_the_plain_data():
    """``fit_coco`` gives stored values itself (``Annotations.stored``: its arrays as bytes,
    its segmentations as msgpack): the record's bytes are what encoding the plain values the
    general way gives."""
    row = Row(1, [obj(7, 3, [0, 0, 5, 5], 25.0, 0, "[[1, 2.5, 3, 4]]"),
                  obj(8, 1, [-1, 2, 50, 5], None, 1, RLE)])
    values, reasons = fit_coco(row, 60, 40)
    assert not reasons and all(type(s) is msgspec.Raw for s in values["segmentation"])
    plain = fitted(fit_coco, row, 60, 40)[0]
    general = encode(list(map(field_of, coco_schema())), plain)
    assert pack_fields(values) == pack_fields(general)
    assert plain["segmentation"] == [[[1, 2.5, 3, 4]], RLE]


def test_coordinates_far_outside_the_image_drop_the_object():
    """A polygon reaching further outside its image than the image's own size was drawn for
    another image (or scale): it cannot be this one's mask."""
    text = "[[" + ", ".join(["999999999999999999"] * 10) + "]]"
    for seg in (text, [[5 * 10 ** 18, 5 * 10 ** 18]], [[1e19, 0.0]], [[0, 0, 41, 5, 3, 3]],
                [[0, 0, 5, 5, -20.5, 3]], [[0, 0, 5, 0, 5, 5]] + [[1, 1, 2, 31, 3]]):
        values, reasons = fitted(fit_coco, Row(1, [obj(7, 1, [0, 0, 5, 5], 1, 0, seg)]), 20, 10)
        assert values["ann_ids"] == [] and reasons == [
            "annotation 7: a polygon reaching further outside the 20x10 image than its longer "
            "side: it cannot belong to this image"]
    for seg in ([[-20, -20, 40, -20, 40, 30, -20.0, 30]], [[0, 0, 5, 0, 5, 5, 1]]):
        values, reasons = fitted(fit_coco, Row(1, [obj(7, 1, [0, 0, 5, 5], 1, 0, seg)]), 20, 10)
        assert not reasons and values["segmentation"] == [seg]


def test_fit_box_clips_as_min_and_max_do():
    """Written out for speed, it must keep what ``max(x, 0.0)``, ``min(x + w, width)`` keep
    in float32 (torchvision's XYWH tensor), -0.0 and sizes beyond float32's integers
    included."""
    def reference(box, width, height):
        x, y, w, h = (float(v) for v in torch.tensor(box, dtype=torch.float32))
        ends = torch.tensor([x, y], dtype=torch.float32) + torch.tensor([w, h])
        x0, y0, x1, y1 = max(x, 0.0), max(y, 0.0), min(ends[0].item(), width), \
            min(ends[1].item(), height)
        return [] if x1 <= x0 or y1 <= y0 or w <= 0 or h <= 0 else [x0, y0, float(x1), float(y1)]
    rng = random.Random(4)
    cases = [([36.58, 2 ** 53, 889, 5.04e53], 906, 2 ** 53 + 1), ([-0.0, -0.0, 5, 5], 5, 5),
             ([0, 0, 5, 5], 5, 5), ([-3, 2, 4, 4], 10, 3), ([1000, 0, 1e-5, 1], 2000, 2)]
    cases += [([rng.uniform(-50, 700) for _ in range(2)] + [rng.uniform(0.1, 300) for _ in range(2)],
               rng.randint(1, 640), rng.randint(1, 480)) for _ in range(5000)]
    for box, width, height in cases:
        box = tuple(map(float, box))
        xyxy, _ = fit_box(box, width, height)
        assert xyxy == reference(box, width, height)
        assert [math.copysign(1, v) for v in xyxy] == [math.copysign(1, v) for v in
                                                     reference(box, width, height)]


def test_an_rle_too_deep_drops_its_object():
    """Checked at the depth it is stored at (inside the image's list): else the record
    would fail ``verify``, or the whole image would be skipped."""
    deep = "a"
    for _ in range(31):
        deep = [deep]
    seg = {"counts": "ab", "size": [1, 1], "x": deep}
    row = Row(1, [obj(7, 1, [0, 0, 5, 5], 1, 0, seg), obj(8, 1, [0, 0, 5, 5], 1, 0, RLE)])
    values, reasons = fitted(fit_coco, row, 60, 40)
    assert values["ann_ids"] == [8] and len(reasons) == 1
    assert not data_problem(values["segmentation"])


# -- files torchvision reads: no categories, several image ids for one file ------------------

@pytest.mark.parametrize("categories", [None, []])
def test_without_categories_every_category_id_is_kept(tmp_path, categories):
    """torchvision's own COCO test files have no 'categories'; CocoDetection reads them,
    its wrapper's labels are the category ids: packer's too, with no class names."""
    data = coco()
    if categories is None:
        del data["categories"]
    else:
        data["categories"] = categories
    data["annotations"].append({"id": 13, "image_id": 2, "category_id": 0, "bbox": [1, 1, 2, 2]})
    src = read(tmp_path, data)
    assert src.classes == [] and src.annotations.extra == {"categories": []}
    assert src.annotations.dropped == []
    assert [o.category_id for o in src.annotations.rows[0].objects] == [90, 3, 0]


def test_image_ids_sharing_a_file_are_a_record_each(tmp_path):
    """As CocoDetection reads them: each id its own sample of the same file, with its own
    objects; ``./two.jpg`` is ``two.jpg``."""
    data = coco()
    data["images"] += [{"id": 8, "file_name": "two.jpg"}, {"id": 1, "file_name": "./two.jpg"}]
    data["annotations"].append({"id": 13, "image_id": 8, "category_id": 1, "bbox": [1, 1, 2, 2]})
    src = read(tmp_path, data)
    assert src.entries == [("two.jpg", -1), ("two.jpg", -1), ("five.png", -1),
                           ("b/seven.jpg", -1), ("two.jpg", -1)]
    rows = src.annotations.rows
    assert [r.image_id for r in rows] == [1, 2, 5, 7, 8]
    assert [[o.id for o in r.objects] for r in rows] == [[], [11, 10], [], [12], [13]]


# -- segmentations that cannot belong to their image ----------------------------------------

@pytest.mark.parametrize("seg, reason", [
    ({"counts": "0`0Q0", "size": [60, 40]},
     "an RLE of size [60, 40] (height, width) cannot belong to the 60x40 image"),
    ({"counts": [0, 2400], "size": [40, 61]},
     "an RLE of size [40, 61] (height, width) cannot belong to the 60x40 image"),
    ({"counts": [0, 2401], "size": [40, 60]},
     "an RLE whose counts are not run lengths within the 60x40 image"),
    ({"counts": "0`0Q0x", "size": [40, 60]},
     "an RLE whose compressed counts do not decode: a character out of range or a count too "
     "long"),
    ({"counts": "0`0Q0P", "size": [40, 60]},  # continued past the end
     "an RLE whose compressed counts do not decode: cut short"),
    ({"counts": "0`0@", "size": [40, 60]},  # a negative count
     "an RLE whose counts are not run lengths within the 60x40 image"),
    ([[0, 0, 1, 0, 1, 1] * 33_334 + [2, 2]],
     "100003 polygon vertices, more than masks are made for (100000)"),
])
def test_a_segmentation_that_cannot_be_the_images_drops_its_object(seg, reason):
    row = Row(1, [obj(7, 1, [0, 0, 5, 5], 25.0, 0, seg), obj(8, 1, [0, 0, 5, 5], 1, 0, RLE)])
    values, reasons = fitted(fit_coco, row, 60, 40)
    assert values["ann_ids"] == [8] and reasons == [f"annotation 7: {reason}"]


def test_an_outline_costing_more_than_its_image_may_drops_its_object():
    """Edges crossing more image columns than masks of the image may cost (the reader's
    budget: pixels / 8 + 2 ** 20) are refused before any mask is made."""
    zigzag = [v for k in range(4000) for v in (0, k % 2 * 30, 2000, k % 2 * 30 + 1)]
    values, reasons = fitted(fit_coco, Row(1, [obj(7, 1, [0, 0, 5, 5], 1, 0, [zigzag])]),
                             2000, 40)
    assert reasons == ["annotation 7: polygon edges crossing 16000000 pixel columns, more than "
                       "masks of a 2000x40 image may cost (1058576)"]
    values, reasons = fitted(fit_coco, Row(1, [obj(7, 1, [0, 0, 5, 5], 1, 0, [zigzag[:1000]])]),
                             2000, 40)
    assert reasons == [] and len(values["segmentation"][0][0]) == 1000


def test_compressed_counts_decode_as_pycocotools_encodes():
    mask_api = pytest.importorskip("pycocotools.mask")
    import numpy as np
    from packer.sources.segmentation import decode_counts
    rng = np.random.default_rng(3)
    for h, w in [(1, 1), (7, 13), (40, 60), (300, 2)]:
        for p in (0.0, 0.02, 0.5, 0.98, 1.0):
            m = np.asfortranarray((rng.random((h, w)) < p).astype(np.uint8))
            rle = mask_api.encode(m)
            counts = decode_counts(rle["counts"].decode())
            flat, value = [], 0
            for c in counts:
                flat += [value] * c
                value ^= 1
            assert sum(counts) == h * w
            assert np.array_equal(np.array(flat, dtype=np.uint8).reshape(w, h).T, m)


def test_box_beyond_float32_on_both_sides_is_dropped_not_stored_as_nan():
    # finite as doubles, -inf and +inf in float32: x1 = -inf + inf is NaN
    assert fit_box((-1e39, 5.0, 1e39, 10.0), 64, 48) == (
        [], "box [-1e+39, 5, 1e+39, 10] holds a non-finite number in float32")


def test_skip_empty_leaves_out_images_whose_every_box_has_no_area(tmp_path):
    """A box of no size (or wholly at negative coordinates) is unusable in any image: the
    JSON alone says so, so --skip-empty leaves its image out, not packs it with no objects."""
    anns = [{"id": 1, "image_id": 2, "category_id": 1, "bbox": [5, 5, 0, 8]},
            {"id": 2, "image_id": 2, "category_id": 1, "bbox": [5, 5, 8, -1]},
            {"id": 3, "image_id": 5, "category_id": 1, "bbox": [-20, 5, 10, 8]},
            {"id": 4, "image_id": 7, "category_id": 1, "bbox": [5, 5, 1e-50, 8]},
            {"id": 5, "image_id": 7, "category_id": 3, "bbox": [5, 5, 0.5, 8]}]
    src = read(tmp_path, coco(annotations=anns), skip_empty=True)
    assert src.entries == [("b/seven.jpg", -1)]
    assert src.annotations.extra["skipped_empty"] == 2
    values, reasons = fitted(src.annotations.fit, src.annotations.rows[0], 60, 40)
    assert values["ann_ids"] == [5] and reasons == [
        "annotation 4: zero or negative size box [5, 5, 1e-50, 8]"]


def test_iscrowd_as_json_true_or_false_reads_as_1_or_0(tmp_path):
    """coco-annotator writes ``"iscrowd": false`` (a boolean field); pycocotools and
    torchvision read such files, so packer stores them as 0 and 1, not refuses them."""
    anns = [dict(a, iscrowd=bool(a["iscrowd"])) for a in coco()["annotations"][::2]]
    src = read(tmp_path, coco(annotations=anns))
    values, reasons = fitted(src.annotations.fit, src.annotations.rows[0], 60, 40)
    assert reasons == [] and values["iscrowd"] == [0, 1] and values["ann_ids"] == [11, 10]
