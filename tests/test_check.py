"""packer/check.py: check_image on good files, the reasons it gives, Transcode."""
from __future__ import annotations

import io
import random

import pytest
from PIL import Image

from packer import Transcode
from packer.writing.check import BadImage, Checked, check_image, to_rgb
from packer.demo import load_photos, make_image
from packer.errors import PackerError


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


@pytest.fixture(scope="module")
def photo_jpeg() -> bytes:
    """A photo-like JPEG, shorter side 300-500 px."""
    return make_image(random.Random(2), load_photos())


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    return load_photos()[1].resize((320, 200), Image.BICUBIC)


# -- check_image -------------------------------------------------------------------------------

def test_check_real_jpeg(photo_jpeg):
    w, h = Image.open(io.BytesIO(photo_jpeg)).size
    c = check_image(photo_jpeg)
    assert isinstance(c, Checked)
    assert (c.width, c.height, c.format, c.mode) == (w, h, "JPEG", "RGB")
    assert c.data is photo_jpeg  # stored as is, never re-encoded


@pytest.mark.parametrize("mode, fmt, want_mode", [
    ("RGB", "PNG", "RGB"), ("RGBA", "PNG", "RGBA"), ("L", "PNG", "L"), ("P", "PNG", "P"),
    ("L", "JPEG", "L"), ("CMYK", "JPEG", "CMYK"), ("RGB", "BMP", "RGB"), ("RGB", "TIFF", "RGB"),
])
def test_check_modes_and_formats(photo, mode, fmt, want_mode):
    data = encode(photo.convert(mode), fmt)
    c = check_image(data)
    assert (c.width, c.height, c.format, c.mode) == (320, 200, fmt, want_mode)
    assert c.data == data


def test_empty_file():
    with pytest.raises(BadImage, match="^empty file$"):
        check_image(b"")


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_truncated_jpeg(photo_jpeg, keep):
    data = photo_jpeg[:int(len(photo_jpeg) * keep)]
    with pytest.raises(BadImage, match="^truncated: "):
        check_image(data)
    with pytest.raises(OSError):  # ImageFolder's loader fails on it too
        Image.open(io.BytesIO(data)).convert("RGB")


def test_not_an_image():
    with pytest.raises(BadImage, match=r"^not an image packer opens \(formats: JPEG, PNG, "):
        check_image(b"%PDF-1.4\n" + bytes(range(256)) * 4)


def test_bad_image_is_not_a_packer_error():
    # one file's problem, recorded in the skip list; not a user-facing failure of the build
    assert not issubclass(BadImage, PackerError)


# -- Transcode ---------------------------------------------------------------------------------

@pytest.mark.parametrize("t, size, want", [
    (Transcode(), (500, 375), (500, 375)),
    (Transcode(max_side=256), (500, 375), (256, 192)),
    (Transcode(max_side=256), (375, 500), (192, 256)),
    (Transcode(max_side=1000), (500, 375), (500, 375)),  # never upscales
    (Transcode(short_side=160), (500, 375), (213, 160)),
    (Transcode(short_side=160), (100, 80), (100, 80)),
    (Transcode(max_side=300, short_side=160), (500, 375), (213, 160)),  # the tighter one wins
    (Transcode(max_side=300, short_side=250), (500, 375), (300, 225)),
    (Transcode(max_side=16), (5000, 10), (16, 1)),  # never a 0-pixel side
])
def test_target_size(t, size, want):
    assert t.target_size(*size) == want


@pytest.mark.parametrize("kw, name", [
    (dict(max_side=15), "max_side"), (dict(max_side=0), "max_side"), (dict(short_side=8), "short_side"),
    (dict(quality=0), "quality"), (dict(quality=101), "quality"), (dict(quality=-5), "quality"),
])
def test_transcode_validation(kw, name):
    with pytest.raises(PackerError, match=rf"^{name} must be"):
        Transcode(**kw)


def test_transcode_accepts_the_limits():
    assert Transcode(max_side=16, short_side=16, quality=1).quality == 1
    assert Transcode(quality=100).max_side is None


def test_transcoding_shrinks_to_the_requested_sides(photo_jpeg):
    w, h = Image.open(io.BytesIO(photo_jpeg)).size
    t = Transcode(max_side=200, quality=85)
    c = check_image(photo_jpeg, transcode=t)
    assert (c.width, c.height) == t.target_size(w, h) and max(c.width, c.height) == 200
    assert (c.format, c.mode) == ("JPEG", "RGB")
    out = Image.open(io.BytesIO(c.data))
    assert out.format == "JPEG" and out.mode == "RGB" and out.size == (c.width, c.height)
    assert len(c.data) < len(photo_jpeg)
    assert "progression" not in out.info and "progressive" not in out.info  # baseline
    out.load()


def test_transcoding_a_png_gives_a_jpeg(photo):
    c = check_image(encode(photo.convert("RGBA"), "PNG"), transcode=Transcode(short_side=100))
    assert (c.width, c.height, c.format, c.mode) == (160, 100, "JPEG", "RGB")
    assert Image.open(io.BytesIO(c.data)).format == "JPEG"
    same = check_image(encode(photo, "PNG"), transcode=Transcode())  # no resize: still a JPEG
    assert (same.width, same.height, same.format) == (320, 200, "JPEG")


def test_transcoding_keeps_exif(photo):
    exif = Image.Exif()
    exif[0x0112] = 6
    c = check_image(encode(photo, "JPEG", quality=95, exif=exif.tobytes()), transcode=Transcode(max_side=100))
    assert Image.open(io.BytesIO(c.data)).getexif()[0x0112] == 6


def test_transcoding_keeps_an_orientation_only_in_xmp(photo):
    """PIL reads an orientation from XMP too (so the build records it), but a JPEG keeps only
    the EXIF given: without one, the transcoded image read back upright with turned boxes."""
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/'
           b'02/22-rdf-syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" '
           b'tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    c = check_image(encode(photo, "JPEG", quality=95, xmp=xmp), transcode=Transcode(max_side=100),
                    orientation=True)
    assert c.orientation == 6 and Image.open(io.BytesIO(c.data)).getexif()[0x0112] == 6


@pytest.mark.parametrize("transcode", [None, Transcode(max_side=100)])
def test_a_corrupt_png_is_refused_when_orientation_is_read_too(photo, transcode):
    """Reading a PNG's EXIF loads its pixels (its eXIf chunk may follow them); an error there
    must not pass for "no EXIF" and leave a half-decoded image to be stored."""
    from helpers import corrupt_png
    with pytest.raises(BadImage, match="^corrupt"):
        check_image(corrupt_png(photo), transcode=transcode, orientation=True)


def test_transcoding_a_broken_file_is_still_refused(photo_jpeg):
    with pytest.raises(BadImage, match="^truncated: "):
        check_image(photo_jpeg[:len(photo_jpeg) // 2], transcode=Transcode(max_side=100))


def test_to_rgb_transparency_on_white_and_16_bit_scaled():
    clear = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    assert to_rgb(clear).getpixel((0, 0)) == (255, 255, 255)
    assert clear.convert("RGB").getpixel((0, 0)) == (255, 0, 0)  # what plain convert would give
    grey16 = Image.new("I;16", (4, 4), 32768)
    assert to_rgb(grey16).getpixel((0, 0)) == (128, 128, 128)
    assert to_rgb(Image.new("L", (2, 2), 7)).getpixel((1, 1)) == (7, 7, 7)
