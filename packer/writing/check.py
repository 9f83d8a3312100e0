"""Build-time image checks: decode each file as deeply as training will, or say why not;
optionally transcode it to a smaller baseline JPEG."""
from __future__ import annotations

import io
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Optional, Tuple

from PIL import Image, UnidentifiedImageError

from ..errors import PackerError
from ..format.images import (DEFAULT_MAX_PIXELS, IMAGE_FORMATS, JPEG_FORMATS, orientation_of,
                             pil_open)


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
                raise PackerError(f"{name} must be at least 16 pixels, got {v}")
        if not 1 <= self.quality <= 100:
            raise PackerError(f"quality must be in 1..100, got {self.quality}")

    def target_size(self, w: int, h: int) -> Tuple[int, int]:
        scale = min(self.max_side / max(w, h) if self.max_side else 1.0,
                    self.short_side / min(w, h) if self.short_side else 1.0)
        if scale >= 1.0:
            return w, h
        return max(1, round(w * scale)), max(1, round(h * scale))


# Largest image file read (bounds a worker's memory): default max_pixels at 12 bytes a pixel
DEFAULT_MAX_IMAGE_BYTES = 1 << 30


@dataclass(frozen=True)
class Checks:
    """What a build or write refuses, set by whoever runs it, never by the data: ``strict`` fails
    on the first bad image or annotation; ``max_pixels`` and ``max_image_bytes`` skip larger
    images. Only regular files are read as images."""
    strict: bool = False
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES

    def __post_init__(self):
        if not isinstance(self.strict, bool):
            raise PackerError(f"Checks(strict): True or False, got {self.strict!r}")
        for name, unit in (("max_pixels", "pixel"), ("max_image_bytes", "byte")):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PackerError(f"{name} must be a positive {unit} count, got {v!r}")

    def options(self) -> dict:
        """The manifest's record of them."""
        return asdict(self)


def as_checks(checks) -> Checks:
    """``checks`` itself, or a PackerError saying what ``checks=`` takes."""
    if not isinstance(checks, Checks):
        raise PackerError(f"checks must be packer.Checks(strict=..., max_pixels=..., "
                          f"max_image_bytes=...), got {type(checks).__name__}")
    return checks


@dataclass
class Checked:
    """A validated image, ready to store."""
    data: bytes
    width: int
    height: int
    format: str
    mode: str
    orientation: int = 1  # the EXIF orientation (1-8) where asked for, as exif_transpose reads it


class BadImage(Exception):
    """Why one file cannot be packed; the message goes into the manifest's skip list."""


def check_image(data: bytes, *, transcode: Optional[Transcode] = None,
                max_pixels: int = DEFAULT_MAX_PIXELS, orientation: bool = False) -> Checked:
    """Decode ``data`` as deeply as training will, or raise BadImage with a readable reason
    (JPEGs in draft mode: every entropy-coded byte still parsed); ``orientation``: read EXIF too."""
    if not data:
        raise BadImage("empty file")
    with warnings.catch_warnings(), _pil_pixel_limit(max_pixels):
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with pil_open(data) as im:
                fmt, mode, (w, h) = im.format or "?", im.mode, im.size
                if w * h > max_pixels:
                    raise BadImage(f"decompression bomb: {w}x{h} = {w * h} pixels "
                                   f"exceeds max_pixels={max_pixels}")
                if transcode is not None:
                    done = _transcode(im, transcode)
                    return done if orientation else replace(done, orientation=1)
                if fmt in JPEG_FORMATS and mode in ("RGB", "L", "CMYK"):
                    im.draft(mode, (max(1, w // 8), max(1, h // 8)))
                im.load()  # multi-frame files (TIFF pages) train on frame 0, as in ImageFolder
                if fmt == "TIFF":  # loaded upright by its orientation tag: the size readers get
                    w, h = im.size  # (Pillow < 11 gives the stored one at open)
                # after the load: a PNG's EXIF may follow its pixels (orientation_of takes an
                # error for "no EXIF")
                turn = orientation_of(im) if orientation else 1
                if im.mode != "RGB":  # training calls convert("RGB"): some modes cannot
                    try:
                        im.convert("RGB")
                    except Exception as e:
                        raise BadImage(f"cannot be converted to RGB as training does (mode "
                                       f"{im.mode}): {str(e).strip() or type(e).__name__}") \
                            from None
        except BadImage:
            raise
        except Exception as e:  # PIL raises a zoo of types on bad data; all mean "skip this file"
            raise BadImage(_reason(e)) from None
    return Checked(data, w, h, fmt, mode, turn)


@contextmanager
def _pil_pixel_limit(max_pixels: int):
    """PIL's own bomb check (warn above ``Image.MAX_IMAGE_PIXELS``, refuse above twice that)
    raised to ``max_pixels`` meanwhile, so it skips nothing ``--max-pixels`` allows."""
    saved = Image.MAX_IMAGE_PIXELS
    if saved is not None and max_pixels > saved:
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _reason(e: BaseException) -> str:
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, UnidentifiedImageError):
        return f"not an image packer opens (formats: {', '.join(IMAGE_FORMATS)})"
    if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"decompression bomb: {msg}"
    if "truncated" in msg.lower():
        return f"truncated: {msg}"
    return f"corrupt ({type(e).__name__}): {msg}"


def _transcode(im: Image.Image, t: Transcode) -> Checked:
    w, h = im.size
    tw, th = t.target_size(w, h)
    if im.format in JPEG_FORMATS and (tw, th) != (w, h):
        im.draft("RGB", (tw, th))  # decode at the nearest DCT scale >= target, then resize
    rgb = to_rgb(im)  # decoded first: then im.info holds EXIF that follows a PNG's pixels
    exif, turn = im.info.get("exif"), orientation_of(im)
    if rgb.size != (tw, th):
        rgb = rgb.resize((tw, th), Image.BICUBIC, reducing_gap=None)

    def encode(exif: Optional[bytes]) -> bytes:
        out = io.BytesIO()
        rgb.save(out, "JPEG", quality=t.quality, optimize=False, progressive=False,
                 **({"exif": exif} if exif else {}))
        return out.getvalue()
    data = encode(exif)
    if orientation_of(pil_open(data)) != turn:  # the turn was only in XMP, which is not kept
        only = Image.Exif()
        only[0x0112] = turn
        data = encode(only.tobytes())
    return Checked(data, tw, th, "JPEG", "RGB", turn)


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
