"""A COCO build's workers start on the images while the annotations are read
(``cocooutline``, ``laterows``): the same dataset as reading first, every unusual layout
read the serial way, and a broken file stopping the build with nothing left behind."""
from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from packer.writing.builder import build
from packer.demo.scenes import make_detection_folder
from packer.errors import PackerError
from packer.writing.laterows import ROWS_NAME, LateRows, write_rows
from packer.writing.worker import FieldMaker, ShardJob, ShardTask, write_shards
from packer.sources.coco import read_coco
from packer.sources.cocooutline import coco_outline, top_level_lists


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    return make_detection_folder(tmp_path_factory.mktemp("scenes"), images=24, seed=5)


def shards_of(dst: Path) -> list:
    m = json.loads((dst / "manifest.json").read_text())
    return [(s["path"], s["sha256"]) for s in m["shards"]], m.get("dropped", []), m["classes"], m["count"]


def built(images: Path, dst: Path, ann: Path, workers: int) -> tuple:
    build(images, dst, coco=ann, workers=workers, progress=False, shard_size=1 << 20)
    return shards_of(dst)


def test_outline_lists_what_the_full_read_lists(scenes):
    out = coco_outline(scenes / "images", scenes / "annotations.json", 4)
    full = read_coco(scenes / "images", scenes / "annotations.json")
    assert out is not None and out.source.annotations.rows is None
    assert out.source.entries == full.entries and out.source.classes == full.classes
    assert out.source.annotations.extra == full.annotations.extra
    assert out.source.annotations.digest == full.annotations.digest


def test_the_file_is_hashed_once(scenes, monkeypatch):
    """The outline hashes it; the full read (here in this process: no pieces) reuses that."""
    hashed = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda data=b"": hashed.append(len(data)) or real(data))
    out = coco_outline(scenes / "images", scenes / "annotations.json", 2)
    full = out.finish(out.start(None))
    size = (scenes / "annotations.json").stat().st_size
    assert hashed == [size] and full.annotations.digest == real(
        (scenes / "annotations.json").read_bytes()).hexdigest()


def test_a_build_that_reads_while_the_workers_run_equals_one_that_reads_first(scenes, tmp_path):
    a = built(scenes / "images", tmp_path / "one", scenes / "annotations.json", 1)
    b = built(scenes / "images", tmp_path / "two", scenes / "annotations.json", 2)
    assert a == b and len(a[0]) > 1
    assert not (tmp_path / "two" / ROWS_NAME).exists()


@pytest.mark.parametrize("text", [
    '{"annotations": [], "images": [{"id": 1, "file_name": "a.jpg"}], "categories": [{"id": 1, "name": "a"}]}',
    '{"info": {"annotations": [1]}, "images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [], "categories": [{"id": 1, "name": "a"}]}',
    '{"images": [{"id": 1, "file_name": "a.jpg"}], "categories": [{"id": 1, "name": "a"}], "annotations": [], "categories": [{"id": 2, "name": "b"}]}',
    '{"images": [], "annotations": [], "categories": [{"id": 1, "name": "a"}]}',
    '{"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"id": 1, "categories": [1]}]}',
])
def test_unusual_layouts_have_no_outline(text):
    """Images after the annotations, an "annotations" key deeper down, categories given
    twice, empty images, no top-level categories: read the serial way."""
    json.loads(text)  # each is JSON
    assert top_level_lists(text) is None


def test_outline_finds_categories_after_the_annotations():
    text = ('{"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [{"id": 1}], '
            '"categories": [{"id": 3, "name": "c"}], "info": {}}')
    assert top_level_lists(text) == {"images": [{"id": 1, "file_name": "a.jpg"}],
                                     "categories": [{"id": 3, "name": "c"}]}


def test_full_read_that_disagrees_starts_the_build_again(scenes, tmp_path):
    """A second top-level "images" after the annotations: JSON keeps the last, which the
    outline cannot see; the build starts afresh from the full read and packs those."""
    data = json.loads((scenes / "annotations.json").read_text())
    first = data.pop("images")
    text = json.dumps({"images": first[:5], "annotations": data["annotations"],
                       "images_": None, "categories": data["categories"]})
    text = text.replace('"images_": null', '"images": ' + json.dumps(first))
    ann = tmp_path / "twice.json"
    ann.write_text(text)
    assert coco_outline(scenes / "images", ann, 2).source.entries != \
        read_coco(scenes / "images", ann).entries
    a = built(scenes / "images", tmp_path / "one", ann, 1)
    b = built(scenes / "images", tmp_path / "two", ann, 2)
    assert a == b and a[3] == len(first)


def test_a_broken_annotation_list_stops_the_build_and_leaves_no_folder(scenes, tmp_path):
    data = json.loads((scenes / "annotations.json").read_text())
    data["annotations"][3]["id"] = data["annotations"][1]["id"]
    ann = tmp_path / "dup.json"
    ann.write_text(json.dumps(data))
    assert coco_outline(scenes / "images", ann, 2) is not None  # found late, by the full read
    with pytest.raises(PackerError, match="appears twice"):
        build(scenes / "images", tmp_path / "d", coco=ann, workers=2, progress=False)
    assert not (tmp_path / "d").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(PackerError, match="appears twice"):
        build(scenes / "images", tmp_path / "kept", coco=ann, workers=2, progress=False)
    assert list((tmp_path / "kept").iterdir()) == []


def test_a_number_msgpack_cannot_hold_reaches_the_workers_as_json(scenes, tmp_path):
    data = json.loads((scenes / "annotations.json").read_text())
    data["annotations"][0]["bbox"][2] = 10 ** 400
    data["annotations"][1]["area"] = 10 ** 40
    ann = tmp_path / "big.json"
    ann.write_text(json.dumps(data))
    a = built(scenes / "images", tmp_path / "one", ann, 1)
    b = built(scenes / "images", tmp_path / "two", ann, 2)
    assert a == b
    assert "too large for a float" in json.dumps(a[1])


def test_workers_hold_checked_images_until_the_rows_come(scenes, tmp_path):
    """``write_shards`` checks the images of several shards while the rows are not
    written, then stores them all once they are."""
    import multiprocessing as mp
    full = read_coco(scenes / "images", scenes / "annotations.json")
    out = coco_outline(scenes / "images", scenes / "annotations.json", 1)
    written, stop = mp.get_context("fork").Event(), mp.get_context("fork").Event()
    late = LateRows(tmp_path / ROWS_NAME, written, stop)
    from packer.writing.builder import source_schema
    fields = source_schema(full)["fields"]
    job = ShardJob(tmp_path, FieldMaker(out.source, fields, [], late), None, 1 << 30, False,
                   stop=stop)
    tasks = [ShardTask(0, 0, 8, 1 << 20), ShardTask(1, 8, 16, 1 << 20),
             ShardTask(2, 16, 24, 1 << 20)]
    rows = out.finish([]).annotations.rows

    def hand_over():
        write_rows(tmp_path / ROWS_NAME, rows)
        written.set()

    timer = threading.Timer(0.5, hand_over)
    timer.start()
    done = write_shards(tasks, job)
    timer.join()
    assert [len(d.samples) for d in done] == [8, 8, 8]
    assert all(d.shard is not None and not d.stopped for d in done)
    # stopped before the rows come: nothing is written, nothing is left
    stop.set()
    late2 = LateRows(tmp_path / "never", mp.get_context("fork").Event(), stop)
    job2 = ShardJob(tmp_path / "x", FieldMaker(out.source, fields, [], late2), None, 1 << 30,
                    False, stop=stop)
    (tmp_path / "x").mkdir()
    assert all(d.stopped and d.shard is None for d in write_shards(tasks[:1], job2))
    assert list((tmp_path / "x").iterdir()) == []
