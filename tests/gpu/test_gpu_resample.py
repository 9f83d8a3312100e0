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

# Runs in a subprocess under the interpreter; prints one JSON line per case.
_INTERPRETED = textwrap.dedent("""
    import json, os, random, sys
    import torch
    from PIL import Image
    from packer.demo import load_photos
    from packer.gpu.augment import center_crop_boxes, random_resized_crop_boxes
    from packer.gpu.resample import ImageTable, resample_crops

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
    for w, h in [(96, 72), (64, 80), (50, 50), (120, 40)]:
        base = rng.choice(photos)
        x, y = rng.randint(0, base.width - 2 * w), rng.randint(0, base.height - 2 * h)
        pil.append(base.crop((x, y, x + 2 * w, y + 2 * h)).resize((w, h), Image.BICUBIC))
    imgs = [rgb(im) for im in pil]
    imgs[1] = imgs[1].contiguous()                                   # planar, like nvJPEG's
    sizes = torch.tensor([[im.height, im.width] for im in pil])
    g = torch.Generator().manual_seed(3)
    size = (20, 24)
    cases = {"train": (random_resized_crop_boxes(sizes, generator=g), torch.tensor([1, 0, 1, 0]).bool()),
             "eval": (center_crop_boxes(sizes, size), None),
             "upscale": (torch.tensor([[4.0, 6.0, 14.0, 13.0]] * 4), torch.tensor([0, 1, 0, 1]).bool())}
    for name, (boxes, flips) in cases.items():
        out = lambda: torch.empty(4, 3, *size, dtype=torch.uint8)
        fused = resample_crops(imgs, boxes, size, flips, out=out())
        table = ImageTable.from_images(imgs)
        again = resample_crops(table, boxes, size, flips, out=out())
        plain = reference(imgs, boxes, size, flips, out=out())
        pil_max = 0
        for k, im in enumerate(pil):
            ref = im.resize(size[::-1], Image.BILINEAR, box=tuple(boxes[k].tolist()), reducing_gap=None)
            if flips is not None and flips[k]:
                ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
            pil_max = max(pil_max, int((rgb(ref).int() - fused[k].int()).abs().max()))
        scale, shift = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1.0, -2.0, 3.0])
        f = resample_crops(imgs, boxes, size, flips, scale=scale, shift=shift,
                           out=torch.empty(4, 3, *size).contiguous(memory_format=torch.channels_last))
        fr = reference(imgs, boxes, size, flips, scale=scale.view(1, 3, 1, 1),
                       shift=shift.view(1, 3, 1, 1))
        print(json.dumps({"case": name, "vs_pil_max": pil_max,
                          "vs_reference_max": int((fused.int() - plain.int()).abs().max()),
                          "table_equal": bool(torch.equal(fused, again)),
                          "float_vs_reference_max": float((f - fr).abs().max()),
                          "float_channels_last": f.is_contiguous(memory_format=torch.channels_last)}))
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
        assert c["vs_reference_max"] <= 1 and c["table_equal"], (name, c)
        assert c["float_vs_reference_max"] < 1e-2 and c["float_channels_last"], (name, c)


def test_image_table_layouts():
    planar = torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8)
    t = ImageTable.planar(planar, torch.tensor([0, 60]), torch.tensor([[4, 5], [4, 5]]))
    assert len(t) == 2 and t.layout.tolist() == [[0, 20, 5, 1], [60, 20, 5, 1]]
    assert torch.equal(t.views()[1], planar[60:].view(3, 4, 5)) and t.tensors()[0] is planar
    hwc = torch.arange(4 * 5 * 3, dtype=torch.uint8).view(4, 5, 3)
    other = torch.zeros(3, 2, 2, dtype=torch.uint8)
    t = ImageTable.from_images([hwc.permute(2, 0, 1), other])
    assert t.sizes.tolist() == [[4, 5], [2, 2]]
    assert t.layout[0, 1:].tolist() == [1, 15, 3] and t.layout[1, 1:].tolist() == [4, 2, 1]
    assert int(t.layout[:, 0].min()) == 0  # offsets from the lowest address
    with pytest.raises(TypeError, match="uint8"):
        ImageTable(torch.zeros(3), t.layout, t.sizes)
    with pytest.raises(TypeError, match="uint8 images on one device.*float32"):
        ImageTable.from_images([other, torch.zeros(3, 2, 2)])


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
