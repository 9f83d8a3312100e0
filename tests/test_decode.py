"""packer/decode.py: ImageFolder's PIL RGB decode, the fused crop decoders, image_to_tensor."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from packer.transforms.decode import DecodeCenterCrop, DecodeLetterbox, DecodeRandomResizedCrop, image_to_tensor, open_image
from packer.demo import load_photos, make_image


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def as_tensor(im: Image.Image) -> torch.Tensor:
    """(3, H, W) uint8, built independently of packer."""
    w, h = im.size
    return torch.tensor(list(im.convert("RGB").tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)


def mean_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().mean().item()


@pytest.fixture(scope="module")
def photo_jpeg() -> bytes:
    """A photo-like JPEG (shorter side 300-500 px)."""
    return make_image(random.Random(1), load_photos())


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    return load_photos()[0].resize((240, 180), Image.BICUBIC)


# -- open_image --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["jpeg", "gray_jpeg", "png_rgba", "png_palette", "png_la", "bmp"])
def test_open_image_is_imagefolders_loader(photo, kind):
    data = {
        "jpeg": lambda: encode(photo, "JPEG", quality=90),
        "gray_jpeg": lambda: encode(photo.convert("L"), "JPEG", quality=90),
        "png_rgba": lambda: encode(photo.convert("RGBA"), "PNG"),
        "png_palette": lambda: encode(photo.convert("P", palette=Image.ADAPTIVE, colors=16), "PNG"),
        "png_la": lambda: encode(photo.convert("LA"), "PNG"),
        "bmp": lambda: encode(photo, "BMP"),
    }[kind]()
    got = open_image(data)
    want = Image.open(io.BytesIO(data)).convert("RGB")  # torchvision's pil_loader
    assert got.mode == "RGB" and got.size == want.size == (240, 180)
    assert got.tobytes() == want.tobytes()


def test_open_image_size_hint_is_a_draft_decode(photo_jpeg):
    full = open_image(photo_jpeg)
    w, h = full.size
    small = open_image(photo_jpeg, size_hint=(w // 4, h // 4))
    assert small.mode == "RGB"
    assert w // 4 <= small.size[0] < w and h // 4 <= small.size[1] < h  # at least the hint
    png = encode(full, "PNG")
    assert open_image(png, size_hint=(8, 8)).size == (w, h)  # only JPEGs draft


def test_open_image_exif_orientation(photo):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to display
    data = encode(photo, "JPEG", quality=90, exif=exif.tobytes())
    assert open_image(data).size == (240, 180)  # ImageFolder ignores EXIF orientation
    assert open_image(data, exif_orientation=True).size == (180, 240)


def test_multi_picture_jpegs_decode_as_jpegs(photo_jpeg):
    """A phone's multi-picture JPEG (PIL: MPO) is a JPEG whose first frame ImageFolder reads:
    the draft decodes take it as one, so it gives what the same JPEG alone gives."""
    first = Image.open(io.BytesIO(photo_jpeg))
    jpeg = encode(first, "JPEG", quality=90)
    mpo = encode(first, "MPO", quality=90, save_all=True, append_images=[first.rotate(90)])
    assert Image.open(io.BytesIO(mpo)).format == "MPO"
    assert open_image(mpo).tobytes() == open_image(jpeg).tobytes()
    w, h = first.size
    small = open_image(mpo, size_hint=(w // 4, h // 4))
    assert small.size[0] < w and small.tobytes() == open_image(
        jpeg, size_hint=(w // 4, h // 4)).tobytes()
    for decoder in (DecodeCenterCrop(48, draft=True), DecodeRandomResizedCrop(40, resize="pil"),
                    DecodeLetterbox(64, resize="pil")):
        random.seed(3)
        got = decoder(mpo)
        random.seed(3)
        assert torch.equal(got, decoder(jpeg)), type(decoder).__name__


# -- image_to_tensor ---------------------------------------------------------------------------

def test_image_to_tensor(photo):
    t = image_to_tensor(photo)
    assert t.shape == (3, 180, 240) and t.dtype == torch.uint8
    assert torch.equal(t, as_tensor(photo))
    assert tuple(t[:, 7, 11].tolist()) == photo.getpixel((11, 7))
    assert t.stride() == (1, 240 * 3, 3)  # a (3, H, W) view of an HWC buffer
    assert t.permute(1, 2, 0).is_contiguous()
    assert t.unsqueeze(0).is_contiguous(memory_format=torch.channels_last)


# -- the crop decoders -------------------------------------------------------------------------

def reference(data: bytes, box, size, flip=False) -> torch.Tensor:
    """The same crop from a full decode, with PIL only."""
    oh, ow = size
    im = Image.open(io.BytesIO(data)).convert("RGB").resize((ow, oh), Image.BILINEAR, box=box,
                                                            reducing_gap=None)
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    return as_tensor(im)


@pytest.mark.parametrize("decoder", [DecodeCenterCrop(64), DecodeCenterCrop((48, 80)),
                                     DecodeRandomResizedCrop(64), DecodeRandomResizedCrop((40, 56))])
def test_crop_decoders_shape_dtype_layout(photo_jpeg, decoder):
    random.seed(0)
    t = decoder(photo_jpeg)
    oh, ow = decoder.size
    assert t.shape == (3, oh, ow) and t.dtype == torch.uint8
    assert t.stride() == (1, ow * 3, 3)
    assert t.unsqueeze(0).is_contiguous(memory_format=torch.channels_last)
    assert torch.stack([t, t]).shape == (2, 3, oh, ow)


@pytest.mark.parametrize("decoder", [
    DecodeCenterCrop(64), DecodeCenterCrop((48, 64), crop_fraction=0.75),
    DecodeRandomResizedCrop(64, resize="pil"),
    DecodeRandomResizedCrop(96, scale=(0.5, 1), resize="pil")])
def test_crop_decoders_match_a_full_decode(photo_jpeg, photo, decoder):
    """JPEG draft decoding must crop the same region as a full decode would (box scaled)."""
    for seed in range(3):
        for data in (photo_jpeg, encode(photo, "PNG")):
            w, h = Image.open(io.BytesIO(data)).size
            random.seed(seed)
            box, flip = decoder.box(w, h), decoder.flip()
            random.seed(seed)
            got = decoder(data)
            want = reference(data, box, decoder.size, flip)
            if data[:2] == b"\xff\xd8":
                assert mean_abs_diff(got, want) < 12, (seed, box)
            else:
                assert torch.equal(got, want)


def test_center_crop_takes_the_center():
    im = Image.new("RGB", (400, 300), (0, 0, 255))
    im.paste((255, 0, 0), (100, 75, 300, 225))  # a red center, half of each side
    data = encode(im, "PNG")
    t = DecodeCenterCrop(32, crop_fraction=0.4)(data)  # 120 px of the 150 px red square
    assert torch.equal(t, torch.tensor([255, 0, 0], dtype=torch.uint8).view(3, 1, 1).expand(3, 32, 32))
    wide = DecodeCenterCrop(32, crop_fraction=1.0)(data)
    assert (wide[2] == 255).any() and (wide[0] == 255).any()  # border and center both in view


def test_center_crop_geometry_is_torchvisions():
    # Resize(256) of 500x375: 341x256 (341.33 truncated); CenterCrop(224): left
    # round(58.5) = 58 (halves to even), top 16; the box is that region of the source.
    d = DecodeCenterCrop(224)
    assert d.resize_size == 256 and d.geometry(500, 375) == (341, 256, 58, 16)
    assert d.geometry(375, 500) == (256, 341, 16, 58)
    assert d.geometry(333, 500) == (256, 384, 16, 80)
    x0, y0, x1, y1 = d.box(500, 375)
    assert (x0, x1) == pytest.approx((58 * 500 / 341, 282 * 500 / 341))
    assert (y0, y1) == pytest.approx((16 * 375 / 256, 240 * 375 / 256))
    assert DecodeCenterCrop(224, 0.95).resize_size == 236
    assert DecodeCenterCrop(224, resize_size=232).resize_size == 232
    # a crop wider than the resized image: CenterCrop pads, half on each side
    assert DecodeCenterCrop((32, 100), crop_fraction=1.0).geometry(60, 40) == (48, 32, -26, 0)


@pytest.mark.parametrize("w, h", [(500, 375), (500, 333), (333, 500), (640, 427), (375, 500)])
def test_center_crop_is_torchvisions_resize_and_center_crop(w, h):
    """ImageNet's common sizes, torchvision's evaluation transform on its PIL image: at most
    2 levels apart (the Pillow that is active here; packer docs/benchmarks.md has both)."""
    T = pytest.importorskip("torchvision.transforms")
    ref = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
    rng, photos = random.Random(w * h), load_photos()
    for _ in range(3):  # a crop of a real photo, sharpened, with grain; quality 75-95
        data = make_image(rng, photos, (w, h))
        got, want = DecodeCenterCrop(224)(data), ref(Image.open(io.BytesIO(data)).convert("RGB"))
        diff = (got.int() - want.int()).abs()
        assert got.shape == want.shape and int(diff.max()) <= 2 and diff.float().mean() < 0.01


@pytest.mark.parametrize("size, kw, w, h", [
    (224, dict(crop_fraction=0.95), 500, 375), (224, dict(resize_size=232), 640, 427),
    ((160, 200), dict(), 500, 333), (96, dict(crop_fraction=0.5), 120, 90),  # upscaled
    ((32, 100), dict(crop_fraction=1.0), 60, 40), ((100, 32), dict(), 45, 70)])  # padded
def test_center_crop_other_sizes_are_torchvisions(size, kw, w, h):
    T = pytest.importorskip("torchvision.transforms")
    d = DecodeCenterCrop(size, **kw)
    ref = T.Compose([T.Resize(d.resize_size), T.CenterCrop(d.size), T.PILToTensor()])
    data = make_image(random.Random(5), load_photos(), (w, h))
    got, want = d(data), ref(Image.open(io.BytesIO(data)).convert("RGB"))
    assert got.shape == want.shape and int((got.int() - want.int()).abs().max()) <= 2


def test_center_crop_draft_decodes_large_jpegs_smaller(photo):
    big = encode(photo.resize((2400, 1800), Image.BICUBIC), "JPEG", quality=90)
    exact, fast = DecodeCenterCrop(224), DecodeCenterCrop(224, draft=True)
    a, b = exact(big), fast(big)
    assert a.shape == b.shape == (3, 224, 224)
    assert mean_abs_diff(a, b) < 3  # close, not torchvision's: hence off by default
    with pytest.raises(ValueError, match="resize_size"):
        DecodeCenterCrop(224, resize_size=0)


def test_random_resized_crop_is_deterministic_under_random_seed(photo_jpeg):
    d = DecodeRandomResizedCrop(48)
    random.seed(123)
    a = [d(photo_jpeg) for _ in range(3)]
    random.seed(123)
    b = [d(photo_jpeg) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # but varies from call to call


def test_random_resized_crop_boxes_respect_scale_and_ratio():
    d = DecodeRandomResizedCrop(64, scale=(0.25, 0.5), ratio=(0.8, 1.25))
    random.seed(0)
    for _ in range(200):
        x0, y0, x1, y1 = d.box(500, 375)
        assert 0 <= x0 < x1 <= 500 and 0 <= y0 < y1 <= 375
        area = (x1 - x0) * (y1 - y0) / (500 * 375)
        assert 0.24 <= area <= 0.51
        assert 0.78 <= (x1 - x0) / (y1 - y0) <= 1.27


def test_random_resized_crop_flips_half_the_time():
    im = Image.new("RGB", (64, 64), (0, 0, 0))
    im.paste((255, 255, 255), (32, 0, 64, 64))  # left black, right white
    data = encode(im, "PNG")
    whole = DecodeRandomResizedCrop(16, scale=(1, 1), ratio=(1, 1))
    random.seed(1)
    lefts = [whole(data)[0, 8, 0].item() for _ in range(100)]
    assert set(lefts) == {0, 255} and 25 < lefts.count(255) < 75
    never = DecodeRandomResizedCrop(16, scale=(1, 1), ratio=(1, 1), flip=False)
    assert {never(data)[0, 8, 0].item() for _ in range(20)} == {0}


def test_random_resized_crop_fallback_for_extreme_shapes():
    d = DecodeRandomResizedCrop(32, scale=(0.9, 1.0), ratio=(1, 1))
    random.seed(0)
    x0, y0, x1, y1 = d.box(1000, 10)  # no square of 90% area fits: center crop at the ratio
    assert (x1 - x0, y1 - y0) == (10, 10) and x0 == 495


@pytest.mark.parametrize("kw", [dict(scale=(0, 1)), dict(scale=(0.5, 0.2)), dict(scale=(0.1, 1.5)),
                                dict(ratio=(0, 1)), dict(ratio=(2, 1)), dict(ratio=(-1, 1))])
def test_random_resized_crop_bad_arguments(kw):
    with pytest.raises(ValueError, match="scale must be within"):
        DecodeRandomResizedCrop(224, **kw)



@pytest.mark.parametrize("cls", [DecodeRandomResizedCrop, DecodeCenterCrop, DecodeLetterbox])
def test_sizes_as_torchvision_reads_them_or_refused_at_once(cls, photo_jpeg):
    assert cls([64]).size == (64, 64) == cls(64).size  # [s]: s x s, as in torchvision
    assert cls(np.int64(64)).size == (64, 64) == cls((np.int64(64), 64)).size
    assert cls((48, 64)).size == (48, 64) and cls(64)(photo_jpeg).shape[0] == 3
    assert cls(64.0).size == (64, 64) == cls((64.0, 64)).size  # whole numbers, as ints
    for bad in (0, True, (0, 0), (64, 64, 3), (), (-1, 64), (64.5, 64), "64"):
        with pytest.raises(ValueError, match="size must be a positive int or"):
            cls(bad)
@pytest.mark.parametrize("fraction", [0, -0.5, 1.01, 2])
def test_center_crop_bad_fraction(fraction):
    with pytest.raises(ValueError, match="crop_fraction must be in"):
        DecodeCenterCrop(224, crop_fraction=fraction)


@pytest.mark.parametrize("size, scale_up", [((320, 480), True), ((640, 640), True),
                                            ((1000, 1200), False)])
def test_letterbox_backends_agree_with_a_pil_reference(photo_jpeg, size, scale_up):
    """Both resizers give PIL's BILINEAR pixels inside the letterbox, grey 114 outside."""
    from packer.transforms.decode import DecodeLetterbox
    im = Image.open(io.BytesIO(photo_jpeg)).convert("RGB")
    w, h = im.size
    oh, ow = size
    r = min(oh / h, ow / w) if scale_up else min(oh / h, ow / w, 1.0)
    nw, nh = round(w * r), round(h * r)
    top, left = (oh - nh) // 2, (ow - nw) // 2
    ref = torch.full((3, oh, ow), 114, dtype=torch.uint8)
    ref[:, top:top + nh, left:left + nw] = as_tensor(im.resize((nw, nh), Image.BILINEAR,
                                                               reducing_gap=None))
    for backend in ("pil", "torch"):
        out, crop, flipped = DecodeLetterbox(size, scale_up=scale_up, resize=backend).decode_crop(
            photo_jpeg)
        assert out.shape == (3, oh, ow) and out.dtype == torch.uint8 and not flipped
        assert mean_abs_diff(out, ref) < 1.0, backend  # draft decoding may differ a little
        pad = torch.ones(oh, ow, dtype=torch.bool)
        pad[top:top + nh, left:left + nw] = False
        assert bool((out[:, pad] == 114).all())
        assert crop == pytest.approx((-left / r, -top / r, (ow - left) / r, (oh - top) / r))


def test_letterbox_torch_resize_stays_channels_last(photo_jpeg, monkeypatch):
    """The torch resize gets a (1, 3, h, w) input whose batch stride is the image's size: an
    unambiguous channels_last layout, so torch resizes HWC to HWC with its uint8 kernel. With
    a batch stride of 3 (``x[None]``) it wrote a contiguous NCHW output and repacked it: the
    same pixels at twice the time (docs/benchmarks.md)."""
    import torch.nn.functional as F
    from packer.transforms.decode import DecodeLetterbox
    seen = []
    real = F.interpolate

    def spy(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        seen.append((x.stride(0) == x.numel(),
                     out.is_contiguous(memory_format=torch.channels_last)))
        return out

    monkeypatch.setattr(F, "interpolate", spy)
    DecodeLetterbox((640, 640), resize="torch")(photo_jpeg)
    assert seen == [(True, True)]


@pytest.mark.parametrize("size, scale", [(64, (0.08, 1.0)), ((40, 56), (0.5, 1.0)), (224, (0.9, 1))])
def test_torch_resize_crops_whole_pixels_and_says_which(photo_jpeg, photo, size, scale):
    """resize="torch": the box rounded to whole pixels of the decoded image, resized by
    torch's uint8 kernel (PIL's BILINEAR of that crop), flipped as drawn; the crop it
    reports is the one it took, so boxes that follow it stay exact."""
    d = DecodeRandomResizedCrop(size, scale=scale, resize="torch")
    oh, ow = d.size
    for seed in range(4):
        for data in (photo_jpeg, encode(photo, "PNG")):
            random.seed(seed)
            got, crop, flipped = d.decode_crop(data)
            assert got.shape == (3, oh, ow) and got.stride() == (1, ow * 3, 3)
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            random.seed(seed)
            drawn = d.box(w, h)
            assert flipped == d.flip()
            assert all(abs(a - b) <= 8 for a, b in zip(crop, drawn))  # at most one 1/8 pixel
            if data[:2] != b"\xff\xd8":  # no draft: whole pixels of the stored image
                assert crop == tuple(round(v) for v in drawn)
                want = im.convert("RGB").crop(crop).resize((ow, oh), Image.BILINEAR,
                                                           reducing_gap=None)
                if flipped:
                    want = want.transpose(Image.FLIP_LEFT_RIGHT)
                assert mean_abs_diff(got, as_tensor(want)) < 0.5


def test_resize_auto_is_torch_unless_pillow_simd(photo_jpeg, monkeypatch):
    import packer.transforms.decode as decode
    for simd, torch_path in ((False, True), (True, False)):
        monkeypatch.setattr(decode, "pillow_simd", lambda simd=simd: simd)
        assert DecodeRandomResizedCrop(64).torch_resize() is torch_path
        assert decode.DecodeLetterbox(64).torch_resize() is torch_path
    assert DecodeRandomResizedCrop(64, resize="torch").torch_resize()
    assert not DecodeRandomResizedCrop(64, resize="pil").torch_resize()
    assert not DecodeCenterCrop(64).torch_resize()  # evaluation: PIL's exact sub-pixel box
    with pytest.raises(ValueError, match="resize must be"):
        DecodeRandomResizedCrop(64, resize="cv2")
