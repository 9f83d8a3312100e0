"""Which image decoders packer lets PIL use, at build and at read.

PIL picks a decoder by a file's content, not its name, and some of its decoders run other
programs (EPS, PostScript and PDF go through Ghostscript, a full programming language) or
read other files. A stranger's dataset must never reach those, so packer opens images only
through the fixed list below, whatever a file is called. Everything else is "not an image"
at build (skipped and listed) and a damaged record at read.
"""
from __future__ import annotations

import io

from PIL import Image

# PIL format names: what torchvision's IMG_EXTENSIONS hold (PPM covers .pgm), plus GIF.
# JPEG includes phone cameras' multi-picture JPEGs, which PIL reports as MPO.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
DEFAULT_MAX_PIXELS = 89_478_485  # PIL's own decompression-bomb threshold (~ 0.25 GiB RGB)


def pil_open(data: bytes) -> Image.Image:
    """``data`` opened lazily (nothing decoded yet) by one of ``IMAGE_FORMATS``' decoders;
    PIL's ``UnidentifiedImageError`` for anything else."""
    return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
