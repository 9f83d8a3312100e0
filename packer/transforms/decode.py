"""Train-time decoding: by default exactly ImageFolder's loader (no pixel changes); the
``Decode*`` classes fuse decode, crop, resize and flip into one PIL pass to a uint8 tensor."""
from __future__ import annotations

import functools
import math
import numbers
import random
from typing import Optional, Tuple

from PIL import Image, UnidentifiedImageError

from ..errors import FormatError
from ..format.images import EXIF_TURNS, IMAGE_FORMATS, JPEG_FORMATS, orientation_of, pil_open


def stored_image(data: bytes) -> Image.Image:
    """A record's image opened (lazily) by an allowed decoder (``packer.format.images``):
    a build stores only such images, so anything else is a damaged or crafted record."""
    try:
        return pil_open(data)
    except UnidentifiedImageError:
        raise FormatError(f"a record's image is not in a format packer opens "
                          f"({', '.join(IMAGE_FORMATS)}): the dataset is damaged or "
                          f"crafted") from None


def open_image(data: bytes, *, size_hint: Optional[Tuple[int, int]] = None,
               exif_orientation: bool = False) -> Image.Image:
    """Stored bytes to a PIL RGB image, as torchvision's default loader; ``size_hint`` (w, h):
    JPEG draft decoding (other pixels). ``exif_orientation``: turned as by ``exif_transpose``
    (``exif_tag``'s orientation) without its EXIF rewrite, which raises on some tags."""
    im = stored_image(data)
    if size_hint is not None and im.format in JPEG_FORMATS:
        im.draft("RGB", size_hint)
    rgb = im.convert("RGB")  # first: reading a PNG's EXIF loads its pixels, errors unseen
    turn = EXIF_TURNS.get(orientation_of(im)) if exif_orientation else None
    return rgb if turn is None else rgb.transpose(turn)


def exif_tag(data: bytes) -> int:
    """The EXIF orientation (1-8) ``open_image(exif_orientation=True)`` applies to these bytes."""
    return orientation_of(stored_image(data))


def output_size(size) -> Tuple[int, int]:
    """``(height, width)`` of an output ``size`` as torchvision reads one: a number (its int)
    or ``[s]`` for ``s x s``, else ``(h, w)``; ValueError unless two positive ints."""
    given = size
    size = size.tolist() if hasattr(size, "tolist") else size  # an array or a tensor
    if isinstance(size, numbers.Real):
        size = (size if isinstance(size, bool) else int(size),) * 2
    size = tuple(size) if isinstance(size, (tuple, list)) else (size,)
    size = size * 2 if len(size) == 1 else size
    if len(size) != 2 or not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                 and float(v).is_integer() and v > 0 for v in size):
        raise ValueError(f"size must be a positive int or (height, width), got {given!r}")
    return int(size[0]), int(size[1])


class CropDecoder:
    """Base for ``bytes -> uint8 (3, H, W)`` decoders (``PackedDataset(decode=)``): a view of an
    HWC buffer, so a stacked batch is channels_last. ``resize``: "pil", "torch" or "auto"
    (torch unless Pillow-SIMD)."""

    def __init__(self, size, resize: str = "pil"):
        self.size = output_size(size)
        if resize not in ("auto", "pil", "torch"):
            raise ValueError(f"resize must be 'auto', 'pil' or 'torch', got {resize!r}")
        self.resize = resize

    def box(self, w: int, h: int) -> Tuple[float, float, float, float]:
        raise NotImplementedError

    def __call__(self, data: bytes):
        return self.decode_crop(data)[0]

    def decode_crop(self, data: bytes):
        """``(tensor, crop, flipped)``: the crop ``(x0, y0, x1, y1)`` in the stored image's
        pixels and the flip, so a detection target's boxes can follow (``packer.transforms.boxes``)."""
        im = stored_image(data)
        w, h = im.size
        crop = x0, y0, x1, y1 = self.box(w, h)
        oh, ow = self.size
        if im.format in JPEG_FORMATS:
            # Ask for the smallest DCT scale that keeps the crop at least output-sized.
            s = max(ow / (x1 - x0), oh / (y1 - y0))
            im.draft("RGB", (max(1, math.ceil(w * s)), max(1, math.ceil(h * s))))
        sx, sy = im.size[0] / w, im.size[1] / h
        box = (x0 * sx, y0 * sy, x1 * sx, y1 * sy)  # in the decoded (maybe drafted) pixels
        im = im.convert("RGB")
        flipped = self.flip()
        if self.torch_resize():
            x, (c0, r0, c1, r1) = resize_box(im, box, (oh, ow))
            return (x.flip(2) if flipped else x), (c0 / sx, r0 / sy, c1 / sx, r1 / sy), flipped
        im = im.resize((ow, oh), Image.BILINEAR, box=box, reducing_gap=None)
        if flipped:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return image_to_tensor(im), crop, flipped

    def torch_resize(self) -> bool:
        return self.resize == "torch" or self.resize == "auto" and not pillow_simd()

    def flip(self) -> bool:
        return False


def image_to_tensor(im: Image.Image):
    import torch
    w, h = im.size
    buf = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return buf.view(h, w, 3).permute(2, 0, 1)


def torch_resized(im: Image.Image, size: Tuple[int, int]):
    """``im`` resized to ``size`` by torch's antialiased bilinear kernel, as a (3, h, w) view of an
    HWC buffer (the explicit batch stride keeps torch channels_last: twice as fast)."""
    import torch.nn.functional as F
    x = image_to_tensor(im).permute(1, 2, 0)[None].permute(0, 3, 1, 2)
    if tuple(x.shape[2:]) != tuple(size):
        x = F.interpolate(x, size=tuple(size), mode="bilinear", antialias=True, align_corners=False)
    return x[0]


def resize_box(im: Image.Image, box, size: Tuple[int, int]):
    """``(tensor, box)``: ``box`` of ``im`` rounded to whole pixels, cropped, ``torch_resized``."""
    w, h = im.size
    c0, r0 = min(max(0, round(box[0])), w - 1), min(max(0, round(box[1])), h - 1)
    c1, r1 = max(c0 + 1, min(w, round(box[2]))), max(r0 + 1, min(h, round(box[3])))
    if (c0, r0, c1, r1) != (0, 0, w, h):
        im = im.crop((c0, r0, c1, r1))
    return torch_resized(im, size), (c0, r0, c1, r1)


class DecodeRandomResizedCrop(CropDecoder):
    """torchvision's RandomResizedCrop + RandomHorizontalFlip, fused into the decode (a large crop
    decodes JPEGs at reduced scale). Random numbers from ``random``, seeded per worker."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: bool = True,
                 resize: str = "auto"):
        super().__init__(size, resize)
        if not (0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1]):
            raise ValueError(f"scale must be within (0, 1] and ratio positive, got {scale}, {ratio}")
        self.scale, self.ratio, self.random_flip = tuple(scale), tuple(ratio), flip

    def box(self, w, h):
        area = w * h
        log_r = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):  # torchvision's rejection sampling, then its fallback
            target = area * random.uniform(*self.scale)
            r = math.exp(random.uniform(*log_r))
            cw, ch = round(math.sqrt(target * r)), round(math.sqrt(target / r))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = random.randint(0, w - cw), random.randint(0, h - ch)
                return x, y, x + cw, y + ch
        r = w / h
        if r < self.ratio[0]:
            cw, ch = w, round(w / self.ratio[0])
        elif r > self.ratio[1]:
            cw, ch = round(h * self.ratio[1]), h
        else:
            cw, ch = w, h
        x, y = (w - cw) // 2, (h - ch) // 2
        return x, y, x + cw, y + ch

    def flip(self):
        return self.random_flip and random.random() < 0.5


class DecodeCenterCrop(CropDecoder):
    """Evaluation: torchvision's ``Resize(round(min(size) / crop_fraction)) + CenterCrop(size)``
    fused into the decode, with torchvision's geometry exactly and its pixels to within a
    level. ``draft=True`` decodes large JPEGs at reduced scale (faster, other pixels)."""

    def __init__(self, size, crop_fraction: float = 0.875, *, resize_size: Optional[int] = None,
                 draft: bool = False):
        super().__init__(size)
        if not 0 < crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction}")
        if resize_size is not None and not (isinstance(resize_size, int) and resize_size > 0):
            raise ValueError(f"resize_size must be a positive int, got {resize_size!r}")
        self.crop_fraction, self.draft = crop_fraction, bool(draft)
        self.resize_size = resize_size or round(min(self.size) / crop_fraction)

    def geometry(self, w: int, h: int) -> Tuple[int, int, int, int]:
        """``(rw, rh, left, top)``: torchvision's resized size and the crop's offset in it
        (negative where CenterCrop pads)."""
        r, (oh, ow) = self.resize_size, self.size
        rw, rh = (r, int(r * h / w)) if w <= h else (int(r * w / h), r)

        def offset(image: int, crop: int) -> int:
            return int(round((image - crop) / 2.0)) if crop <= image else -((crop - image) // 2)
        return rw, rh, offset(rw, ow), offset(rh, oh)

    def box(self, w, h):
        """The source region the output covers (beyond the image where it is padded)."""
        rw, rh, left, top = self.geometry(w, h)
        oh, ow = self.size
        sx, sy = w / rw, h / rh
        return left * sx, top * sy, (left + ow) * sx, (top + oh) * sy

    def decode_crop(self, data: bytes):
        im = stored_image(data)
        w, h = im.size
        rw, rh, left, top = self.geometry(w, h)
        oh, ow = self.size
        if self.draft and im.format in JPEG_FORMATS:
            im.draft("RGB", (4 * rw, 4 * rh))
        im = im.convert("RGB")
        sx, sy = im.size[0] / rw, im.size[1] / rh  # decoded pixels per resized pixel
        # The output pixels that fall on the resized image; the rest is CenterCrop's padding.
        j0, j1 = max(0, -left), min(ow, rw - left)
        i0, i1 = max(0, -top), min(oh, rh - top)
        box = ((left + j0) * sx, (top + i0) * sy, (left + j1) * sx, (top + i1) * sy)
        part = im.resize((j1 - j0, i1 - i0), Image.BILINEAR, box=box, reducing_gap=None)
        if (j0, i0, j1, i1) != (0, 0, ow, oh):
            canvas = Image.new("RGB", (ow, oh))
            canvas.paste(part, (j0, i0))
            part = canvas
        return image_to_tensor(part), self.box(w, h), False


class DecodeLetterbox(CropDecoder):
    """YOLO's letterbox fused into the decode: fit ``size``, keeping the aspect ratio (never up
    with ``scale_up=False``), centred on a ``fill`` canvas; boxes follow. ``resize``: see base."""

    def __init__(self, size, fill: int = 114, scale_up: bool = True, resize: str = "auto"):
        super().__init__(size, resize)
        if not 0 <= fill <= 255:
            raise ValueError(f"fill must be a grey level 0..255, got {fill}")
        self.fill, self.scale_up = int(fill), bool(scale_up)

    def decode_crop(self, data: bytes):
        im = stored_image(data)
        w, h = im.size
        oh, ow = self.size
        r = min(oh / h, ow / w)
        if not self.scale_up:
            r = min(r, 1.0)
        nw, nh = max(1, round(w * r)), max(1, round(h * r))
        top, left = (oh - nh) // 2, (ow - nw) // 2
        if im.format in JPEG_FORMATS:
            im.draft("RGB", (nw, nh))
        im = im.convert("RGB")
        crop = (-left / r, -top / r, (ow - left) / r, (oh - top) / r)
        if not self.torch_resize():
            canvas = Image.new("RGB", (ow, oh), (self.fill,) * 3)
            canvas.paste(im.resize((nw, nh), Image.BILINEAR, reducing_gap=None), (left, top))
            return image_to_tensor(canvas), crop, False
        import torch
        out = torch.full((oh, ow, 3), self.fill, dtype=torch.uint8)
        out[top:top + nh, left:left + nw] = torch_resized(im, (nh, nw)).permute(1, 2, 0)
        return out.permute(2, 0, 1), crop, False


@functools.lru_cache(maxsize=None)
def pillow_simd() -> bool:
    """Whether this process decodes with Pillow-SIMD (asked once)."""
    from .._util.system import pil_info
    return bool(pil_info()["simd"])
