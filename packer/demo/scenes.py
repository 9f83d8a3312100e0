"""Detection sample data, no downloads: photo scenes with other photos' crops pasted at known
boxes (the source photo is the class). Category ids are odd and image ids start at 1000 in
steps of 7, so code that confuses ids with list indices fails loudly."""
from __future__ import annotations

import io
import json
import math
import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Dict, List, Optional, Tuple

from PIL import Image, ImageDraw, ImageEnhance, ImageFilter

from .._util.system import usable_cores
from .images import PHOTOS, load_photos, make_image, random_crop

FIRST_IMAGE_ID, IMAGE_ID_STEP = 1000, 7
MAX_OVERLAP = 0.3      # of the smaller box: objects may overlap, but none is mostly hidden
EDGE_CHANCE = 0.15     # per side: how often an object is placed touching the image border

Box = Tuple[int, int, int, int]
_FEATHER = [0] * 16 + list(range(16, 256))  # mask lookup table: alpha below 16 becomes 0


def photo_names() -> List[str]:
    """Class names, the shipped photos' file stems, in ``load_photos`` order (class index)."""
    return [p.stem for p in sorted(PHOTOS.glob("*.jpg"))]


def category_id(index: int) -> int:
    """COCO category id of class ``index``: odd numbers, never equal to the index."""
    return 2 * index + 1


def image_id(index: int) -> int:
    """COCO image id of the ``index``-th image: neither the index nor contiguous."""
    return FIRST_IMAGE_ID + IMAGE_ID_STEP * index


@dataclass(frozen=True)
class SceneObject:
    """One pasted object; ``box`` (x0, y0, x1, y1, exclusive) is tight around mask > 0."""
    label: int                 # class index into photo_names()
    box: Box
    area: int                  # pixels where the mask is nonzero
    polygon: List[float]       # mask outline, flattened x, y, in image pixels


@dataclass(frozen=True)
class Scene:
    """A rendered scene before JPEG encoding, and the quality it is saved at."""
    image: Image.Image
    objects: List[SceneObject]
    quality: int


def render_scene(seed: int, index: int, photos: List[Image.Image], *, max_objects: int = 6,
                 empty: bool = False, without: Collection[int] = ()) -> Scene:
    """Scene ``index`` of ``make_detection_folder(seed=seed)``, decoded; objects in ``without`` are
    left unpasted (every random draw the same), so tests see which pixels an object changed."""
    rng = random.Random(f"packer-scene:{seed}:{index}")  # str seeds hash stably (sha512)
    bg_label = rng.randrange(len(photos))
    image = Image.open(io.BytesIO(make_image(rng, [photos[bg_label]]))).convert("RGB")
    w, h = image.size
    others = [k for k in range(len(photos)) if k != bg_label]
    placed: List[SceneObject] = []
    for _ in range(0 if empty else rng.randint(1, max_objects)):
        label = rng.choice(others)
        patch, mask = _make_object(rng, photos[label], w, h)
        tight = mask.getbbox()
        patch, mask = patch.crop(tight), mask.crop(tight)
        box = _place(rng, mask.size, (w, h), [o.box for o in placed])
        if box is None:
            continue
        if len(placed) not in without:
            image.paste(patch, box[:2], mask)
        area = mask.width * mask.height - mask.histogram()[0]
        placed.append(SceneObject(label, box, area, _outline(mask, box[0], box[1])))
    return Scene(image, placed, rng.randint(75, 95))


def _make_object(rng: random.Random, photo: Image.Image, w: int, h: int):
    """(patch, soft mask) of one object: a crop of ``photo`` sized 5%-60% of the image sides."""
    scale, aspect = rng.uniform(0.05, 0.6), math.exp(rng.uniform(-0.7, 0.7))
    ow = round(w * min(0.6, max(0.05, scale * math.sqrt(aspect))))
    oh = round(h * min(0.6, max(0.05, scale / math.sqrt(aspect))))
    patch = random_crop(rng, photo, ow, oh, (0.25, 0.9))
    patch = ImageEnhance.Brightness(patch).enhance(rng.uniform(0.8, 1.2))
    radius = max(0.8, min(ow, oh) * rng.uniform(0.01, 0.03))
    inset = math.ceil(2 * radius)  # room for the blur, so most of the feather stays on the mask
    mask = Image.new("L", (ow, oh), 0)
    shape = [inset, inset, ow - 1 - inset, oh - 1 - inset]
    if rng.random() < 0.5:
        ImageDraw.Draw(mask).ellipse(shape, fill=255)
    else:
        corner = round(min(ow, oh) * rng.uniform(0.1, 0.3))
        ImageDraw.Draw(mask).rounded_rectangle(shape, radius=corner, fill=255)
    # Drop the blur's faint tail: the box should frame what a person sees, not 1/255 alpha.
    return patch, mask.filter(ImageFilter.GaussianBlur(radius)).point(_FEATHER)


def _place(rng: random.Random, size: Tuple[int, int], image_size: Tuple[int, int],
           taken: List[Box], tries: int = 8):
    """A box of ``size`` fully inside the image, sometimes touching its border, that hides no
    placed box by more than MAX_OVERLAP; None when ``tries`` random spots all do."""
    (bw, bh), (w, h) = size, image_size
    for _ in range(tries):
        x0, y0 = _coordinate(rng, w - bw), _coordinate(rng, h - bh)
        box = (x0, y0, x0 + bw, y0 + bh)
        if all(_intersection(box, t) <= MAX_OVERLAP * min(_area(box), _area(t)) for t in taken):
            return box
    return None


def _coordinate(rng: random.Random, room: int) -> int:
    r = rng.random()
    return 0 if r < EDGE_CHANCE else room if r < 2 * EDGE_CHANCE else rng.randint(0, room)


def _area(b: Box) -> int:
    return (b[2] - b[0]) * (b[3] - b[1])


def _intersection(a: Box, b: Box) -> int:
    return max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))


def _outline(mask: Image.Image, dx: int, dy: int, points: int = 24) -> List[float]:
    """Polygon around a blurred convex mask's row extents (its bounds are the box's)."""
    w, h = mask.size
    data = mask.tobytes()
    # Evenly spaced rows, plus the middle one: a convex shape is widest near it.
    rows = sorted({round(i * (h - 1) / max(1, points - 1)) for i in range(points)} | {h // 2})
    spans = []
    for r in rows:
        line = data[r * w:(r + 1) * w]
        x0, x1 = w - len(line.lstrip(b"\0")), len(line.rstrip(b"\0"))
        if x1 > x0:
            spans.append((r + 0.5, x0, x1))
    (top, tx0, tx1), (bottom, bx0, bx1) = spans[0], spans[-1]
    spans = [(top - 0.5, tx0, tx1)] + spans + [(bottom + 0.5, bx0, bx1)]
    ring = ([(dx + x0, dy + y) for y, x0, _ in spans]
            + [(dx + x1, dy + y) for y, _, x1 in spans[::-1]])
    return [round(float(v), 1) for p in ring for v in p]


def make_detection_folder(dst: os.PathLike, images: int = 64, *, seed: int = 0,
                          max_objects: int = 6, empty_fraction: float = 0.1,
                          workers: Optional[int] = None) -> Path:
    """Write a detection dataset of realistic JPEG scenes under ``dst``: ``images/``,
    ``annotations.json`` (COCO), ``labels/`` (YOLO; half the empty images without a file),
    ``names.txt``, ``data.yaml``. The same arguments give the same bytes, whatever ``workers``."""
    dst = Path(dst)
    (dst / "images").mkdir(parents=True, exist_ok=True)
    (dst / "labels").mkdir(exist_ok=True)
    names = photo_names()
    empty = sorted(random.Random(f"packer-scenes-empty:{seed}").sample(
        range(images), round(images * empty_fraction)))
    job = _SceneJob(dst, seed, max_objects, frozenset(empty), frozenset(empty[::2]))
    workers = min(usable_cores() if workers is None else workers, max(1, images // 64))
    if workers > 1:  # spawned: torch's thread pool (the noise) does not survive a fork
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_one_torch_thread) as pool:
            scenes = list(pool.map(job, range(images), chunksize=16))
    else:
        scenes = [job(i) for i in range(images)]
    coco: Dict[str, list] = {"images": [], "annotations": [], "categories": [
        {"id": category_id(k), "name": n, "supercategory": "photo"} for k, n in enumerate(names)]}
    for i, (w, h, objects) in enumerate(scenes):
        coco["images"].append({"id": image_id(i), "file_name": f"{i:06d}.jpg",
                               "width": w, "height": h})
        for o in objects:
            x0, y0, x1, y1 = o.box
            coco["annotations"].append({
                "id": len(coco["annotations"]) + 1, "image_id": image_id(i),
                "category_id": category_id(o.label),
                "bbox": [float(x0), float(y0), float(x1 - x0), float(y1 - y0)],
                "area": float(o.area), "iscrowd": 0, "segmentation": [o.polygon]})
    (dst / "annotations.json").write_text(json.dumps(coco))
    (dst / "names.txt").write_text("".join(f"{n}\n" for n in names))
    (dst / "data.yaml").write_text(
        "train: images\nval: images\n"
        f"nc: {len(names)}\nnames:\n" + "".join(f"  - {n}\n" for n in names))
    return dst


@dataclass(frozen=True)
class _SceneJob:
    """Writes scene ``i``'s JPEG and YOLO label file; returns its size and objects."""
    dst: Path
    seed: int
    max_objects: int
    empty: Collection[int]
    no_label_file: Collection[int]

    def __call__(self, i: int) -> Tuple[int, int, List[SceneObject]]:
        if not _PHOTOS:
            _PHOTOS.extend(load_photos())
        scene = render_scene(self.seed, i, _PHOTOS, max_objects=self.max_objects,
                             empty=i in self.empty)
        stem = f"{i:06d}"
        scene.image.save(self.dst / "images" / f"{stem}.jpg", "JPEG", quality=scene.quality)
        w, h = scene.image.size
        lines = []
        for o in scene.objects:
            x0, y0, x1, y1 = o.box
            lines.append(f"{o.label} {(x0 + x1) / 2 / w:.6f} {(y0 + y1) / 2 / h:.6f} "
                         f"{(x1 - x0) / w:.6f} {(y1 - y0) / h:.6f}\n")
        label_file = self.dst / "labels" / f"{stem}.txt"
        if i in self.no_label_file:
            label_file.unlink(missing_ok=True)  # left from an earlier run into the same folder
        else:
            label_file.write_text("".join(lines))
        return w, h, scene.objects


_PHOTOS: List[Image.Image] = []  # this process's load_photos()


def _one_torch_thread() -> None:
    import torch
    torch.set_num_threads(1)  # one process per core: torch's own threads only contend
