"""Which image decoders packer lets PIL use, at build and at read: a fixed list, whatever a file
is called, so a stranger's file never reaches Ghostscript or a decoder that reads other files."""
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
