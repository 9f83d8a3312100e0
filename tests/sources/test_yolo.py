"""YOLO label folders: which label file each image gets, names files (text and YAML), the
fitted boxes, and what happens to every bad line or file."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from packer.errors import PackerError
from packer.sources.yolo import fit_ultralytics, fit_yolo, read_names, read_yolo


def put(root: Path, files: dict) -> Path:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return root


def dataset(tmp_path, labels: dict, images=("a.jpg",), names="cat\ndog\n\nbird\n",
            rules="ultralytics"):
    put(tmp_path / "images", {i: b"x" for i in images})
    put(tmp_path / "labels", labels)
    (tmp_path / "labels").mkdir(exist_ok=True)
    (tmp_path / "names.txt").write_text(names, encoding="utf-8")
    return read_yolo(tmp_path / "images", tmp_path / "labels", tmp_path / "names.txt", rules)


def test_layout_rows_and_fit(tmp_path):
    src = dataset(tmp_path, {
        "a.txt": "0 0.5 0.5 0.5 0.25\n2 0.25 0.75 0.5 0.5\n",
        "b.txt": "1 0.1 0.2 0.5 0.2 0.3 0.6\n",  # a triangle: stored as its bounding box
        "sub/c.txt": "2 0.5 0.5 1 1\n"},
        images=["a.jpg", "b.png", "sub/c.JPG", "d.jpg", "notes.txt", "sub/x.gif"])
    assert src.classes == ["cat", "dog", "bird"]
    assert src.entries == [("a.jpg", -1), ("b.png", -1), ("d.jpg", -1), ("sub/c.JPG", -1)]
    ann = src.annotations
    assert ann.task == "detection" and ann.dropped == []
    assert [f["name"] for f in ann.schema] == ["image_id", "boxes", "labels", "area", "iscrowd"]
    assert ann.extra == {"categories": [{"id": 0, "name": "cat"}, {"id": 1, "name": "dog"},
                                        {"id": 2, "name": "bird"}]}
    assert ann.rows[2] == {"image_id": 2, "boxes": [], "labels": []}  # background image
    values, reasons = ann.fit(ann.rows[0], 200, 100)
    assert reasons == []
    assert values == {"image_id": 0, "boxes": [[50.0, 37.5, 150.0, 62.5], [0.0, 50.0, 100.0,
                                                                           100.0]],
                      "labels": [0, 2], "area": [2500.0, 5000.0], "iscrowd": [0, 0]}
    values, _ = ann.fit(ann.rows[1], 10, 10)
    assert values["boxes"] == [pytest.approx([1.0, 2.0, 5.0, 6.0])]
    assert values["labels"] == [1]
    assert ann.fit(ann.rows[2], 10, 10)[0] == {"image_id": 2, "boxes": [], "labels": [],
                                               "area": [], "iscrowd": []}
    assert pickle.loads(pickle.dumps(ann.fit)) is fit_ultralytics
    assert ann.upright  # the build passes each image's EXIF orientation to fit


def test_fit_clips_edges_to_the_image():
    row = {"image_id": 3, "boxes": [[0.9, 0.1, 0.4, 0.4]], "labels": [1]}
    values, reasons = fit_yolo(row, 100, 100)
    assert values["boxes"] == [pytest.approx([70.0, 0.0, 100.0, 30.0])]
    assert values["area"] == [pytest.approx(900.0)] and reasons == []


def test_flat_labels_by_stem_when_the_mirrored_one_is_missing(tmp_path):
    src = dataset(tmp_path, {"x.txt": "1 0.5 0.5 0.2 0.2\n", "sub/y.txt": "0 0.5 0.5 0.2 0.2\n",
                             "y.txt": "2 0.5 0.5 0.2 0.2\n"},
                  images=["sub/x.jpg", "sub/y.jpg"])
    assert [r["labels"] for r in src.annotations.rows] == [[1], [0]]  # mirrored one wins
    assert src.annotations.dropped == [{"path": "labels/y.txt",
                                        "reason": "no image for this label file"}]


def test_flat_label_shared_by_two_folders_is_ambiguous(tmp_path):
    src = dataset(tmp_path, {"x.txt": "1 0.5 0.5 0.2 0.2\n"},
                  images=["a/x.jpg", "b/x.jpg", "c.jpg"])
    assert src.entries == [("c.jpg", -1), ("a/x.jpg", -1), ("b/x.jpg", -1)]  # walk order
    rows = src.annotations.rows
    assert "label file x.txt could belong to any of 2 images" in rows[1]["reject"]
    assert rows[2]["reject"] == rows[1]["reject"] and "reject" not in rows[0]
    with pytest.raises(ValueError, match="could belong to any of 2 images"):
        fit_yolo(rows[1], 100, 100)  # the build skips the image, listing the reason



def test_a_top_level_images_own_label_is_not_also_a_flat_label_of_a_nested_one(tmp_path):
    src = dataset(tmp_path, {"x.txt": "1 0.5 0.5 0.2 0.2\n"}, images=["x.jpg", "sub/x.jpg"])
    assert src.entries == [("x.jpg", -1), ("sub/x.jpg", -1)]
    rows = src.annotations.rows
    assert rows[0]["labels"] == [1]  # its own, same-path label
    assert "label file x.txt could belong to any of 2 images" in rows[1]["reject"]

# A label line and what ultralytics' verify_image_label (ultralytics/data/utils.py) makes of
# it: the class and (cx, cy, w, h) kept, or None: the whole image is left out. Its rules:
# float32 values; coordinates (a polygon's: its box's) within [-0.01, 1.01]; class in range;
# 5 values per box row, or polygon rows ('class x y x y ...', more than 6 values, even
# coordinate count) only; exact duplicate rows removed; zero-size boxes kept.
ULTRALYTICS_LINES = [
    ("0 0.5 0.5 0.2 0.2", (0, 0.5, 0.5, 0.2, 0.2)),
    ("1 1.01 -0.01 0.2 0.2", (1, 1.01, -0.01, 0.2, 0.2)),  # 1 % out: kept (clipped later)
    ("1 1.0101 0.5 0.2 0.2", None),
    ("1 0.5 0.5 -0.0101 0.2", None),
    ("1 0.5 0.5 0 0.2", (1, 0.5, 0.5, 0.0, 0.2)),  # zero width: kept
    ("2.0 0.5 0.5 0.2 0.2", (2, 0.5, 0.5, 0.2, 0.2)),
    ("3 0.5 0.5 0.2 0.2", None),  # 3 classes
    ("-1 0.5 0.5 0.2 0.2", None),
    ("1 0.5 nan 0.2 0.2", None),
    ("1 0.5 inf 0.2 0.2", None),
    ("1 0.5 0.5 0.2", None),
    ("1 0.5 0.5 0.2 0.2 0.9", None),  # 6 values: labels require 5 columns
    ("cat 0.5 0.5 0.2 0.2", None),
    ("1 0.1 0.2 0.5 0.2 0.3 0.6", (1, 0.3, 0.4, 0.4, 0.4)),  # a triangle: its box
    ("1 0.1 0.2 0.5 0.2 0.3 0.6 0.7", None),  # an odd coordinate count
    ("1 -0.02 0.2 0.5 0.2 0.3 0.6", (1, 0.24, 0.4, 0.52, 0.4)),  # only the box is checked
]


@pytest.mark.parametrize("line, want", ULTRALYTICS_LINES)
def test_ultralytics_line_rules(tmp_path, line, want):
    src = dataset(tmp_path, {"a.txt": line + "\n"})
    row = src.annotations.rows[0]
    if want is None:
        assert row["reject"].startswith("labels/a.txt:1: ")
        assert row["reject"].endswith("the image is left out, as ultralytics does (rules='lines' "
                                      "drops the line alone)")
        return
    assert row["labels"] == [want[0]]
    assert row["boxes"] == [pytest.approx(list(want[1:]), abs=1e-7)]
    assert src.annotations.dropped == []


def test_one_invalid_line_leaves_the_image_out_by_ultralytics_rules(tmp_path):
    src = dataset(tmp_path, {"a.txt": "0 0.5 0.5 0.2 0.2\n7 0.5 0.5 0.2 0.2\n",
                             "b.txt": "0 0.5 0.5 0.2 0.2\n"}, images=["a.jpg", "b.jpg"])
    assert src.entries == [("a.jpg", -1), ("b.jpg", -1)]  # a.jpg: skipped by the build
    assert src.annotations.rows[0] == {"image_id": 0, "reject": (
        "labels/a.txt:2: class 7 is out of range: NAMES has 3 classes (0..2); the image is "
        "left out, as ultralytics does (rules='lines' drops the line alone)")}
    assert src.annotations.rows[1]["labels"] == [0]


def test_box_rows_among_polygon_rows(tmp_path):
    """ultralytics reads every row of a file with a polygon as a polygon: a box row's four
    numbers become two points, never what was meant. By its rules the image is left out;
    by lines, each row is what it says."""
    text = "0 0.5 0.5 0.2 0.2\n1 0.1 0.2 0.5 0.2 0.3 0.6\n"
    src = dataset(tmp_path, {"a.txt": text})
    assert src.annotations.rows[0]["reject"].startswith(
        "labels/a.txt:1: a box row in a file of polygon rows (line 2)")
    src = dataset(tmp_path, {"a.txt": text}, rules="lines")
    assert src.annotations.rows[0]["labels"] == [0, 1]


def test_duplicate_rows_are_dropped_and_listed(tmp_path):
    text = ("0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n0 0.50000001 0.5 0.2 0.2\n"
            "1 0.5 0.5 0.2 0.2\n")  # 0.50000001 is 0.5 in float32: a duplicate there too
    src = dataset(tmp_path, {"a.txt": text})
    assert src.annotations.rows[0]["labels"] == [0, 1]
    assert src.annotations.dropped == [
        {"path": "a.jpg", "reason": "labels/a.txt:2: duplicate of line 1"},
        {"path": "a.jpg", "reason": "labels/a.txt:3: duplicate of line 1"}]


@pytest.mark.parametrize("rules", ["ultralytics", "lines"])
def test_rows_are_sorted_as_ultralytics_sorts_them_when_it_removes_a_duplicate(tmp_path, rules):
    """ultralytics removes duplicates with ``np.unique(lb, axis=0)``, which also sorts the
    rows (class, then cx, cy, w, h); a file without duplicates keeps its order."""
    a, b, c = "1 0.5 0.5 0.2 0.2", "0 0.7 0.3 0.1 0.1", "0 0.2 0.9 0.1 0.1"
    src = dataset(tmp_path, {"a.txt": f"{a}\n{b}\n{a}\n{c}\n", "b.txt": f"{a}\n{b}\n{c}\n"},
                  images=["a.jpg", "b.jpg"], rules=rules)
    deduped, kept = src.annotations.rows
    assert deduped["labels"] == [0, 0, 1]
    assert [[round(v, 6) for v in box] for box in deduped["boxes"]] == [
        [0.2, 0.9, 0.1, 0.1], [0.7, 0.3, 0.1, 0.1], [0.5, 0.5, 0.2, 0.2]]
    assert kept["labels"] == [1, 0, 0]
    assert [d["reason"] for d in src.annotations.dropped] == [
        "labels/a.txt:3: duplicate of line 1"]


def test_images_under_10_pixels_are_left_out_by_ultralytics_rules():
    row = {"image_id": 0, "boxes": [[0.5, 0.5, 0.2, 0.2]], "labels": [1]}
    assert fit_ultralytics(row, 10, 10)[0]["boxes"] == [[4.0, 4.0, 6.0, 6.0]]
    for size in [(9, 400), (400, 9)]:
        with pytest.raises(ValueError, match=r"the image is \d+x\d+ pixels: ultralytics leaves "
                                             r"out images under 10 pixels on a side"):
            fit_ultralytics(row, *size)
        assert fit_yolo(row, *size)[0]["labels"] == [1]  # rules="lines" keeps them


def test_rules_must_be_one_of_two(tmp_path):
    from packer.sources import Yolo
    with pytest.raises(PackerError, match=r"rules must be 'ultralytics' or 'lines', not 'strict'"):
        Yolo(tmp_path, tmp_path, tmp_path / "n.txt", rules="strict")
    assert Yolo(tmp_path, tmp_path, tmp_path / "n.txt").options()["yolo_rules"] == "ultralytics"


def test_bad_lines_drop_objects_with_file_and_line_by_lines_rules(tmp_path):
    lines = ["0 0.5 0.5 0.2 0.2",      # 1: kept
             "1 0.5 0.5",              # 2
             "1 0.5 0.5 0.2 0.2 0.9",  # 3: a prediction with a confidence
             "3 0.5 0.5 0.2 0.2",      # 4: out of range
             "1.5 0.5 0.5 0.2 0.2",    # 5
             "cat 0.5 0.5 0.2 0.2",    # 6
             "1 1.2 0.5 0.2 0.2",      # 7: outside [0, 1]
             "1 0.5 0.5 0 0.2",        # 8: zero width: kept, as ultralytics keeps it
             "1 0.5 nan 0.2 0.2",      # 9
             "1 0.5 0.5 x 0.2",        # 10
             "0 0.5 0.5 0.2 0.2",      # 11: duplicate of 1
             "",                       # 12: blank, ignored
             "2.0 1.005 -0.005 0.2 0.2",    # 13: within 1 %: kept; class 2.0 is 2
             "1 0.1 0.1 0.2 0.2 0.3 0.3 0.4"]  # 14: 8 values
    src = dataset(tmp_path, {"a.txt": "\n".join(lines) + "\n"}, rules="lines")
    row = src.annotations.rows[0]
    assert row["labels"] == [0, 1, 2]
    assert row["boxes"][2] == pytest.approx([1.005, -0.005, 0.2, 0.2])
    assert fit_yolo(row, 100, 100)[0]["boxes"][2] == pytest.approx([90.5, 0.0, 100.0, 9.5])
    reasons = [d["reason"] for d in src.annotations.dropped]
    assert {d["path"] for d in src.annotations.dropped} == {"a.jpg"}
    assert reasons == [
        "labels/a.txt:2: 3 values; expected 5 ('class cx cy w h') or a polygon "
        "'class x1 y1 x2 y2 x3 y3 ...'",
        "labels/a.txt:3: 6 values: a box and one more (a confidence? predictions are not "
        "labels); expected 'class cx cy w h'",
        "labels/a.txt:4: class 3 is out of range: NAMES has 3 classes (0..2)",
        "labels/a.txt:5: class '1.5' is not an integer",
        "labels/a.txt:6: 'cat' is not a number",
        "labels/a.txt:7: box (cx cy w h) 1.2 0.5 0.2 0.2 is more than 1 % outside [0, 1]; "
        "YOLO labels are fractions of the image size",
        "labels/a.txt:9: nan is not a finite number",
        "labels/a.txt:10: 'x' is not a number",
        "labels/a.txt:11: duplicate of line 1",
        "labels/a.txt:14: 8 values; expected 5 ('class cx cy w h') or a polygon "
        "'class x1 y1 x2 y2 x3 y3 ...'"]


@pytest.mark.parametrize("rules", ["ultralytics", "lines"])
def test_label_file_not_utf8_keeps_the_image_out(tmp_path, rules):
    src = dataset(tmp_path, {"a.txt": b"0 0.5 0.5 0.2 0.2 \xff\n", "b.txt": "1 0.5 0.5 1 1\n"},
                  images=["a.jpg", "b.jpg"], rules=rules)
    assert src.entries == [("a.jpg", -1), ("b.jpg", -1)]
    reject, kept = src.annotations.rows
    assert kept == {"image_id": 1, "boxes": [[0.5, 0.5, 1.0, 1.0]], "labels": [1]}
    assert reject["reject"].startswith("labels/a.txt is not UTF-8 text")
    assert "the image is not packed" in reject["reject"]
    assert src.annotations.dropped == []


def test_label_without_image_and_names_file_beside_labels(tmp_path):
    put(tmp_path / "images", {"a.jpg": b"x"})
    put(tmp_path / "labels", {"a.txt": "", "z.txt": "0 0.5 0.5 0.1 0.1\n",
                              "classes.txt": "cat\n"})
    src = read_yolo(tmp_path / "images", tmp_path / "labels", tmp_path / "labels/classes.txt")
    assert src.annotations.dropped == [{"path": "labels/z.txt",
                                        "reason": "no image for this label file"}]


def test_image_name_not_utf8_is_left_to_the_build(tmp_path):
    bad = os.fsdecode(b"caf\xe9.jpg")
    try:
        (tmp_path / "images").mkdir()
        (tmp_path / "images" / bad).write_bytes(b"x")
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses non-UTF-8 names")
    src = dataset(tmp_path, {}, images=["ok.jpg"])
    assert src.entries == [(bad, -1), ("ok.jpg", -1)]  # the build skips it, saying why
    assert src.annotations.dropped == []


def test_missing_folders_and_no_images(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "names.txt").write_text("cat\n")
    with pytest.raises(PackerError, match=r"Yolo\(images, labels, names\): labels .* does not "
                                          r"exist or is not a folder"):
        read_yolo(tmp_path / "images", tmp_path / "labels", tmp_path / "names.txt")
    (tmp_path / "labels").mkdir()
    with pytest.raises(PackerError, match="no images"):
        read_yolo(tmp_path / "images", tmp_path / "labels", tmp_path / "names.txt")
    with pytest.raises(PackerError, match=r"Yolo\(images, labels, names\): names .* does not "
                                          r"exist"):
        read_yolo(tmp_path / "images", tmp_path / "labels", tmp_path / "nope.txt")


def names(tmp_path, text, suffix=".yaml"):
    path = tmp_path / f"data{suffix}"
    path.write_text(text, encoding="utf-8")
    return read_names(path)


ULTRALYTICS = """\
# COCO 2017 dataset https://cocodataset.org by Microsoft
path: ../datasets/coco # dataset root dir
train: train2017.txt  # train images
val: val2017.txt

# Classes
names:
  0: person
  2: "car # not a comment"
  1: 'it''s a bike'

# Download script/URL (optional)
download: |
  from ultralytics.utils.downloads import download
  segments = True  # segment or box labels
  urls = ['http://images.cocodataset.org/zips/train2017.zip',  # 19G, 118k images
          'http://images.cocodataset.org/zips/val2017.zip']
  - not: [a list, {x: 1}]
nc: 3
"""


@pytest.mark.parametrize("text, want", [
    ("cat\n\n  dog  \nhot dog\n", ["cat", "dog", "hot dog"]),
])
def test_text_names(tmp_path, text, want):
    assert names(tmp_path, text, ".txt") == want


@pytest.mark.parametrize("text", [
    "- cat\n- dog   # a comment\n- 'hot dog'\n",
    "---\n[cat, dog, \"hot dog\",]\n",
    "names: [cat, dog, hot dog]\nnc: 3\n",
    "names:\n  - cat\n  - dog\n  - \"hot dog\"\ntrain: x\n",
    "names:\n- cat\n- dog\n- hot dog\n",
    "names: {0: cat, 1: dog, 2: hot dog}\n",
    "names:\n  1: dog\n  0: cat\n  '2': hot dog\n",
    "names: [cat,\n  dog, hot dog]\n",
])
def test_yaml_names_shapes(tmp_path, text):
    assert names(tmp_path, text) == ["cat", "dog", "hot dog"]


def test_ultralytics_dataset_yaml(tmp_path):
    assert names(tmp_path, ULTRALYTICS) == ["person", "it's a bike", "car # not a comment"]


@pytest.mark.parametrize("text, message", [
    ("names: person\n", r"data\.yaml: 'names' must be a list or an \{index: name\} map, got "
                       r"'person'"),
    ("names:\n  - [a, b]\n", r"data\.yaml: class 0 is a list, not a name"),
    ("names:\n  - a\n  b: c\n", r"data\.yaml:3: not valid YAML \(expected <block end>"),
    ("names:\n  0: a\n  2: b\n", "class indices must be 0..1 with none missing; 1 is missing"),
    ("names:\n  0: a\n  0: b\n", r"data\.yaml:3: not valid YAML \(key 0 is given twice\)"),
    ("names:\n  x: a\n", "class index 'x' is not a number"),
    ("names:\n  '\u00b2': a\n", "class index '\u00b2' is not a number"),  # isdigit, not int
    ("names:\n  '\u0663': a\n", "class index '\u0663' is not a number"),
    ("names: [a, b]\nnc: 3\n", "nc is 3 but 'names' lists 2 classes"),
    ("train: x\nval: y\n", "has no top-level 'names:'"),
    ("names:\n", r"data\.yaml: 'names:' is empty"),
    ("# only a comment\n", "is empty"),
    ("- a\n- b: c\n", r"class 1 is a map, not a name"),
    ("names: [a, [b]]\n", r"class 1 is a list, not a name"),
    ("names: [a, null]\n", r"class 1 is empty, not a name"),
    ("just text\n", r"data\.yaml: expected a list of names or 'names:', got 'just text'"),
    ("names: [a, b, a]\n", "classes 0 and 2 are both named 'a'"),
    ("names:\n\t- a\n", r"data\.yaml:2: not valid YAML \(found character '\\t' that cannot "
                        r"start any token\)"),
    ("names: []\n", "names no classes"),
    ("names: [a\n", r"data\.yaml:2: not valid YAML"),
    ("names:\n  ? [a, b]\n  : person\n", r"data\.yaml:2: not valid YAML \(found an unhashable key"),
    ("{[0]: person}\n", r"data\.yaml:1: not valid YAML \(found an unhashable key"),
])
def test_yaml_shapes_packer_does_not_read(tmp_path, text, message):
    with pytest.raises(PackerError, match=message) as e:
        names(tmp_path, text)
    assert "data.yaml" in str(e.value)


def test_yaml_scalars_are_names_as_ultralytics_reads_them(tmp_path):
    """``yaml.safe_load`` makes ``yes`` a bool and ``007`` an int; ultralytics then names
    classes ``str(value)``: so does packer, so the classes agree with a model's."""
    assert names(tmp_path, "names: [yes, 007, 2.5, dog]\n") == ["True", "7", "2.5", "dog"]


def test_a_names_file_too_large_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "data.yaml"
    path.write_bytes(b"names: [a]\n" + b"#" * (4 << 20))
    with pytest.raises(PackerError, match=r"names .*data\.yaml holds 4,194,315 bytes, more "
                                          r"than a names file needs"):
        read_names(path)


def test_duplicate_and_empty_text_names(tmp_path):
    with pytest.raises(PackerError, match="classes 0 and 2 are both named 'cat'"):
        names(tmp_path, "cat\ndog\ncat\n", ".txt")
    with pytest.raises(PackerError, match="names no classes"):
        names(tmp_path, "\n \n", ".txt")
