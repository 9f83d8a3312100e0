"""A large COCO file read in pieces by forked processes: the same result as the serial read,
every unusual file read the serial way, and errors that name the same problem."""
from __future__ import annotations

import json
import random

import pytest

from packer.writing.builder import build, load_source
from packer.reading.dataset import PackedDataset
from packer.errors import PackerError
from packer.sources import cocopieces
from packer.format.fields import encode
from packer.format.records import pack_fields
from packer.sources.coco import coco_schema, fit_coco, read_coco
from packer.sources.jsonchunks import array_pieces, parse_around, parse_piece
from packer.sources.lazyjson import Deferred, loads_deferring

WORKERS = 4  # up to 3 pieces, PIECE_CHARS of text each at least: 2 with big_coco's


def big_coco(images: int = 60, objects: int = 0, seed: int = 0, note: str = "") -> dict:
    """A valid instances dict of about 2.5 x PIECE_CHARS of text (unless ``objects`` per
    image is given): polygons of 60 points, some RLE and crowd objects, an image without
    objects, category ids out of order."""
    rng = random.Random(seed)
    objects = objects or -(-5 * cocopieces.PIECE_CHARS // (2 * 560 * (images - 1)))
    anns = []
    for i in range(images - 1):  # the last image has no object
        for _ in range(objects):
            x, y = rng.uniform(0, 300), rng.uniform(0, 200)
            ann = {"id": len(anns) * 3 + 1, "image_id": 1000 + 7 * i,
                   "category_id": rng.choice([5, 1, 9]),
                   "bbox": [round(x, 2), round(y, 2), rng.randint(5, 90), rng.randint(5, 90)],
                   "area": rng.uniform(10, 900), "iscrowd": 0,
                   "segmentation": [[round(rng.uniform(0, 400), 2) for _ in range(60)]]}
            if rng.random() < 0.05:
                ann["iscrowd"], ann["segmentation"] = 1, {"counts": "0`0Q0", "size": [400, 300]}
            if note:
                ann["note"] = note
            anns.append(ann)
    rng.shuffle(anns)  # objects of one image spread over every piece
    return {"info": {"description": "made by a test"},
            "images": [{"id": 1000 + 7 * i, "file_name": f"{i:04d}.jpg", "width": 400,
                        "height": 300} for i in range(images)],
            "annotations": anns,
            "categories": [{"id": 9, "name": "nine"}, {"id": 1, "name": "one"},
                           {"id": 5, "name": "five", "supercategory": "s"}]}


def write(tmp_path, data):
    (tmp_path / "img").mkdir(exist_ok=True)
    path = tmp_path / "instances.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return tmp_path / "img", path


def assert_same_read(tmp_path, data, pieces_expected: bool, **kw):
    """Serial and pieces reads agree on everything a build uses; the pieces path ran iff
    ``pieces_expected`` (its rows hold packed objects)."""
    images, path = write(tmp_path, data)
    serial = read_coco(images, path, **kw)
    parallel = read_coco(images, path, workers=WORKERS, **kw)
    assert ("packed" in parallel.annotations.rows[0]) == pieces_expected
    assert "packed" not in serial.annotations.rows[0]
    assert parallel.entries == serial.entries and parallel.classes == serial.classes
    a, b = serial.annotations, parallel.annotations
    assert (b.extra, b.dropped, b.digest, b.schema) == (a.extra, a.dropped, a.digest, a.schema)
    for ra, rb in zip(a.rows, b.rows, strict=True):
        assert stored(rb, 400, 300) == stored(ra, 400, 300)
        assert stored(rb, 50, 40) == stored(ra, 50, 40)  # with drops
    return parallel


def stored(row, width: int, height: int):
    """A row's fields as a record stores them, and the drop reasons: a polygon may come
    out parsed in one read and as stored bytes in the other."""
    values, reasons = fit_coco(row, width, height)
    return pack_fields(encode(coco_schema(), values)), reasons


def test_a_large_file_read_in_pieces_equals_the_serial_read(tmp_path):
    data = big_coco()
    assert len(json.dumps(data)) > 2 * cocopieces.PIECE_CHARS
    assert_same_read(tmp_path, data, True)
    assert_same_read(tmp_path, data, True, skip_empty=True)


def test_pieces_cut_only_between_items_even_where_strings_hold_the_gap(tmp_path):
    # Every annotation holds "}, {" inside a string, where cuts land: such a piece does not
    # parse, and the file is read the serial way, with the same result.
    data = big_coco(note='a}, {"b": 1}, {c')
    text = json.dumps(data)
    refused = []
    for piece in array_pieces(text, "annotations", 3, cocopieces.LAST_SHARE)[:-1]:
        with pytest.raises(ValueError):
            parse_piece(text, piece)
        refused.append(piece)
    assert refused
    assert_same_read(tmp_path, data, False)


def test_a_piece_cut_inside_a_string_or_a_nested_list_does_not_parse():
    text = json.dumps({"annotations": [{"s": "x}, {y"}, {"t": [{"a": 1}, {"b": 2}]},
                                       {"u": 3}]})
    start = text.index("[") + 1
    in_string = text.index("}, {y")
    in_list = text.index('}, {"b"')
    for cut in (in_string, in_list):
        with pytest.raises(ValueError):
            parse_piece(text, (start, cut + 1))
    good = text.index('}, {"t"')
    first, end = parse_piece(text, (start, good + 1))
    assert first == [{"s": "x}, {y"}] and end == good + 1
    rest, end = parse_piece(text, (good + 3, None))
    assert rest == [{"t": [{"a": 1}, {"b": 2}]}, {"u": 3}]
    assert parse_around(text, [(start, good + 1), (good + 3, None)], end, "annotations") == \
        {"annotations": "\0"}


def test_the_last_piece_finds_the_list_end_without_parsing_its_polygons():
    """Its end is where an object first ends a list, if the piece parses up to there; so
    its polygons stay text for the workers, as every other piece's do. A "}]" met earlier
    (in a string, or a list of objects inside an item) sends it the slow way, as before."""
    defer = lambda s: loads_deferring(s, "segmentation", None)  # noqa: E731
    for odd in (None, "string", "nested"):
        anns = [{"id": k, "segmentation": [[1.5, 2, 3, 4]]} for k in range(3)]
        if odd == "string":
            anns[1]["note"] = "}]"
        if odd == "nested":
            anns[1]["parts"] = [{"a": 1}]
        text = json.dumps({"annotations": anns, "categories": [{"id": 1}]})
        items, end = parse_piece(text, (text.index("[") + 1, None), defer)
        assert items == [dict(a, segmentation=items[k]["segmentation"])
                         for k, a in enumerate(anns)]
        assert text[end - 1] == "]" and text[end:].startswith(', "categories"')
        assert (type(items[0]["segmentation"]) is Deferred) == (odd is None)


def test_a_nul_string_inside_the_annotations_keeps_the_pieces(tmp_path):
    """Each piece checks its own text for a NUL escape (and parses whole if it has one); only
    the text around the list must have none, as that is where the placeholder goes."""
    assert_same_read(tmp_path, big_coco(note="\u0000"), True)


def test_a_second_annotations_key_holding_a_nul_string_is_not_taken_for_the_pieces(tmp_path):
    text = json.dumps(big_coco())[:-1] + ', "annotations": "\\u0000"}'
    images, path = write(tmp_path, text)
    with pytest.raises(PackerError, match="'annotations' must be a list") as serial:
        read_coco(images, path)
    with pytest.raises(PackerError) as parallel:
        read_coco(images, path, workers=WORKERS)
    assert str(parallel.value) == str(serial.value)


def test_broken_polygon_text_of_a_dropped_image_stops_the_pieces_read_too(tmp_path):
    data = big_coco()
    data["images"][0]["file_name"] = "../outside.jpg"  # dropped, with its objects
    victim = next(a for a in data["annotations"] if a["image_id"] == data["images"][0]["id"]
                  and isinstance(a["segmentation"], list))
    text = json.dumps(data)
    polygon = json.dumps(victim["segmentation"])
    assert text.count(polygon) == 1
    images, path = write(tmp_path, text.replace(polygon, "[[1 2]]"))
    message = f"annotation {victim['id']}'s 'segmentation' is not valid JSON"
    for workers in (1, WORKERS):
        with pytest.raises(PackerError, match=message):
            read_coco(images, path, workers=workers)


def test_annotations_before_images_and_a_bom_read_the_same(tmp_path):
    data = big_coco()
    reordered = {k: data[k] for k in ("annotations", "categories", "images", "info")}
    assert_same_read(tmp_path, "\ufeff" + json.dumps(reordered), True)


@pytest.mark.parametrize("change, message", [
    ("duplicate id", "appears twice"),
    ("missing bbox", "has no 'bbox'"),
    ("not json", "not valid JSON"),
])
def test_a_bad_file_read_in_pieces_fails_as_the_serial_read_does(tmp_path, change, message):
    data = big_coco()
    anns = data["annotations"]
    if change == "duplicate id":
        anns[-1]["id"] = anns[0]["id"]  # the two in different pieces
    elif change == "missing bbox":
        del anns[len(anns) * 2 // 3]["bbox"]
    text = json.dumps(data)
    if change == "not json":
        cut = text.index('"segmentation"', len(text) // 2)
        text = text[:cut] + text[cut:].replace("]]", "]", 1)  # one polygon left open
    images, path = write(tmp_path, text)
    with pytest.raises(PackerError, match=message) as serial:
        read_coco(images, path)
    with pytest.raises(PackerError, match=message) as parallel:
        read_coco(images, path, workers=WORKERS)
    assert str(parallel.value) == str(serial.value)


def test_unknown_ids_in_pieces_are_dropped_as_the_serial_read_drops_them(tmp_path):
    data = big_coco()
    data["images"][2]["file_name"] = "../outside.jpg"  # dropped, and its objects with it
    parallel = assert_same_read(tmp_path, data, True)
    assert [d["reason"] for d in parallel.annotations.dropped] == [
        "image id 1014: file_name contains '..'; it must stay inside the image folder"]
    data["annotations"][5]["category_id"] = 4  # no such category
    data["annotations"][-5]["image_id"] = 3  # no such image
    parallel = assert_same_read(tmp_path, data, False)  # the serial read lists them
    reasons = " ".join(d["reason"] for d in parallel.annotations.dropped)
    assert "category id 4 is not" in reasons and "image id 3 is not" in reasons


def test_a_build_from_pieces_stores_the_serial_builds_records(tmp_path):
    from packer.demo.scenes import make_detection_folder
    scenes = make_detection_folder(tmp_path / "scenes", 6, workers=1)
    data = big_coco(images=6)
    data["images"] = [dict(im, file_name=f"{i:06d}.jpg") for i, im in enumerate(data["images"])]
    for obj in data["annotations"][::50]:
        obj["bbox"][0] = 5000  # outside every scene: dropped with its reason
    ann = tmp_path / "big.json"
    ann.write_text(json.dumps(data))
    assert "packed" in load_source(scenes / "images", coco=ann, workers=WORKERS).annotations.rows[0]
    serial = build(scenes / "images", tmp_path / "serial", coco=ann, workers=1, progress=False)
    parallel = build(scenes / "images", tmp_path / "parallel", coco=ann, workers=WORKERS,
                     progress=False)
    assert parallel.manifest["dropped"] == serial.manifest["dropped"]
    assert len(serial.manifest["dropped"]) > 10
    a, b = PackedDataset(tmp_path / "serial"), PackedDataset(tmp_path / "parallel")
    assert len(a) == len(b) == 6
    for i in range(6):
        assert b.load(i) == a.load(i)
