"""Crop boxes (packer.gpu.augment), the fused crop + resize kernel (packer.gpu.resample,
Triton) and its CPU reference, against torchvision's rules and PIL.

On a CPU machine the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set in a
subprocess because Triton reads it when the kernel is defined): the same source the GPU
compiles, checked against PIL and against the plain-torch reference on real photo crops.
Tests marked ``gpu`` run it compiled, on nvJPEG's output, and inside GPUDecoder.
"""
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from PIL import Image

from packer.errors import FormatError
from packer.gpu import GPUDecoder, GPUOptions, make_gpu_loader
from packer.gpu.augment import center_crop_boxes, random_resized_crop_boxes
from packer.gpu.resample import ImageTable, resample_crops

from packer.transforms.decode import DecodeCenterCrop, DecodeRandomResizedCrop

from helpers import cuda, photo_images, rgb_tensor

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

# Runs in a subprocess under the interpreter; prints one JSON line per case. The interpreter
# runs each program op by op, so the batch is the smallest that takes every path of the kernel:
# HWC and planar strides, flipped and not, downscale (filter wider than a pixel) and upscale,
# two row blocks (the second partial) and a column block wider than the output (masked).
# The uint8 store runs in every case; the float store (scale, shift, channels_last) and the
# ImageTable argument once, in "train".
_INTERPRETED = textwrap.dedent("""
    import json, os, random, sys
    import torch
    from PIL import Image
    from packer.demo import load_photos
    from packer.gpu.augment import center_crop_boxes, random_resized_crop_boxes
    from packer.gpu.resample import CONFIG, ImageTable, resample_crops

    def reference(*args, **kw):  # the same call without the interpreter: the torch reference
        os.environ["TRITON_INTERPRET"] = "0"
        try:
            return resample_crops(*args, **kw)
        finally:
            os.environ["TRITON_INTERPRET"] = "1"

    def rgb(im):
        px = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
        return px.view(im.height, im.width, 3).permute(2, 0, 1)      # HWC memory, like a CPU decode

    rng, photos = random.Random(7), load_photos()
    pil = []
    for w, h in [(32, 24), (20, 28), (40, 14)]:
        im = None
        while im is None or float(rgb(im).float().std()) < 20:    # detail, not a patch of sky
            base = rng.choice(photos)
            x, y = rng.randint(0, base.width - 2 * w), rng.randint(0, base.height - 2 * h)
            im = base.crop((x, y, x + 2 * w, y + 2 * h)).resize((w, h), Image.BICUBIC)
        pil.append(im)
    imgs = [rgb(im) for im in pil]
    imgs[1] = imgs[1].contiguous()                                   # planar, like nvJPEG's
    sizes = torch.tensor([[im.height, im.width] for im in pil])
    g = torch.Generator().manual_seed(3)
    size = (10, 12)
    assert CONFIG["rows"] < size[0] < 2 * CONFIG["rows"] and size[0] % CONFIG["rows"]
    cases = {"train": (random_resized_crop_boxes(sizes, generator=g), torch.tensor([1, 0, 1]).bool()),
             "eval": (center_crop_boxes(sizes, size, 0.8), None),  # the crops lie on each image,
             "upscale": (torch.tensor([[1.0, 2.0, 5.0, 6.5]] * 3), torch.tensor([0, 1, 0]).bool())}
    for name, (boxes, flips) in cases.items():
        out = lambda: torch.empty(3, 3, *size, dtype=torch.uint8)
        fused = resample_crops(imgs, boxes, size, flips, out=out())
        plain = reference(imgs, boxes, size, flips, out=out())
        pil_max = 0
        for k, im in enumerate(pil):
            ref = im.resize(size[::-1], Image.BILINEAR, box=tuple(boxes[k].tolist()), reducing_gap=None)
            if flips is not None and flips[k]:
                ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
            pil_max = max(pil_max, int((rgb(ref).int() - fused[k].int()).abs().max()))
        case = {"case": name, "vs_pil_max": pil_max,
                "vs_reference_max": int((fused.int() - plain.int()).abs().max())}
        if name == "train":
            again = resample_crops(ImageTable.from_images(imgs), boxes, size, flips, out=out())
            scale, shift = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1.0, -2.0, 3.0])
            f = resample_crops(imgs, boxes, size, flips, scale=scale, shift=shift,
                               out=torch.empty(3, 3, *size).contiguous(memory_format=torch.channels_last))
            fr = reference(imgs, boxes, size, flips, scale=scale.view(1, 3, 1, 1),
                           shift=shift.view(1, 3, 1, 1))
            case.update(table_equal=bool(torch.equal(fused, again)),
                        float_vs_reference_max=float((f - fr).abs().max()),
                        float_channels_last=f.is_contiguous(memory_format=torch.channels_last))
        print(json.dumps(case))
""")


def test_kernel_matches_pil_and_reference_in_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cases = {c["case"]: c for c in map(json.loads, run.stdout.splitlines())}
    assert set(cases) == {"train", "eval", "upscale"}
    for name, c in cases.items():
        # PIL rounds to uint8 between its two passes, the kernel does not: at most 1 level.
        assert c["vs_pil_max"] <= 1, (name, c)
        assert c["vs_reference_max"] <= 1, (name, c)
    train = cases["train"]
    assert train["table_equal"], train
    assert train["float_vs_reference_max"] < 1e-2 and train["float_channels_last"], train


# -- crop boxes --------------------------------------------------------------------------------

def test_random_resized_crop_boxes_match_torchvision_rules():
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([[375, 500], [500, 333], [300, 300], [480, 640]] * 500)
    b = random_resized_crop_boxes(sizes, (0.08, 1.0), (3 / 4, 4 / 3), generator=g)
    w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    assert torch.equal(b, b.round()) and (b[:, :2] >= 0).all()
    assert (b[:, 2] <= sizes[:, 1]).all() and (b[:, 3] <= sizes[:, 0]).all()
    frac = w * h / (sizes[:, 0] * sizes[:, 1])
    assert frac.min() >= 0.07 and frac.max() <= 1.0
    ar = w / h
    assert ar.min() > 0.7 and ar.max() < 1.43  # ratio range, widened by integer rounding
    # Same distribution as the CPU decoder's per-image sampler.
    random.seed(0)
    ref = DecodeRandomResizedCrop(224)
    cpu = torch.tensor([ref.box(int(s[1]), int(s[0])) for s in sizes.tolist()], dtype=torch.float64)
    cfrac = (cpu[:, 2] - cpu[:, 0]) * (cpu[:, 3] - cpu[:, 1]) / (sizes[:, 0] * sizes[:, 1])
    assert abs(frac.mean() - cfrac.mean()) < 0.03
    # Centre of crops: uniform placement, so about the image centre on average.
    cx = ((b[:, 0] + b[:, 2]) / 2 / sizes[:, 1]).mean()
    assert abs(cx - 0.5) < 0.02


def test_random_resized_crop_fallback_is_torchvisions():
    sizes = torch.tensor([[20, 1000], [1000, 20], [300, 300]])
    g = torch.Generator().manual_seed(1)
    b = random_resized_crop_boxes(sizes, (0.9, 1.0), (3 / 4, 4 / 3), generator=g)
    for (hh, ww), box in zip(sizes.tolist()[:2], b.tolist()[:2]):
        ref = DecodeRandomResizedCrop(224, scale=(0.9, 1.0)).box(ww, hh)  # no try fits
        assert tuple(box) == tuple(float(v) for v in ref)


@pytest.mark.parametrize("size,frac", [((224, 224), 0.875), ((160, 128), 0.9), ((224, 224), 1.0)])
def test_center_crop_boxes_match_cpu_decoder(size, frac):
    sizes = torch.tensor([[375, 500], [500, 333], [100, 1000], [224, 224]])
    b = center_crop_boxes(sizes, size, frac)
    ref = DecodeCenterCrop(size, crop_fraction=frac)
    for (hh, ww), box in zip(sizes.tolist(), b.tolist()):
        assert box == pytest.approx(ref.box(ww, hh))


# -- the resample's CPU reference (the kernel's maths in torch) --------------------------------

@pytest.mark.parametrize("train", [True, False])
def test_resample_crops_matches_pil(photos, train):
    pil = photo_images(photos, 6)
    imgs = [rgb_tensor(im) for im in pil]
    sizes = torch.tensor([[im.height, im.width] for im in pil])
    g = torch.Generator().manual_seed(2)
    if train:
        boxes = random_resized_crop_boxes(sizes, generator=g)
        flips = torch.tensor([True, False] * 3)
    else:
        boxes, flips = center_crop_boxes(sizes, (224, 224)), None
    out = resample_crops(imgs, boxes, (224, 224), flips,
                         out=torch.empty(6, 3, 224, 224, dtype=torch.uint8))
    worst, total = 0, 0.0
    for k, im in enumerate(pil):
        ref = im.resize((224, 224), Image.BILINEAR, box=tuple(boxes[k].tolist()), reducing_gap=None)
        if flips is not None and flips[k]:
            ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
        d = (rgb_tensor(ref).int() - out[k].int()).abs()
        worst, total = max(worst, int(d.max())), total + float(d.float().mean())
    assert worst <= 1 and total / 6 < 0.3  # PIL rounds between its two passes; we do not
    # The output's memory format and the input's layout change nothing.
    last = resample_crops(ImageTable.from_images([im.contiguous() for im in imgs]), boxes,
                          (224, 224), flips, out=torch.empty(6, 3, 224, 224, dtype=torch.uint8)
                          .contiguous(memory_format=torch.channels_last))
    assert torch.equal(last, out)
    # Normalisation: x * scale + shift on the unrounded values.
    scale = (1 / (255 * torch.tensor(STD))).view(1, 3, 1, 1)
    shift = (-torch.tensor(MEAN) / torch.tensor(STD)).view(1, 3, 1, 1)
    f = resample_crops(imgs, boxes, (224, 224), flips, scale=scale, shift=shift)
    expect = (out.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert (f - expect).abs().max() < 0.6 / 255 / min(STD)


def test_resample_crops_upscale_and_rectangular(photos):
    im = photo_images(photos, 1, seed=5)[0]
    box = torch.tensor([[10.0, 20.0, 50.0, 40.0]])  # 40 x 20 -> 96 x 128 (upscaling)
    out = resample_crops([rgb_tensor(im)], box, (96, 128),
                         out=torch.empty(1, 3, 96, 128, dtype=torch.uint8))
    ref = rgb_tensor(im.resize((128, 96), Image.BILINEAR, box=(10, 20, 50, 40), reducing_gap=None))
    assert (ref.int() - out[0].int()).abs().max() <= 1


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("train", [True, False])
def test_gpu_kernel_matches_pil_and_reference(photos, train):
    pytest.importorskip("triton")
    pil = photo_images(photos, 12, seed=4)
    host = [rgb_tensor(im) for im in pil]          # HWC memory, as CPU-decoded fallbacks
    host[::2] = [im.contiguous() for im in host[::2]]  # planar, as nvJPEG writes them
    imgs = [im.cuda() for im in host]
    sizes = torch.tensor([[im.height, im.width] for im in pil])
    g = torch.Generator().manual_seed(9)
    if train:
        boxes = random_resized_crop_boxes(sizes, generator=g)
        flips = torch.rand(12, generator=g) < 0.5
    else:
        boxes, flips = center_crop_boxes(sizes, (224, 224)), None
    u8 = lambda dev: torch.empty(12, 3, 224, 224, dtype=torch.uint8, device=dev)  # noqa: E731
    fused = resample_crops(imgs, boxes, (224, 224), flips, out=u8("cuda")).cpu()
    ref = resample_crops(host, boxes, (224, 224), flips, out=u8("cpu"))
    worst = 0
    for k, im in enumerate(pil):
        want = im.resize((224, 224), Image.BILINEAR, box=tuple(boxes[k].tolist()), reducing_gap=None)
        if flips is not None and flips[k]:
            want = want.transpose(Image.FLIP_LEFT_RIGHT)
        worst = max(worst, int((rgb_tensor(want).int() - fused[k].int()).abs().max()))
    assert worst <= 1 and int((fused.int() - ref.int()).abs().max()) <= 1
    scale = torch.tensor([0.01, 0.02, 0.03], device="cuda").view(1, 3, 1, 1)
    shift = torch.tensor([-1.0, 0.0, 1.0], device="cuda").view(1, 3, 1, 1)
    bf = torch.empty(12, 3, 224, 224, dtype=torch.bfloat16, device="cuda",
                     memory_format=torch.channels_last)
    resample_crops(imgs, boxes, (224, 224), flips, out=bf, scale=scale, shift=shift)
    expect = fused.cuda().float() * scale + shift
    # uint8 rounding (half a level x scale) + bf16's 8-bit mantissa
    assert bool(((bf.float() - expect).abs() <= 0.5 * 0.03 + expect.abs() / 128).all())


@pytest.mark.gpu
@cuda
def test_gpu_decode_flat_layout_and_fused_decoder(mixed):
    pytest.importorskip("triton")
    from packer.gpu.nvjpeg import NvjpegDecoder
    try:
        nv = NvjpegDecoder(torch.device("cuda"))
    except OSError:
        pytest.skip("libnvjpeg not found")
    loader = make_gpu_loader(mixed, 8, shuffle=False, num_workers=0)
    batch = next(b for b in loader if not bool(b.decoded.any()))
    dev = torch.device("cuda")
    table = nv.decode_flat(batch.data, batch.offsets, dev, sizes=batch.sizes)
    assert torch.equal(table.sizes, batch.sizes) and len(table) == 8
    alone = nv([v for v in batch.images()], dev)
    assert all(torch.equal(a, b) for a, b in zip(table.views(), alone))
    # Sizes other than nvJPEG reads: refused before anything is allocated.
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(FormatError, match="to nvJPEG"):
        nv.decode_flat(batch.data, batch.offsets, dev, sizes=batch.sizes + 1)
    assert torch.cuda.memory_allocated() == before
    # GPUDecoder (flat decode, fused kernel) against the CPU reference on the same pixels.
    dec = GPUDecoder(make_gpu_loader(mixed, 8, shuffle=False, num_workers=0), train=False,
                     dtype=torch.uint8, options=GPUOptions(backend="nvjpeg", overlap=0))
    item = dec.decode_batch(batch)
    assert isinstance(item[0], ImageTable) and dec.stats.gpu == 8 and dec.stats.cpu == 0
    x, _ = dec.augment_batch(item, 0)
    host = [v.cpu() for v in item[0].views()]
    ref = resample_crops(host, center_crop_boxes(batch.sizes, (224, 224)), (224, 224),
                         out=torch.empty(8, 3, 224, 224, dtype=torch.uint8))
    assert int((x.cpu().int() - ref.int()).abs().max()) <= 1
