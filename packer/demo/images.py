"""Realistic sample data, no downloads: ImageNet-like JPEGs made from the photos packer ships
(noise or flat colour would decode at unrealistic speeds)."""
from __future__ import annotations

import ctypes
import io
import os
import random
from pathlib import Path
from typing import List, Optional, Tuple

from PIL import Image, ImageChops, ImageEnhance, ImageFilter

PHOTOS = Path(__file__).with_name("photos")


def load_photos() -> List[Image.Image]:
    """The shipped public-domain photos (packer/demo/photos), decoded to RGB."""
    return [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg"))]


def make_image(rng: random.Random, photos: List[Image.Image],
               size: Optional[Tuple[int, int]] = None) -> bytes:
    """One JPEG: a random crop of a random photo at ImageNet-like size (or ``size``, (w, h))."""
    base = rng.choice(photos)
    short = rng.randint(300, 500)
    aspect = rng.choice([4 / 3, 3 / 2, 1.0, 16 / 9, 3 / 4])
    w, h = (round(short * aspect), short) if aspect >= 1 else (short, round(short / aspect))
    w, h = size or (w, h)
    im = random_crop(rng, base, w, h, (0.45, 1.0))
    im = ImageEnhance.Color(im).enhance(rng.uniform(0.6, 1.4))
    im = ImageEnhance.Brightness(im).enhance(rng.uniform(0.75, 1.25))
    # Upscaled crops are softer than camera photos; restore some detail so files and decode
    # cost land where real photos do (~50-110 KB for 500x375 at quality ~90).
    im = im.filter(ImageFilter.UnsharpMask(radius=2, percent=rng.randint(100, 200), threshold=1))
    grain = _noise(w, h, rng.uniform(3, 6), rng.getrandbits(63))  # sensor noise, centred on 128
    im = ImageChops.add(im, Image.merge("RGB", [grain] * 3), offset=-128)
    out = io.BytesIO()
    im.save(out, "JPEG", quality=rng.randint(75, 95))
    return out.getvalue()


def random_crop(rng: random.Random, photo: Image.Image, w: int, h: int, frac) -> Image.Image:
    """A random region of ``photo`` with the aspect of ``w`` x ``h``, its size a fraction in
    ``frac`` of the largest such region, resized to ``w`` x ``h`` and flipped half the time."""
    pw, ph = photo.size
    r, f = w / h, rng.uniform(*frac)
    cw, ch = (ph * r, ph) if pw / ph > r else (pw, pw / r)
    cw, ch = max(1, min(pw, round(cw * f))), max(1, min(ph, round(ch * f)))
    x, y = rng.randint(0, pw - cw), rng.randint(0, ph - ch)
    im = photo.crop((x, y, x + cw, y + ch)).resize((w, h), Image.BICUBIC)
    return im.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else im


def _noise(w: int, h: int, sigma: float, seed: int) -> Image.Image:
    # Not Image.effect_noise: it draws from C rand(), which no seed of ours controls.
    import torch
    g = torch.Generator().manual_seed(seed)
    n = (torch.randn(h, w, generator=g) * sigma + 128).clamp_(0, 255).to(torch.uint8)
    return Image.frombytes("L", (w, h), ctypes.string_at(n.data_ptr(), n.numel()))  # no numpy needed


def make_image_folder(root: os.PathLike, *, images: int = 200, classes: int = 10,
                      seed: int = 0, workers: int = 1, progress: bool = False) -> Path:
    """Write an ImageFolder tree ``root/class_XX/img_XXXXX.jpg`` of realistic JPEGs, the same
    whatever ``workers``."""
    from tqdm.auto import tqdm
    root = Path(root)
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    jobs = ((str(root / f"class_{i % classes:02d}" / f"img_{i:05d}.jpg"), seed, i)
            for i in range(images))  # made as taken: memory does not grow with the count
    bar = tqdm(total=images, disable=not progress, unit="img", desc="making images")
    if workers > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(workers) as pool:
            for _ in pool.imap_unordered(_make_one, jobs, chunksize=16):
                bar.update(1)
    else:
        for job in jobs:
            _make_one(job)
            bar.update(1)
    bar.close()
    return root


_PHOTOS: List[Image.Image] = []


def _make_one(job) -> None:
    path, seed, i = job
    if not _PHOTOS:
        import torch
        torch.set_num_threads(1)  # one pool process per core: torch's own threads only contend
        _PHOTOS.extend(load_photos())
    Path(path).write_bytes(make_image(random.Random(seed * 1_000_003 + i), _PHOTOS))
