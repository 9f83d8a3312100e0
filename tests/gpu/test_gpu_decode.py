"""GPU decoding (packer.gpu).

Everything that needs neither CUDA nor torchvision runs in CI: JPEG header parsing, the
worker hook and collate, routing to the CPU fallback, crop-box maths, the resample's CPU
reference (against PIL), the thread pipeline (with a PIL stand-in for nvJPEG) and the errors
when torchvision, CUDA or Triton is missing. Tests marked ``gpu`` run nvJPEG itself on a CUDA machine.
"""
import io
import json
import dataclasses
import math
import os
import random
import shutil
import sys
import threading
import types

import pytest
import torch
from PIL import Image

from packer.reading.dataset import PackedDataset
from packer.errors import PackerError
from packer.gpu import EncodedImage, GPUDecoder, GPUOptions, collate_encoded, make_gpu_loader
from packer.gpu import decoder as decoder_module
from packer.gpu.augment import center_crop_boxes, random_resized_crop_boxes
from packer.gpu.encoded import EncodedBatch, EncodedSample, JpegInfo, gpu_decodable, jpeg_info
from packer.gpu.nvjpeg import NvjpegDecoder, torchvision_decode
from packer.gpu.resample import ImageTable, resample_crops
from packer.transforms.decode import DecodeCenterCrop, DecodeRandomResizedCrop

from helpers import KINDS, cuda, kind_bytes, photo_images, pil_decoder, rgb_tensor

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# -- JPEG headers ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(KINDS))
def test_jpeg_info_and_routing(photos, name):
    data = kind_bytes(photos, name)
    info = jpeg_info(data)
    what, on_gpu = KINDS[name]
    assert gpu_decodable(info) is on_gpu, what
    if name == "image.png":
        assert info is None
        return
    im = Image.open(io.BytesIO(data))
    assert (info.width, info.height) == im.size == (200, 150)
    assert info.precision == 8 and not info.arithmetic
    assert info.process == ("progressive" if name == "progressive.jpg" else "baseline")
    assert info.components == {"gray.jpg": 1, "cmyk.jpg": 4}.get(name, 3)
    expect = {"gray.jpg": "gray", "q444.jpg": "4:4:4", "cmyk.jpg": "other"}.get(name, "4:2:0")
    assert info.subsampling == expect
    if name == "cmyk.jpg":
        assert info.adobe_transform is not None  # PIL writes an Adobe marker for CMYK


def test_jpeg_info_odd_streams(photos):
    base = kind_bytes(photos, "baseline.jpg")
    sof = base.index(b"\xff\xc0")
    arith = base[:sof + 1] + b"\xc9" + base[sof + 2:]
    assert jpeg_info(arith).arithmetic and not gpu_decodable(jpeg_info(arith))
    twelve = base[:sof + 4] + b"\x0c" + base[sof + 5:]
    assert jpeg_info(twelve).precision == 12 and not gpu_decodable(jpeg_info(twelve))
    rgb_coded = base[:2] + b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00" + base[2:]
    info = jpeg_info(rgb_coded)
    assert info.adobe_transform == 0 and not gpu_decodable(info)  # RGB-coded, not YCbCr
    filled = base[:2] + b"\xff\xff" + base[2:]  # fill bytes before a marker are legal
    assert jpeg_info(filled) == jpeg_info(base)
    for bad in (b"", b"\xff\xd8", base[:sof], b"\xff\xd8\xff\xda\x00\x02", b"GIF89a" + base):
        assert jpeg_info(bad) is None and not gpu_decodable(jpeg_info(bad))
    assert jpeg_info(memoryview(base)) == jpeg_info(bytearray(base)) == jpeg_info(base)
    assert isinstance(jpeg_info(base), JpegInfo)


# -- worker side -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(KINDS))
def test_encoded_image_hook(photos, name):
    data = kind_bytes(photos, name)
    s = EncodedImage()(data)
    assert isinstance(s, EncodedSample) and (s.height, s.width) == (150, 200)
    if KINDS[name][1]:
        assert not s.decoded and s.data == data  # the stored bytes, untouched
    else:  # decoded exactly as ImageFolder would
        assert s.decoded and s.data == Image.open(io.BytesIO(data)).convert("RGB").tobytes()


def test_collate_encoded(photos):
    samples = [(EncodedImage()(kind_bytes(photos, n)), k) for k, n in enumerate(KINDS)]
    b = collate_encoded(samples)
    assert isinstance(b, EncodedBatch)
    assert b.labels.tolist() == list(range(len(KINDS)))
    assert b.sizes.tolist() == [[150, 200]] * len(KINDS)
    assert b.decoded.tolist() == [not on_gpu for _, on_gpu in KINDS.values()]
    assert b.offsets[0] == 0 and b.offsets[-1] == b.data.numel()
    for (s, _), v in zip(samples, b.images()):
        if s.decoded:
            assert v.shape == (150, 200, 3) and bytes(v.flatten().numpy()) == s.data
        else:
            assert v.dim() == 1 and bytes(v.numpy()) == s.data
    with pytest.raises(TypeError, match="EncodedImage"):
        collate_encoded([(torch.zeros(3, 2, 2, dtype=torch.uint8), 0)])


def test_make_gpu_loader_routes_fallbacks_in_workers(mixed):
    loader = make_gpu_loader(mixed, 4, shuffle=False, num_workers=2)
    ds = loader.dataset
    assert isinstance(ds.decode, EncodedImage) and loader.pin_memory is False
    seen = {}
    for batch in loader:
        assert isinstance(batch, EncodedBatch) and (batch.data.is_shared() or batch.data.is_pinned())
        for i, (lab, dec, v) in enumerate(zip(batch.labels.tolist(), batch.decoded.tolist(), batch.images())):
            seen[len(seen)] = (lab, dec, v.shape)
    paths = [ds.load(i)["path"] for i in range(len(ds))]
    assert [seen[i][0] for i in range(len(ds))] == ds.targets
    for i, p in enumerate(paths):
        name = p.split("odd_")[-1]
        assert seen[i][1] is (not KINDS[name][1] if "odd_" in p else False), p
    # A dataset made for the CPU path is copied with the hook, not changed.
    cpu_ds = PackedDataset(mixed, decode=DecodeCenterCrop(224))
    gl = make_gpu_loader(cpu_ds, 4, num_workers=0)
    assert isinstance(gl.dataset.decode, EncodedImage) and isinstance(cpu_ds.decode, DecodeCenterCrop)
    with pytest.raises(ValueError, match="transform"):
        make_gpu_loader(PackedDataset(mixed, transform=lambda x: x), 4)


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


# -- the GPU stage, with PIL standing in for nvJPEG --------------------------------------------

def make_decoder(loader, **kw):
    """GPUDecoder with its GPUOptions given as keywords too (the tests vary both)."""
    names = {f.name for f in dataclasses.fields(GPUOptions)}
    opts = {k: kw.pop(k) for k in list(kw) if k in names}
    return GPUDecoder(loader, options=GPUOptions(**opts), **kw)


def _cpu_decoder(loader, **kw):
    kw.setdefault("decoder", pil_decoder)
    kw.setdefault("device", "cpu")
    return make_decoder(loader, **kw)


def _slow_pil(datas, device):
    """PIL with a random delay: with several decode threads, batches finish out of order."""
    import time
    time.sleep(random.random() * 0.02)
    return pil_decoder(datas, device)


@pytest.mark.parametrize("overlap,threads,augment_thread",
                         [(0, 1, False), (1, 1, False), (2, 1, True), (2, 3, True), (2, 3, False)])
def test_pipeline_labels_order_and_fallback_counts(mixed, overlap, threads, augment_thread):
    loader = make_gpu_loader(mixed, 5, shuffle=False, num_workers=1)
    dec = _cpu_decoder(loader, overlap=overlap, seed=0, dtype=torch.float32,
                       decode_threads=threads, decoder=_slow_pil if threads > 1 else pil_decoder,
                       augment_thread=augment_thread)
    assert len(dec) == len(loader) and dec.dataset is loader.dataset and dec.sampler is loader.sampler
    labels, shapes = [], set()
    for x, y in dec:
        assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
        shapes.add(tuple(x.shape[1:]))
        labels += y.tolist()
        assert torch.isfinite(x).all() and -2.2 < float(x.min()) and float(x.max()) < 2.7
    assert labels == loader.dataset.targets and shapes == {(3, 224, 224)}
    n_cpu = sum(not on for _, on in KINDS.values())
    stats = dec.stats.as_dict()
    seconds = stats.pop("seconds")
    assert stats == {"gpu": len(labels) - n_cpu, "cpu": n_cpu, "retried": 0, "batches": len(loader)}
    stages = {0: {"loader", "decode", "augment"},
              1: {"loader", "decode+augment", "decode+augment blocked", "consumer", "throttle"},
              2: {"loader", "decode", "decode blocked", "augment waits", "augment",
                  "augment blocked", "consumer", "throttle"}}[overlap]
    if overlap == 2 and not augment_thread:
        stages = {"loader", "decode+augment", "decode+augment blocked", "consumer", "throttle"}
    assert set(seconds) == stages and all(v >= 0 for v in seconds.values())


def test_pipeline_same_result_for_every_overlap_and_epoch_seeding(mixed):
    loader = make_gpu_loader(mixed, 8, shuffle=False, num_workers=0)
    runs = []
    for overlap, threads, augment_thread in ((0, 1, False), (1, 1, False), (2, 1, True),
                                             (2, 2, True), (2, 3, False)):
        dec = _cpu_decoder(loader, overlap=overlap, seed=7, decode_threads=threads,
                           augment_thread=augment_thread,
                           decoder=_slow_pil if threads > 1 else pil_decoder)
        dec.set_epoch(3)
        runs.append([x for x, _ in dec])
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    dec = _cpu_decoder(loader, seed=7)
    dec.set_epoch(4)
    first = next(iter(dec))[0]
    assert not torch.equal(first, runs[0][0])  # another epoch, other crops
    assert not torch.equal(next(iter(dec))[0], first)  # another pass, no set_epoch: other crops


@pytest.mark.parametrize("augment_thread", [True, False])
def test_abandoned_pipeline_is_freed_without_the_garbage_collector(mixed, augment_thread):
    """A loop left mid-epoch frees its pipeline (and the batches it held) by reference
    counting alone: a cycle would wait for a garbage collection, which may run in a
    DataLoader worker forked later and free CUDA memory there (the worker aborts)."""
    import gc
    import weakref
    loader = make_gpu_loader(mixed, 4, shuffle=False, num_workers=0)
    dec = _cpu_decoder(loader, decode_threads=2, augment_thread=augment_thread,
                       decoder=_slow_pil)
    it = iter(dec)
    next(it)
    pipe = weakref.ref(it.gi_frame.f_locals["pipe"])
    gc.disable()
    try:
        it.close()
        del it
        assert pipe() is None
    finally:
        gc.enable()


def test_eval_mode_matches_cpu_center_crop_maths(mixed):
    loader = make_gpu_loader(mixed, 6, shuffle=False, num_workers=0)
    dec = _cpu_decoder(loader, train=False, dtype=torch.uint8, size=(200, 160), crop_fraction=0.9)
    ds = PackedDataset(mixed)
    x, y = next(iter(dec))
    assert x.shape == (6, 3, 200, 160)
    for k in range(6):
        im = ds[k][0]
        box = DecodeCenterCrop((200, 160), crop_fraction=0.9).box(*im.size)
        ref = rgb_tensor(im.resize((160, 200), Image.BILINEAR, box=box, reducing_gap=None))
        assert (ref.int() - x[k].int()).abs().max() <= 1
    x2, _ = next(iter(dec))
    assert torch.equal(x, x2)  # evaluation is deterministic


class FlatPIL:
    """NvjpegDecoder's two entry points with PIL behind them: the list one, and
    ``decode_flat``, which writes the batch planar into one buffer."""

    def __init__(self):
        self.flat_calls = 0

    def __call__(self, datas, device):
        return pil_decoder(datas, device)

    def decode_flat(self, data, offsets, device, sizes):
        self.flat_calls += 1
        images = pil_decoder(torch.split(data, torch.diff(offsets).tolist()), device)
        hw = torch.tensor([im.shape[1:] for im in images], dtype=torch.int64)
        assert torch.equal(hw, sizes)
        buffer = torch.cat([im.flatten() for im in images])
        starts = torch.cumsum(3 * hw[:, 0] * hw[:, 1], 0) - 3 * hw[:, 0] * hw[:, 1]
        return ImageTable.planar(buffer, starts, hw)


def test_flat_decode_path_matches_the_list_path(mixed):
    loader = make_gpu_loader(mixed, 5, shuffle=False, num_workers=0)
    flat = FlatPIL()
    for train in (False, True):
        a = [x for x, _ in _cpu_decoder(loader, decoder=flat, train=train, seed=3, dtype=torch.uint8)]
        b = [x for x, _ in _cpu_decoder(loader, train=train, seed=3, dtype=torch.uint8)]
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    mixed_batches = sum(1 for batch in loader if bool(batch.decoded.any()))
    assert flat.flat_calls == 2 * (len(loader) - mixed_batches) > 0  # fallbacks: list path


def test_decoder_refusing_a_batch_retries_images_alone(mixed):
    calls = []

    def picky(datas, device):
        calls.append(len(datas))
        if len(datas) > 1:
            raise RuntimeError("nvjpeg: unsupported")
        if calls.count(1) == 2:
            raise RuntimeError("nvjpeg: this one too")  # -> PIL in the decode thread
        return pil_decoder(datas, device)
    loader = make_gpu_loader(mixed, 4, shuffle=False, num_workers=0)
    dec = _cpu_decoder(loader, decoder=picky, overlap=0)  # inline: no batch decoded ahead
    x, y = next(iter(dec))
    assert x.shape[0] == 4 and dec.stats.retried == 4 and calls[:5] == [4, 1, 1, 1, 1]


def test_errors_reach_the_consumer_and_threads_stop(mixed):
    def broken(datas, device):
        raise ValueError("decoder exploded")
    loader = make_gpu_loader(mixed, 4, shuffle=False, num_workers=0)
    for overlap in (1, 2):
        with pytest.raises(ValueError, match="decoder exploded") as e:
            list(_cpu_decoder(loader, decoder=broken, overlap=overlap))
        assert any("GPU decode" in n for n in getattr(e.value, "__notes__", ["GPU decode"]))
    with pytest.raises(TypeError, match="EncodedBatch"):
        list(_cpu_decoder([torch.zeros(2)], overlap=2))
    # Leaving a loop early stops the threads; the next pass starts cleanly.
    fresh = shutil.copytree(mixed, mixed.parent / "fresh")  # not opened in this process yet
    dec = _cpu_decoder(make_gpu_loader(fresh, 2, shuffle=False, num_workers=1), overlap=2)
    for _ in range(2):
        it = iter(dec)
        next(it)
        it.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("packer-gpu")]
    assert sum(len(y) for _, y in dec) == len(dec.dataset)


def test_constructor_errors(mixed, monkeypatch):
    loader = make_gpu_loader(mixed, 4, num_workers=0)
    for kw, match in [({"size": 0}, "size"), ({"dtype": torch.int32}, "dtype"),
                      ({"scale": (0.5, 0.1)}, "scale"), ({"overlap": 3}, "overlap"),
                      ({"crop_fraction": 1.5}, "crop_fraction"), ({"mean": (0.5,)}, "mean"),
                      ({"min_visible": 2.0}, "min_visible"), ({"decode_threads": 0}, "decode_threads"),
                      ({"decode_threads": 2, "overlap": 1}, "decode_threads"),
                      ({"backend": "dali"}, "backend")]:
        with pytest.raises(ValueError, match=match):
            _cpu_decoder(loader, **kw)
    with pytest.raises(TypeError, match="resample"):  # one augment kernel: no choice left
        _cpu_decoder(loader, resample="matmul")

    def no_lib():
        raise OSError("libnvjpeg not found")
    if "torchvision" not in sys.modules:
        monkeypatch.setitem(sys.modules, "torchvision", None)  # import fails even if installed
        monkeypatch.setattr(decoder_module, "load_nvjpeg", no_lib)
        with pytest.raises(PackerError, match="pip install torchvision.*DecodeRandomResizedCrop"):
            GPUDecoder(loader)
    fake = types.ModuleType("torchvision")
    fake.io = types.ModuleType("torchvision.io")
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setitem(sys.modules, "torchvision.io", fake.io)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PackerError, match="CUDA.*CUDAPrefetcher"):
        GPUDecoder(loader)
    # Triton missing (CUDA present): one clear error, before any CUDA call.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    with pytest.raises(PackerError, match="needs Triton.*pip install triton.*CPU path.*CUDAPrefetcher"):
        GPUDecoder(loader, device="cuda:0")


# -- on a GPU: nvJPEG itself -------------------------------------------------------------------

def _report(name, value):
    """Numbers the GPU tests measure go to $PACKER_GPU_REPORT (JSON lines), if set."""
    path = os.environ.get("PACKER_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **value}) + "\n")


def _backend(name):
    if name == "torchvision":
        pytest.importorskip("torchvision")
        return torchvision_decode
    try:
        return NvjpegDecoder(torch.device("cuda"))
    except OSError:
        pytest.skip("libnvjpeg not found")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["torchvision", "nvjpeg"])
def test_gpu_nvjpeg_pixels_match_cpu_decode(mixed, backend):
    decode = _backend(backend)
    ds = PackedDataset(mixed)
    worst, means = 0, []
    for i in range(len(ds)):
        rec = ds.load(i)
        if not gpu_decodable(jpeg_info(rec["image"])):
            continue
        data = torch.frombuffer(bytearray(rec["image"]), dtype=torch.uint8)
        gpu = decode([data], torch.device("cuda"))[0].cpu()
        d = (gpu.int() - rgb_tensor(ds[i][0]).int()).abs()
        worst, means = max(worst, int(d.max())), means + [float(d.float().mean())]
    mean = sum(means) / len(means)
    _report("nvjpeg_vs_pil", {"backend": backend, "images": len(means), "max_abs": worst,
                              "mean_abs": mean})
    assert mean < 3.0 and worst <= 128  # different IDCT and chroma upsampling, same picture


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("overlap,backend", [(0, "auto"), (2, "auto"), (2, "nvjpeg")])
def test_gpu_decoder_labels_fallbacks_and_eval(mixed, overlap, backend):
    pytest.importorskip("torchvision")
    loader = make_gpu_loader(mixed, 8, shuffle=False, num_workers=2)
    try:
        dec = make_decoder(loader, overlap=overlap, train=False, dtype=torch.uint8, seed=0,
                         backend=backend)
    except OSError:
        pytest.skip("libnvjpeg not found")
    assert dec.backend in ("nvjpeg-hardware", "nvjpeg-default", "torchvision")
    labels = []
    for x, y in dec:
        assert x.is_cuda and y.is_cuda and x.shape[1:] == (3, 224, 224)
        labels += y.tolist()
    assert labels == loader.dataset.targets
    n_cpu = sum(not on for _, on in KINDS.values())
    assert (dec.stats.cpu, dec.stats.gpu, dec.stats.retried) == (n_cpu, len(labels) - n_cpu, 0)
    # Evaluation output against the CPU reference: PIL full decode + the same box resize.
    gpu = [x.cpu() for x, _ in dec]  # one pass at a time: persistent workers serve one iterator
    ref = [x for x, _ in _cpu_decoder(loader, train=False, dtype=torch.uint8)]
    d = torch.cat([(a.int() - b.int()).abs().flatten() for a, b in zip(gpu, ref)])
    _report("eval_vs_pil_resize", {"overlap": overlap, "backend": dec.backend, "max_abs": int(d.max()),
                                   "mean_abs": float(d.float().mean())})
    assert float(d.float().mean()) < 2.0


@pytest.mark.gpu
@cuda
def test_gpu_decoder_train_bf16_and_memory_bounded(mixed):
    pytest.importorskip("torchvision")
    loader = make_gpu_loader(mixed, 8, shuffle=True, num_workers=2, drop_last=True)
    dec = GPUDecoder(loader, seed=1)
    allocated = []
    for epoch in range(6):
        dec.set_epoch(epoch)
        for x, y in dec:
            assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
            assert torch.isfinite(x.float()).all()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    _report("memory", {"allocated_per_epoch": allocated,
                       "max_allocated": torch.cuda.max_memory_allocated()})
    assert max(allocated[2:]) <= allocated[1] + (1 << 20)  # no growth over epochs


@pytest.mark.gpu
@cuda
def test_gpu_overlap_modes_agree(mixed):
    pytest.importorskip("torchvision")
    loader = make_gpu_loader(mixed, 8, shuffle=False, num_workers=0)
    out = []
    for overlap in (0, 1, 2):
        dec = make_decoder(loader, overlap=overlap, seed=5, dtype=torch.float32)
        out.append(torch.cat([x.cpu() for x, _ in dec]))
    assert torch.allclose(out[0], out[1], atol=1e-3) and torch.allclose(out[0], out[2], atol=1e-3)
    assert math.isfinite(float(out[0].sum()))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["torchvision", "nvjpeg"])
def test_gpu_decode_threads_keep_order_and_pixels(mixed, backend):
    pytest.importorskip("torchvision")
    plain = GPUDecoder(make_gpu_loader(mixed, 4, shuffle=False, num_workers=0), train=False,
                       dtype=torch.uint8)
    ref = torch.cat([x.cpu() for x, _ in plain])
    loader = make_gpu_loader(mixed, 4, shuffle=False, num_workers=2)
    try:
        dec = make_decoder(loader, train=False, dtype=torch.uint8, decode_threads=3, backend=backend)
    except OSError:
        pytest.skip("libnvjpeg not found")
    for _ in range(2):  # twice: the threads' handles and streams are reused
        xs, labels = [], []
        for x, y in dec:
            xs.append(x.cpu())
            labels += y.tolist()
        assert labels == loader.dataset.targets and torch.equal(torch.cat(xs), ref)
    assert dec.stats.gpu == 2 * plain.stats.gpu and dec.stats.retried == 0


def test_cuda_queues_are_reserved_explicitly_not_on_import(tmp_path):
    """Importing packer.gpu leaves the environment alone; reserve_cuda_queues() (which
    make_gpu_loader calls) raises the hardware queues to 32 unless the user chose; a low
    value gets advice (nvJPEG then waits behind training kernels)."""
    import subprocess
    code = ("import os, packer.gpu.loader as g; print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'));"
            "print(g.reserve_cuda_queues()); print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS']);"
            "print(g.connections_advice())")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["None", "True", "32", "None"]
    for value in ("1", "8", "lots"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**env, "CUDA_DEVICE_MAX_CONNECTIONS": value}).stdout.splitlines()
        assert out[:3] == [value, "False", value]  # the user's choice stays
        assert f"CUDA_DEVICE_MAX_CONNECTIONS is {value}" in out[3]
        assert "packer.gpu.reserve_cuda_queues()" in out[3]
