"""Which image decoders packer lets PIL use, at build and at read: a fixed list, whatever a file
is called, so a stranger's file never reaches Ghostscript or a decoder that reads other files;
and which files are JPEGs and how an EXIF orientation is read, the same at both ends."""
from __future__ import annotations

import io

from PIL import Image

# PIL format names: torchvision's IMG_EXTENSIONS (PPM covers .pgm) and GIF; JPEG covers MPO.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
# What PIL calls a JPEG file: a multi-picture JPEG's first frame is a JPEG (it drafts as one).
JPEG_FORMATS = ("JPEG", "MPO")
DEFAULT_MAX_PIXELS = 89_478_485  # PIL's own decompression-bomb threshold (~ 0.25 GiB RGB)

# The turn PIL's ``ImageOps.exif_transpose`` applies for each EXIF orientation (1: none).
EXIF_TURNS = {2: Image.FLIP_LEFT_RIGHT, 3: Image.ROTATE_180, 4: Image.FLIP_TOP_BOTTOM,
              5: Image.TRANSPOSE, 6: Image.ROTATE_270, 7: Image.TRANSVERSE, 8: Image.ROTATE_90}


def pil_open(data: bytes) -> Image.Image:
    """``data`` opened lazily by an ``IMAGE_FORMATS`` decoder, or PIL's UnidentifiedImageError."""
    return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)


def orientation_of(im: Image.Image) -> int:
    """The EXIF orientation (1-8) ``exif_transpose`` applies to ``im`` once loaded; 1 for none, a
    bad value, EXIF that does not parse, and a TIFF (PIL's decoder turns it upright itself)."""
    if im.format == "TIFF":
        return 1
    try:
        value = im.getexif().get(0x0112, 1)
    except Exception:  # PIL raises a zoo of types on bad EXIF
        return 1
    return value if type(value) is int and 1 <= value <= 8 else 1
