"""Masks are pycocotools' masks, pixel for pixel, in bounded work (``packer.reading.masks``).

Every mask is compared with pycocotools' own ``decode(merge(frPyObjects(seg, h, w)))`` (what
``annToMask`` and torchvision's wrapper compute) on thousands of random polygons at real
photo sizes, on the outlines of real photo cut-outs (``packer.demo``), shrunk to COCO's
small objects, and on RLEs of real photos; then the limits: each refused with its reason
before any allocation, and a hostile file's masks within a memory limit.
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from packer import PackedDataset, build, verify, write
from packer.demo import load_photos
from packer.demo.scenes import make_detection_folder
from packer.errors import FormatError
from packer.sources import Coco
from packer.reading.masks import (MAX_COORDINATE, MAX_POLYGON_VERTICES, crossing_budget,
                                  decode_counts, masks_of, segmentation_problem)

mask_api = pytest.importorskip("pycocotools.mask")
# pycocotools' decode passes copy=False to numpy 2's __array__: not packer's to fix
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pycocotools")
np = pytest.importorskip("numpy")

SIZES = [(375, 500), (333, 500), (500, 333), (427, 640), (480, 640), (500, 375), (37, 53)]


def reference(segmentation, h: int, w: int) -> torch.Tensor:
    """pycocotools' masks, as torchvision's ``wrap_dataset_for_transforms_v2`` makes them."""
    out = []
    for seg in segmentation:
        if isinstance(seg, dict):
            rle = seg if isinstance(seg["counts"], str) else mask_api.frPyObjects(seg, h, w)
        else:
            rle = mask_api.merge(mask_api.frPyObjects(seg, h, w))
        out.append(torch.from_numpy(mask_api.decode(rle)))
    return torch.stack(out)


def assert_same(segmentation, h: int, w: int) -> None:
    got, want = masks_of(segmentation, h, w), reference(segmentation, h, w)
    assert got.shape == want.shape and got.dtype == torch.uint8
    if not torch.equal(got, want):
        bad = [k for k in range(len(got)) if not torch.equal(got[k], want[k])]
        k = bad[0]
        raise AssertionError(f"{len(bad)} of {len(got)} masks differ; the first by "
                             f"{int((got[k] != want[k]).sum())} pixels: {segmentation[k]}")


# -- random polygons ------------------------------------------------------------------------

def random_polygon(rng: random.Random, h: int, w: int):
    """A polygon of one of the shapes annotations have: star-shaped outlines (COCO's), small
    ones with 2-decimal coordinates, self-intersecting scribbles, axis-aligned boxes on
    whole and half pixels, and any of them reaching out of the image."""
    kind = rng.random()
    cx, cy = rng.uniform(-0.1 * w, 1.1 * w), rng.uniform(-0.1 * h, 1.1 * h)
    if kind < 0.15:  # a box with corners on whole or half pixels: rounding's worst case
        x0, y0 = rng.randint(-5, w) / rng.choice([1, 2]), rng.randint(-5, h) / rng.choice([1, 2])
        x1, y1 = x0 + rng.randint(0, 40) / 2, y0 + rng.randint(0, 40) / 2
        return [x0, y0, x1, y0, x1, y1, x0, y1]
    radius = rng.choice([0.6, 2, 5, 16, 60, 0.4 * max(h, w), 2 * max(h, w)])
    k = rng.randint(3, 40)
    if kind < 0.35:  # a scribble: any vertex order
        pts = [(cx + rng.uniform(-radius, radius), cy + rng.uniform(-radius, radius))
               for _ in range(k)]
    else:  # star-shaped around the centre, as an outline traced by hand
        angles = sorted(rng.uniform(0, 2 * math.pi) for _ in range(k))
        pts = [(cx + radius * rng.uniform(0.3, 1) * math.cos(a),
                cy + radius * rng.uniform(0.3, 1) * math.sin(a)) for a in angles]
    digits = rng.choice([0, 1, 2, 2, 2, 5])
    return [round(v, digits) for p in pts for v in p]


@pytest.mark.parametrize("seed", range(3))
def test_random_polygons_are_pycocotools_masks(seed):
    rng = random.Random(seed)
    for _ in range(8):  # 3 x 8 images x 60 objects: 1,440 objects, ~2,200 polygons
        h, w = rng.choice(SIZES)
        objects = [[random_polygon(rng, h, w) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
                   for _ in range(60)]
        assert_same(objects, h, w)


def test_degenerate_polygons():
    h, w = 40, 50
    assert_same([[[10, 10, 30, 10, 30, 20, 10, 20]]], h, w)          # a 20 x 10 box
    assert_same([[[10, 10, 30, 10, 30, 20, 10, 20, 7]]], h, w)       # odd count: last ignored
    assert_same([[[5, 5, 5, 5, 5, 5]]], h, w)                        # one point
    assert_same([[[5, 5, 25, 30, 5, 5]]], h, w)                      # a line there and back
    assert_same([[[0, 0, 50, 0, 50, 40, 0, 40]]], h, w)              # the whole image
    assert_same([[[-9, -9, 60, -9, 60, 49, -9, 49]]], h, w)          # more than the image
    assert_same([[[-30, 5, -10, 5, -10, 30]]], h, w)                 # left of the image
    assert_same([[[10, 45, 30, 45, 20, 90]]], h, w)                  # below it
    assert_same([[[10, 10, 30, 10, 30, 20], [20, 15, 40, 15, 40, 35]]], h, w)  # overlapping
    assert_same([[[10, 10, 40, 10, 40, 30, 10, 30], [20, 15, 30, 15, 30, 25, 20, 25]]], h, w)
    assert_same([[[2.5, 2.5, 7.5, 2.5, 7.5, 7.5, 2.5, 7.5]], [[2.4, 2.6, 7.6, 2.4, 7.4, 7.6]]],
                h, w)
    far = [-1e5, 20.3, 1e5, 20.7, 3e4, -2e4]  # edges far longer than the image
    assert_same([[far], [[25.2, -1e5, 25.9, 1e5, 31.1, 1e5]]], h, w)
    assert masks_of([[], [[]], [[1.0, 2.0]]], h, w).sum() == 0      # nothing to fill


# -- real objects ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    root = make_detection_folder(tmp_path_factory.mktemp("scenes") / "s", images=24, seed=7)
    return json.loads((root / "annotations.json").read_text())


def test_real_outlines_and_small_objects_are_pycocotools_masks(scenes):
    """Outlines of real photo cut-outs at their size and shrunk to COCO's small objects
    (area under 32 x 32, a vertex every pixel or two, 2-decimal coordinates)."""
    sizes = {im["id"]: (im["height"], im["width"]) for im in scenes["images"]}
    rng = random.Random(3)
    by_image = {}
    for a in scenes["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a["segmentation"])
    for image_id, objects in by_image.items():
        h, w = sizes[image_id]
        small = []
        for seg in objects:
            for scale in (0.02, 0.05, 0.1, 0.25):
                dx, dy = rng.uniform(0, w * 0.9), rng.uniform(0, h * 0.9)
                small.append([[round(v * scale + (dy if i % 2 else dx), 2)
                               for i, v in enumerate(p)] for p in seg])
        assert_same(objects + small, h, w)


def photo_masks(h: int, w: int):
    """Binary masks of real photos (a threshold of their grey levels): ragged, many runs."""
    from PIL import Image
    for photo in load_photos():
        grey = photo.convert("L").resize((w, h), Image.BILINEAR)
        a = torch.frombuffer(bytearray(grey.tobytes()), dtype=torch.uint8).view(h, w)
        yield (a > int(a.float().median())).to(torch.uint8)


def run_lengths(mask: torch.Tensor):
    """COCO's uncompressed counts: column-major runs, starting with zeros."""
    flat = mask.t().reshape(-1)
    change = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    bounds = torch.cat([torch.tensor([0]), change, torch.tensor([len(flat)])])
    runs = (bounds[1:] - bounds[:-1]).tolist()
    return runs if flat[0] == 0 else [0] + runs


@pytest.mark.parametrize("h, w", [(375, 500), (427, 640), (7, 5)])
def test_rle_of_real_photos_compressed_and_not(h, w):
    masks = list(photo_masks(h, w))
    compressed = [mask_api.encode(np.asfortranarray(m.numpy())) for m in masks]
    segs = [{"size": [h, w], "counts": r["counts"].decode()} for r in compressed]
    segs += [{"size": [h, w], "counts": run_lengths(m)} for m in masks]
    assert_same(segs, h, w)
    assert torch.equal(masks_of(segs, h, w), torch.stack(masks + masks))
    # the same counts, as pycocotools reads the string
    for r, m in zip(compressed, masks):
        assert decode_counts(r["counts"].decode()) == run_lengths(m)


def test_mixed_rle_and_polygons_in_one_image():
    h, w = 60, 80
    rle = mask_api.encode(np.asfortranarray((np.arange(h * w).reshape(h, w) % 7 < 3)
                                            .astype(np.uint8)))
    assert_same([[[3, 4, 50, 9, 20, 55]], {"size": [h, w], "counts": rle["counts"].decode()},
                 {"size": [h, w], "counts": [5, 10, 4785]}, [[70, 2, 79, 2, 75, 59]]], h, w)


# -- limits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seg, problem", [
    ([[[0.0, 1.0] * (MAX_POLYGON_VERTICES + 1)]], f"at most {MAX_POLYGON_VERTICES}"),
    ([[[0, 0, 10, 0, MAX_COORDINATE * 2, 5]]], "coordinate"),
    ([[[0, 0, 10, 0, float("nan"), 5]]], "coordinate"),
    ([[[0, 0, True, 0, 5, 5]]], "not a list of numbers"),
    ([{"size": [40, 50], "counts": "0a~"}], "does not decode"),
    ([{"size": [40, 50], "counts": [3, -1, 5]}], "run lengths"),
    ([{"size": [40, 50], "counts": [2001]}], "run lengths"),
    # 64 runs of 2^58 in COCO's string form: their int64 sum wraps round to 0
    ([{"size": [40, 50], "counts": "PPPPPPPPPPP8" * 3 + "0" * 61}], "run lengths"),
])
def test_segmentations_beyond_the_limits_are_refused(seg, problem):
    assert problem in segmentation_problem(seg, 40, 50)
    with pytest.raises(ValueError, match=problem):
        masks_of(seg, 40, 50)


def test_an_outline_crossing_too_many_columns_is_refused_before_any_work():
    h = w = 64
    # a zigzag from the left edge to the right and back: every edge crosses all 64 columns
    edges = crossing_budget(h, w) // w + 2
    zigzag = [v for i in range(edges) for v in ((0.0 if i % 2 else 64.0), i * 64 / edges)]
    assert len(zigzag) // 2 < MAX_POLYGON_VERTICES
    with pytest.raises(ValueError, match="crossing .* pixel columns"):
        masks_of([[zigzag]], h, w)
    assert masks_of([[zigzag[: 2 * (edges // 2)]]], h, w).shape == (1, h, w)  # half: allowed



MANY = """
import resource, sys, torch
from packer.reading.masks import crossing_budget, masks_of
h = w = 64
edges = crossing_budget(h, w) // w - 1  # each object just within the budget
zigzag = [v for i in range(edges) for v in ((0.0 if i % 2 else 64.0), i * 64 / edges)]
masks_of([[zigzag]], h, w)  # imports and first allocations: not what is measured
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]), hard))
print(tuple(masks_of([[zigzag]] * 16, h, w).shape))
"""


def test_many_objects_at_the_crossing_budget_cost_a_bounded_amount():
    # sixteen objects of ~1M crossings on a 64x64 image took ~2 GB painted at once; in
    # groups of about twice one object's budget they take ~250 MB
    h = w = 64
    edges = crossing_budget(h, w) // w - 1
    zigzag = [v for i in range(edges) for v in ((0.0 if i % 2 else 64.0), i * 64 / edges)]
    rle = {"size": [h, w], "counts": [100, 50, h * w - 150]}
    assert_same([[zigzag], rle, [zigzag], [[1, 1, 30, 2, 20, 40]], [zigzag]], h, w)  # groups
    r = subprocess.run([sys.executable, "-c", MANY, str(600 << 20)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["(16,", "64,", "64)"], r.stderr[-2000:]


ATTACK = """
import resource, sys, torch
torch.set_num_threads(1)
from packer import PackedDataset
ds = PackedDataset(sys.argv[1], masks=True)
ds[0]  # imports and the first image: not what is measured
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[2]), hard))
image, target = ds[0]
resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
print(tuple(target["masks"].shape), int(target["masks"].sum()))
"""


def test_hostile_polygons_cost_the_images_pixels_not_more(tmp_path):
    """Issue 29.4: one object of 40 triangles spanning the whole image (a ~1 KB COCO
    file). Its mask takes the image's pixels a few times over; the earlier rasteriser took
    ~24 bytes per pixel per polygon at once and as long as 40 of those masks (at 4096 px:
    473 MB, 28 s; this one 78 MB, 0.4 s)."""
    from PIL import Image
    s, n = 2048, 40
    (tmp_path / "images").mkdir()
    Image.new("RGB", (s, s), (90, 120, 150)).save(tmp_path / "images" / "a.jpg", quality=50)
    polys = [[0, 0, s, s * (k + 1) / n, s * k / n, s] for k in range(n)]  # each spans it all
    coco = {"images": [{"id": 1, "file_name": "a.jpg", "width": s, "height": s}],
            "categories": [{"id": 1, "name": "thing"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, s, s],
                             "segmentation": polys}]}
    (tmp_path / "a.json").write_text(json.dumps(coco))
    assert (tmp_path / "a.json").stat().st_size < 2000
    build(Coco(tmp_path / "images", tmp_path / "a.json"), tmp_path / "ds", progress=False,
          workers=0)
    budget = 2 * s * s * 3 + 10 * s * s  # the image decoded twice, its mask ten times
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(ATTACK), str(tmp_path / "ds"),
                        str(budget)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    want = int(reference([polys], s, s).sum(dtype=torch.int64))
    assert r.stdout.split() == ["(1,", f"{s},", f"{s})", str(want)]


def test_a_polygon_beyond_the_limits_is_a_format_error_naming_it(tmp_path):
    from PIL import Image
    path = tmp_path / "a.png"
    Image.new("RGB", (64, 48), (10, 20, 30)).save(path)
    big = [[float(i % 64), float(i % 48)] for i in range(MAX_POLYGON_VERTICES + 1)]
    schema = [{"name": "image_id", "type": "int"},
              {"name": "boxes", "type": "array", "dtype": "float32", "shape": [-1, 4]},
              {"name": "labels", "type": "array", "dtype": "int64", "shape": [-1]},
              {"name": "segmentation", "type": "data"}]
    write(tmp_path / "ds", [{"image": path, "image_id": 1, "boxes": [[0.0, 0, 64, 48]],
                             "labels": [1], "segmentation": [[[v for p in big for v in p]]]}],
          schema=schema, progress=False)
    ds = PackedDataset(tmp_path / "ds", masks=True)
    with pytest.raises(FormatError, match=f"cannot be made into masks.*at most "
                                          f"{MAX_POLYGON_VERTICES}.*docs/security.md"):
        ds[0]
    assert any("segmentation: an object of" in p for p in verify(tmp_path / "ds",
                                                                progress=False).problems)
    assert len(PackedDataset(tmp_path / "ds")[0][1]["boxes"]) == 1  # without masks: fine
