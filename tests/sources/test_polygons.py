"""The C accelerator for COCO polygon text (``packer.sources._polygons``): where it answers,
exactly ``msgpack.packb(json.loads(text))``; where it does not, None (the Python path
decides); and builds that are byte for byte the same with it and without it."""
from __future__ import annotations

import hashlib
import json
import os
import random

import msgpack
import pytest

from packer.writing.builder import build
from packer.demo.scenes import make_detection_folder
from packer.format.fields import PackedData
from packer.sources import segmentation
from packer.sources.coco import fit_coco
from packer.sources.lazyjson import Deferred

if os.environ.get("CI"):  # CI builds it (scripts/setup.sh): a missing module is a failure
    from packer.sources._polygons import packed_polygons
else:
    packed_polygons = pytest.importorskip("packer.sources._polygons").packed_polygons

ODD_NUMBERS = ["0", "-0", "0.0", "-0.0", "1e5", "1E-3", "00", "01", "-01", "1.", ".5", "-",
               "--1", "+1", "0x1", "1.5.2", "Infinity", "NaN", "9007199254740993",
               "9007199254740993.0", "0.30000000000000004", "123456789012345678",
               "1234567890123456789", "-9223372036854775808", "1" * 30, "0." + "1" * 25]


def some_number(rng: random.Random) -> str:
    k = rng.random()
    if k < 0.3:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(0, 6)}f}"
    if k < 0.5:
        return str(rng.randint(-10 ** rng.randint(0, 19), 10 ** rng.randint(0, 19)))
    if k < 0.6:
        return repr(rng.uniform(-1e6, 1e6))
    if k < 0.7:
        return rng.choice(ODD_NUMBERS)
    return f"{rng.uniform(0, 640):.2f}"


def some_text(rng: random.Random) -> str:
    """Polygon text as files have it, or nearly: odd numbers, odd spacing, and one in three
    with a few characters inserted, replaced or removed."""
    def polygon():
        sep = rng.choice([",", ", ", " ,", ",\n"])
        numbers = sep.join(some_number(rng) for _ in range(rng.randint(0, 12)))
        return "[" + rng.choice(["", " "]) + numbers + rng.choice(["", " "]) + "]"
    text = "[" + rng.choice([",", ", "]).join(polygon() for _ in range(rng.randint(0, 4))) + "]"
    if rng.random() < 0.33:
        chars = list(text)
        for _ in range(rng.randint(1, 3)):
            if not chars:
                break
            i, c = rng.randrange(len(chars)), rng.choice("0123456789.,-[] e\t")
            op = rng.random()
            if op < 0.4:
                chars.insert(i, c)
            elif op < 0.7:
                chars[i] = c
            else:
                del chars[i]
        text = "".join(chars)
    return text


def test_where_it_answers_it_is_msgpack_of_the_parsed_json():
    rng = random.Random(0)
    answered = 0
    for _ in range(20000):
        text = some_text(rng)
        packed = packed_polygons(text)
        if packed is None:
            continue
        answered += 1
        assert packed == msgpack.packb(json.loads(text)), text  # json.loads must accept it too
    assert answered > 1000  # the fuzz reaches the fast path, not only the way out


def test_floats_are_rounded_as_python_rounds_them():
    rng = random.Random(1)
    for _ in range(20000):
        whole = str(rng.randint(0, 10 ** rng.randint(0, 18)))
        frac = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 22)))
        text = f"[[{rng.choice(['', '-'])}{whole}.{frac}, 1]]"
        packed = packed_polygons(text)
        if packed is not None:
            assert packed == msgpack.packb(json.loads(text)), text


@pytest.mark.parametrize("text", [
    "[[70.0, 181.0, 48.5, 190.25]]", "[[1,2,3,4,5,6],[7,8]]", " [ [ 1 , -2 ] , [ 0.5 ] ] ",
    "[[" + ",".join(["1.5"] * 70000) + "]]", "[" + ",".join(["[1]"] * 20) + "]",
    "[[-0.0, 0, -0, 127, 128, 255, 256, 65535, 65536, 4294967296, -32, -33, -128, -129]]",
    "[[-32768, -32769, -2147483648, -2147483649, 999999999999999999, -999999999999999999]]",
    "[[9007199254740.992, 0.1, 0.0000000000000001]]"])
def test_common_text_takes_the_fast_path(text):
    assert packed_polygons(text) == msgpack.packb(json.loads(text))


@pytest.mark.parametrize("text", [
    "[[1e5]]", "[[1E5]]", "[[01]]", "[[1.]]", "[[.5]]", "[[-]]", "[[NaN]]", "[[Infinity]]",
    "[[1234567890123456789]]", "[[9007199254740993.0]]", "[[0." + "1" * 25 + "]]", "[]",
    "[[]]", "[[1], []]", "[[[1]]]", "[[1]]x", "[[1]],[[2]]", "[[1 2]]", "[[1,]]", "[[,1]]",
    "[[1]", "[[1\u00a02]]", "[[1]]\u00e9", "[[\"1\"]]", "[[true]]", "[[null]]", "[{}]", "",
    "[[1]] [[2]]"])
def test_anything_else_goes_the_python_way(text):
    assert packed_polygons(text) is None


def test_only_text_is_taken():
    with pytest.raises(TypeError):
        packed_polygons(b"[[1]]")


def test_fit_stores_the_packed_bytes_and_the_python_way_gives_the_same(monkeypatch):
    text = Deferred("[[10.5, 10, 30, 10, 30, 20.25]]")
    row = {"image_id": 1, "objects": [(7, 1, [0, 0, 5, 5], 25.0, 0, text)]}
    fast = fit_coco(row, 10, 10)[0]["segmentation"][0]
    assert type(fast) is PackedData and fast == msgpack.packb(json.loads(text))
    monkeypatch.setattr(segmentation, "packed_polygons", None)
    assert fit_coco(row, 10, 10)[0]["segmentation"][0] == json.loads(text)


def test_a_build_is_the_same_bytes_with_it_and_without_it(tmp_path, monkeypatch):
    coco = make_detection_folder(tmp_path / "coco", 12, workers=1)
    data = json.loads((coco / "annotations.json").read_text())
    anns = data["annotations"]
    anns[0]["segmentation"] = [[1e2, 5, 20, 5, 20, 30]]       # an exponent: the Python way
    anns[1]["segmentation"] = {"counts": "0`0Q0", "size": [40, 60]}  # an RLE
    anns[2]["segmentation"] = [[1, 2, "x"]]                   # unusable: dropped either way
    (coco / "annotations.json").write_text(json.dumps(data))
    hashes = []
    for accelerated in (True, False):
        if not accelerated:
            monkeypatch.setattr(segmentation, "packed_polygons", None)
        dst = tmp_path / f"packed-{accelerated}"
        manifest = build(coco / "images", dst, coco=coco / "annotations.json", workers=0,
                         progress=False).manifest
        assert manifest["dropped_count"] == 1
        hashes.append([hashlib.sha256((dst / s["path"]).read_bytes()).hexdigest()
                       for s in manifest["shards"]])
    assert hashes[0] == hashes[1]
