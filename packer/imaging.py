"""Everything PIL: which PIL is active, validation at build time, transcoding, decoding.

Decoding defaults to exactly what torchvision's ImageFolder loader does
(``Image.open(f).convert("RGB")``) so switching to packer changes no pixel. Two opt-in
speedups: JPEG *draft* decoding (the IDCT scales by 1/2, 1/4 or 1/8 for free when the
wanted size is known) and pack-time transcoding to smaller baseline JPEGs.
"""
from __future__ import annotations

import io
import math
import random
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Dict, Optional, Tuple

from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import PackerError

DEFAULT_MAX_PIXELS = 89_478_485  # PIL's own decompression-bomb threshold (~ 0.25 GiB RGB)


def pil_info() -> Dict[str, object]:
    """Which PIL is imported: Pillow-SIMD or stock Pillow, and whether libjpeg-turbo backs it."""
    from PIL import features
    flavour = "unknown"
    for dist in ("Pillow-SIMD", "pillow-simd", "Pillow", "pillow"):
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        flavour = "Pillow-SIMD" if "simd" in dist.lower() else "Pillow"
        break
    if flavour == "unknown" and ".post" in Image.__version__:
        flavour = "Pillow-SIMD"  # pillow-simd versions are X.Y.Z.postN
    return {
        "flavour": flavour,
        "version": Image.__version__,
        "simd": flavour == "Pillow-SIMD",
        "libjpeg_turbo": bool(features.check_feature("libjpeg_turbo")),
        "jpeg_version": features.version("libjpeg_turbo") or features.version("jpg"),
    }


def pil_summary() -> str:
    i = pil_info()
    jpeg = f"libjpeg-turbo {i['jpeg_version']}" if i["libjpeg_turbo"] else f"libjpeg {i['jpeg_version']}"
    hint = "" if i["simd"] else " (Pillow-SIMD adds SIMD resizes: scripts/install_pillow_simd.sh)"
    return f"{i['flavour']} {i['version']}, {jpeg}{hint}"


@dataclass(frozen=True)
class Transcode:
    """Pack-time re-encoding: every image becomes a baseline RGB JPEG, downscaled to fit."""
    max_side: Optional[int] = None    # longer side at most this many pixels
    short_side: Optional[int] = None  # shorter side at most this many pixels
    quality: int = 90

    def __post_init__(self):
        for name in ("max_side", "short_side"):
            v = getattr(self, name)
            if v is not None and v < 16:
                raise PackerError(f"--{name.replace('_', '-')} must be at least 16 pixels, got {v}")
        if not 1 <= self.quality <= 100:
            raise PackerError(f"--quality must be in 1..100, got {self.quality}")

    def target_size(self, w: int, h: int) -> Tuple[int, int]:
        scale = 1.0
        if self.max_side:
            scale = min(scale, self.max_side / max(w, h))
        if self.short_side:
            scale = min(scale, self.short_side / min(w, h))
        if scale >= 1.0:
            return w, h
        return max(1, round(w * scale)), max(1, round(h * scale))


@dataclass
class Checked:
    """A validated image, ready to store."""
    data: bytes
    width: int
    height: int
    format: str
    mode: str


class BadImage(Exception):
    """Why one file cannot be packed; the message goes into the manifest's skip list."""


def check_image(data: bytes, *, transcode: Optional[Transcode] = None,
                max_pixels: int = DEFAULT_MAX_PIXELS) -> Checked:
    """Decode ``data`` as deeply as training will, or raise BadImage with a readable reason.

    JPEGs are checked with draft (DCT-scaled) decoding: every entropy-coded byte is still
    parsed, so truncation and corruption are caught, at a fraction of a full decode's cost.
    """
    if not data:
        raise BadImage("empty file")
    with warnings.catch_warnings(), _pil_pixel_limit(max_pixels):
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data)) as im:
                fmt, mode, (w, h) = im.format or "?", im.mode, im.size
                if w * h > max_pixels:
                    raise BadImage(f"decompression bomb: {w}x{h} = {w * h} pixels "
                                   f"exceeds the limit of {max_pixels} (--max-pixels)")
                if transcode is not None:
                    return _transcode(im, transcode)
                if fmt == "JPEG" and mode in ("RGB", "L", "CMYK"):
                    im.draft(mode, (max(1, w // 8), max(1, h // 8)))
                im.load()  # multi-frame files (TIFF pages) train on frame 0, as in ImageFolder
                if im.mode != "RGB":  # training calls convert("RGB"): some modes cannot
                    try:
                        im.convert("RGB")
                    except Exception as e:
                        raise BadImage(f"cannot be converted to RGB as training does "
                                       f"(mode {im.mode}): {str(e).strip() or type(e).__name__}") from None
        except BadImage:
            raise
        except Exception as e:  # PIL raises a zoo of types on bad data; all mean "skip this file"
            raise BadImage(_reason(e)) from None
    return Checked(data, w, h, fmt, mode)


class _pil_pixel_limit:
    """PIL's own bomb check (warn above ``Image.MAX_IMAGE_PIXELS``, refuse above twice that)
    would skip images that ``--max-pixels`` allows: align it with ``max_pixels`` meanwhile.
    (Build workers are processes, so the module global is not shared with other threads.)"""

    def __init__(self, max_pixels: int):
        self.max_pixels = max_pixels

    def __enter__(self):
        self.saved = Image.MAX_IMAGE_PIXELS
        if self.saved is not None and self.max_pixels > self.saved:
            Image.MAX_IMAGE_PIXELS = self.max_pixels
        return self

    def __exit__(self, *exc):
        Image.MAX_IMAGE_PIXELS = self.saved
        return False


def _reason(e: BaseException) -> str:
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, UnidentifiedImageError):
        return "not an image (PIL cannot identify it)"
    if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"decompression bomb: {msg}"
    if "truncated" in msg.lower():
        return f"truncated: {msg}"
    return f"corrupt ({type(e).__name__}): {msg}"


def _transcode(im: Image.Image, t: Transcode) -> Checked:
    w, h = im.size
    tw, th = t.target_size(w, h)
    if im.format == "JPEG" and (tw, th) != (w, h):
        im.draft("RGB", (tw, th))  # decode at the nearest DCT scale >= target, then resize
    exif = im.info.get("exif")
    rgb = to_rgb(im)
    if rgb.size != (tw, th):
        rgb = rgb.resize((tw, th), Image.BICUBIC, reducing_gap=None)
    out = io.BytesIO()
    kwargs = {"exif": exif} if exif else {}
    rgb.save(out, "JPEG", quality=t.quality, optimize=False, progressive=False, **kwargs)
    return Checked(out.getvalue(), tw, th, "JPEG", "RGB")


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB for *transcoding*: like ``convert("RGB")``, but transparency goes on white and
    16-bit greys are scaled, not clipped. Reading keeps plain ``convert`` (ImageFolder's)."""
    if im.mode == "RGB":
        im.load()
        return im
    if im.mode.startswith("I;16") or im.mode == "I":
        return im.convert("I").point(lambda v: v / 256).convert("L").convert("RGB")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return im.convert("RGB")


def open_image(data: bytes, *, size_hint: Optional[Tuple[int, int]] = None,
               exif_orientation: bool = False) -> Image.Image:
    """Decode stored bytes to a PIL RGB image, as torchvision's default loader would.

    ``size_hint`` (w, h) allows JPEG draft decoding to the smallest DCT scale whose result is
    still at least that large: pixels then differ from a full decode, so it is opt-in.
    """
    im = Image.open(io.BytesIO(data))
    if size_hint is not None and im.format == "JPEG":
        im.draft("RGB", size_hint)
    if exif_orientation:
        im = ImageOps.exif_transpose(im)
    return im.convert("RGB")


# -- uint8 decoders: decode + crop + resize + flip in one PIL pass, no float tensors ----------

class _Decoder:
    """Base for ``bytes -> uint8 tensor (3, H, W)`` decoders used via ``PackedDataset(decode=)``.

    The tensor is a (3, H, W) view of a contiguous (H, W, 3) buffer: a batch stacked in HWC
    order is a channels_last NCHW batch with no copy.
    """

    def __init__(self, size):
        self.size = (size, size) if isinstance(size, int) else tuple(size)  # (h, w)

    def box(self, w: int, h: int) -> Tuple[float, float, float, float]:
        raise NotImplementedError

    def __call__(self, data: bytes):
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        x0, y0, x1, y1 = self.box(w, h)
        oh, ow = self.size
        if im.format == "JPEG":
            # Ask for the smallest DCT scale that keeps the crop at least output-sized.
            s = max(ow / (x1 - x0), oh / (y1 - y0))
            im.draft("RGB", (max(1, math.ceil(w * s)), max(1, math.ceil(h * s))))
            sx, sy = im.size[0] / w, im.size[1] / h
            x0, x1, y0, y1 = x0 * sx, x1 * sx, y0 * sy, y1 * sy
        im = im.convert("RGB").resize((ow, oh), Image.BILINEAR, box=(x0, y0, x1, y1),
                                      reducing_gap=None)
        if self.flip():
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return _to_tensor(im)

    def flip(self) -> bool:
        return False


def _to_tensor(im: Image.Image):
    import torch
    w, h = im.size
    buf = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return buf.view(h, w, 3).permute(2, 0, 1)


class DecodeRandomResizedCrop(_Decoder):
    """torchvision's RandomResizedCrop + RandomHorizontalFlip, fused into the decode.

    Drawing the crop box before decoding lets JPEGs decode at 1/2-1/8 scale when the crop
    is large relative to the output: most of a training decode's cost, skipped.
    Random numbers come from ``random``, which DataLoader seeds per worker.
    """

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: bool = True):
        super().__init__(size)
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


class DecodeCenterCrop(_Decoder):
    """Evaluation: resize the shorter side to ``size / crop_fraction`` then center-crop ``size``
    (torchvision's Resize(256) + CenterCrop(224) for the default 0.875), fused into the decode."""

    def __init__(self, size, crop_fraction: float = 0.875):
        super().__init__(size)
        if not 0 < crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction}")
        self.crop_fraction = crop_fraction

    def box(self, w, h):
        oh, ow = self.size
        # The crop covers crop_fraction of the shorter side (at the output aspect ratio).
        s = min(w, h) * self.crop_fraction / min(ow, oh)
        cw, ch = min(w, ow * s), min(h, oh * s)
        x, y = (w - cw) / 2, (h - ch) / 2
        return x, y, x + cw, y + ch
