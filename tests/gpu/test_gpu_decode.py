"""GPUDecoder (packer.gpu.decoder, pipeline): the thread pipeline with a PIL stand-in for
nvJPEG (on the CPU, where the kernel's plain-torch reference resizes), its ordering, seeding,
fallback counts, errors and clean-up, and the errors when torchvision, CUDA or Triton is
missing. Tests marked ``gpu`` run nvJPEG and the kernel on a CUDA machine.
"""
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import threading
import time
import types

import pytest
import torch

from packer.errors import PackerError
from packer.gpu import GPUDecoder, GPUOptions, make_gpu_loader
from packer.gpu import decoder as decoder_module
from packer.gpu.encoded import gpu_decodable, jpeg_info
from packer.gpu.nvjpeg import NvjpegDecoder, torchvision_decode
from packer.gpu.resample import ImageTable
from packer.reading.dataset import PackedDataset
from packer.reading.sampler import PackedSampler
from packer.transforms.decode import DecodeCenterCrop

from helpers import KINDS, cuda, pil_decoder, rgb_tensor

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
    time.sleep(random.random() * 0.02)
    return pil_decoder(datas, device)


@pytest.mark.parametrize("overlap,threads", [(0, 1), (1, 1), (2, 1), (2, 3)])
def test_pipeline_labels_order_and_fallback_counts(mixed, overlap, threads):
    loader = sequential_loader(mixed, 5, num_workers=1)  # counts of one pass alone
    dec = _cpu_decoder(loader, overlap=overlap, seed=0, dtype=torch.float32,
                       decode_threads=threads, decoder=_slow_pil if threads > 1 else pil_decoder)
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
    seconds, at_work = stats.pop("seconds"), stats.pop("threads")
    assert (1 <= at_work <= threads) if overlap else at_work == 0
    assert stats == {"gpu": len(labels) - n_cpu, "cpu": n_cpu, "retried": 0, "batches": len(loader)}
    stages = ({"loader", "decode", "augment"} if overlap == 0 else
              {"loader", "decode+augment", "decode+augment blocked", "consumer", "throttle"})
    assert set(seconds) == stages and all(v >= 0 for v in seconds.values())


def test_pipeline_same_result_for_every_overlap_and_epoch_seeding(mixed):
    loader = make_gpu_loader(mixed, 8, shuffle=False, num_workers=0)
    runs = []
    for overlap, threads in ((0, 1), (1, 1), (2, 1), (2, 2), (2, 3)):
        dec = _cpu_decoder(loader, overlap=overlap, seed=7, decode_threads=threads,
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


class CountedPipeline(decoder_module.Pipeline):
    made = 0

    def __init__(self, *args):
        CountedPipeline.made += 1
        super().__init__(*args)


@pytest.mark.parametrize("threads", [1, 3])
def test_pipeline_runs_on_into_the_next_pass_with_the_same_crops(mixed, monkeypatch, threads):
    """The decode threads begin the next epoch while one ends; the batches (crops, flips,
    labels) are those of a decoder that starts each pass anew (overlap=0), with a seed and
    set_epoch every pass, with a seed alone, and after a set_epoch that jumps (the pass begun
    early is dropped)."""
    monkeypatch.setattr(decoder_module, "Pipeline", CountedPipeline)
    ds = PackedDataset(mixed)
    loader = make_gpu_loader(ds, 4, sampler=PackedSampler(ds, seed=1), num_workers=1,
                             drop_last=True)
    inline = make_gpu_loader(ds, 4, sampler=PackedSampler(ds, seed=1), num_workers=0,
                             drop_last=True)
    for epochs, made in (([0, 1, 2], 1), ([None] * 3, 1), ([0, 1, 5, 6], 2)):
        CountedPipeline.made = 0
        dec = _cpu_decoder(loader, seed=3, decode_threads=threads,
                           decoder=_slow_pil if threads > 1 else pil_decoder)
        ref = _cpu_decoder(inline, seed=3, overlap=0)
        for p, epoch in enumerate(epochs):
            if epoch is not None:
                dec.set_epoch(epoch)
                ref.set_epoch(epoch)
            got, want = list(dec), list(ref)
            assert len(got) == len(want) == len(loader)
            for (x, y), (x0, y0) in zip(got, want):
                assert torch.equal(y, y0) and torch.equal(x, x0), (epochs, p)
        assert CountedPipeline.made == made, epochs
        assert dec._kept["pipe"].threads[0].is_alive()  # gone on into the next pass


def test_decoder_dropped_between_passes_stops_its_threads(mixed):
    import gc
    loader = make_gpu_loader(mixed, 4, shuffle=False, num_workers=0)
    dec = _cpu_decoder(loader, decode_threads=2)
    list(dec)
    threads = dec._kept["pipe"].threads
    assert all(t.is_alive() for t in threads)
    gc.disable()  # by reference counting alone: the threads hold no reference to the decoder
    try:
        del dec
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        gc.enable()
    assert not any(t.is_alive() for t in threads)


def _paced_passes(mixed, consumer_s: float, decode_s: float) -> list:
    """Two passes (batch 1) through 3 decode threads; the thread names in decoding order."""
    names = []

    def decoder(datas, device):
        names.append(threading.current_thread().name)
        time.sleep(decode_s)
        return pil_decoder(datas, device)
    loader = make_gpu_loader(mixed, 1, shuffle=False, num_workers=0)
    dec = _cpu_decoder(loader, decode_threads=3, decoder=decoder, seed=0)
    done = []

    def run():
        for _ in range(2):
            for _ in dec:
                time.sleep(consumer_s)
        done.append(True)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert done, "a pass did not end (a resting decode thread never ended?)"
    return names


def test_pipeline_rests_decode_threads_a_slow_consumer_does_not_need(mixed):
    """A consumer slower than one thread's decoding gets its batches from one thread once the
    pipeline has settled: busy extra threads would take its interpreter time."""
    names = _paced_passes(mixed, consumer_s=0.08, decode_s=0)
    assert set(names[-12:]) == {"packer-gpu-decode-0"}, names


def test_pipeline_wakes_every_decode_thread_for_a_starved_consumer(mixed):
    names = _paced_passes(mixed, consumer_s=0, decode_s=0.03)
    assert len(set(names[-12:])) == 3, names


def test_abandoned_pipeline_is_freed_without_the_garbage_collector(mixed):
    """A loop left mid-epoch frees its pipeline (and the batches it held) by reference
    counting alone: a cycle would wait for a garbage collection, which may run in a
    DataLoader worker forked later and free CUDA memory there (the worker aborts)."""
    import gc
    import weakref
    loader = make_gpu_loader(mixed, 4, shuffle=False, num_workers=0)
    dec = _cpu_decoder(loader, decode_threads=2, decoder=_slow_pil)
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
    crop = DecodeCenterCrop((200, 160), crop_fraction=0.9)
    for k in range(6):
        im = ds[k][0]
        ref = crop(ds.load(k)["image"])
        # where CenterCrop pads (the crop is taller than the resized image) the GPU repeats
        # the edge instead of zeros: compare the pixels that fall on the image
        rw, rh, left, top = crop.geometry(*im.size)
        i0, i1, j0, j1 = max(0, -top), min(200, rh - top), max(0, -left), min(160, rw - left)
        got, want = x[k, :, i0:i1, j0:j1].int(), ref[:, i0:i1, j0:j1].int()
        assert (got - want).abs().max() <= 1
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


def sequential_loader(root, batch_size: int, **kw):
    """A loader whose sampler is DataLoader's own: a ``GPUDecoder``'s pipeline then ends with
    each pass (one runs on otherwise, decoding the next pass's first batches)."""
    order = torch.utils.data.SequentialSampler(range(len(PackedDataset(root))))
    return make_gpu_loader(root, batch_size, sampler=order, **kw)


def test_flat_decode_path_matches_the_list_path(mixed):
    loader = sequential_loader(mixed, 5, num_workers=0)
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
                      ({"backend": "dali"}, "backend"),
                      # accepted before: bools for counts, strings for flags, a lone number
                      ({"overlap": True}, "overlap"), ({"overlap": 2.0}, "overlap"),
                      ({"queue_depth": True}, "queue_depth"), ({"max_ahead": True}, "max_ahead"),
                      ({"flip": "no"}, "flip"), ({"channels_last": "no"}, "channels_last"),
                      ({"ratio": (1, float("inf"))}, "ratio"), ({"scale": 0.5}, "scale"),
                      ({"crop_fraction": None}, "crop_fraction"),
                      ({"min_visible": "x"}, "min_visible"),
                      ({"decoder": "not callable"}, "decoder"),
                      ({"size": (224.9, 100)}, "size"), ({"size": True}, "size")]:
        with pytest.raises(ValueError, match=match):
            _cpu_decoder(loader, **kw)
    import numpy as np
    ok = GPUOptions(scale=np.array([0.2, 1.0]), ratio=torch.tensor([0.5, 2.0]),
                    flip=np.bool_(True), channels_last=0, crop_fraction=1)
    assert (ok.scale, ok.ratio, ok.flip, ok.channels_last) == ((0.2, 1.0), (0.5, 2.0), True, False)
    assert _cpu_decoder(loader, size=(224.0, 112)).size == (224, 112)
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
    loader = sequential_loader(mixed, 8, num_workers=2)  # the counts of one pass alone
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
        time.sleep(1)  # the threads decode the next epoch's first batches (queue_depth), then wait
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    _report("memory", {"allocated_per_epoch": allocated,
                       "max_allocated": torch.cuda.max_memory_allocated()})
    assert max(allocated[2:]) <= allocated[1] + (1 << 20)  # no growth over epochs


@pytest.mark.gpu
@cuda
def test_gpu_ring_batches_are_pinned_without_a_copy_and_decode_the_same(mixed):
    """make_gpu_loader's ring is registered as pinned memory once: the DataLoader's pin thread
    passes its batches on as they are (no copy), nvJPEG reads them there, and workers forked
    after the registration (a new set each pass) write into it too."""
    pytest.importorskip("torchvision")
    plain = GPUDecoder(sequential_loader(mixed, 4, num_workers=0), train=False, dtype=torch.uint8)
    ref = torch.cat([x.cpu() for x, _ in plain])
    loader = sequential_loader(mixed, 4, num_workers=2, persistent_workers=False)
    ring = loader.collate_fn.ring
    for _ in range(2):
        batches = list(loader)
        inside = [ring.base <= b.data.data_ptr() < ring.base + ring.nbytes for b in batches]
        assert ring.pinned and sum(inside) >= len(batches) - 2
        assert all(b.data.is_pinned() for b in batches)
        del batches
    dec = GPUDecoder(loader, train=False, dtype=torch.uint8)
    for _ in range(2):
        assert torch.equal(torch.cat([x.cpu() for x, _ in dec]), ref)
    assert dec.stats.gpu == 2 * plain.stats.gpu


@pytest.mark.gpu
@cuda
def test_gpu_ring_slot_waits_for_a_non_blocking_copy_out_of_it(mixed):
    """A caller's ``non_blocking`` copy out of a batch may still be queued when the batch is
    dropped: its slot is reused only once the work queued on that stream has run."""
    alone = [b.data.clone() for b in make_gpu_loader(mixed, 2, shuffle=False, num_workers=0,
                                                     pin_memory=False)]
    from packer.gpu.ring import BatchRing
    loader = make_gpu_loader(mixed, 2, shuffle=False, num_workers=2)
    # Two slots: each is written again within a few batches (the rest travel as blocks).
    loader.collate_fn.ring = BatchRing(2, loader.collate_fn.ring.slot_bytes)
    for _ in range(2):
        copies = []
        for b in loader:
            torch.cuda._sleep(50_000_000)  # a busy stream: the copy runs tens of ms from now
            copies.append(b.data.to("cuda", non_blocking=True))
            del b
        assert [torch.equal(c.cpu(), a) for c, a in zip(copies, alone)] == [True] * len(alone)
    assert loader.collate_fn.ring.pinned


@pytest.mark.gpu
@cuda
def test_gpu_ring_whose_slots_all_wait_frees_them_as_blocks_arrive():
    """Slots released while work was queued are freed by the next batch to arrive, in a slot
    or not: a ring whose every slot waits gets no batch in a slot to free them."""
    from packer.gpu.ring import FREE, BatchRing, arrived
    ring = BatchRing(2, 4096)
    views = [arrived((ring.token, i, 16)) for i in range(2)]
    assert ring.pinned
    torch.cuda._sleep(50_000_000)  # the releases below wait behind this
    del views
    torch.cuda.synchronize()
    assert FREE not in list(ring.owner)  # released, not yet freed
    assert arrived(torch.zeros(3, dtype=torch.uint8)).numel() == 3  # a batch in its own block
    assert list(ring.owner) == [FREE, FREE]


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
    plain = GPUDecoder(sequential_loader(mixed, 4, num_workers=0), train=False, dtype=torch.uint8)
    ref = torch.cat([x.cpu() for x, _ in plain])
    loader = sequential_loader(mixed, 4, num_workers=2)  # the counts of its passes alone
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


def test_a_center_crop_wider_than_the_resized_image_pads_with_black_as_the_cpu_path(tmp_path):
    # the resampling filter's edge pixels took image pixels into the first padding columns
    import packer
    from packer.demo import load_photos, make_image
    photo = make_image(random.Random(3), load_photos(), size=(400, 600))  # portrait
    packer.write(tmp_path / "d", [{"image": photo, "label": 0}], progress=False)
    size = (224, 448)  # wider than the 256 px the shorter side is resized to: padded
    cpu = PackedDataset(tmp_path / "d", decode=DecodeCenterCrop(size))[0][0]
    dec = GPUDecoder(make_gpu_loader(tmp_path / "d", 1, num_workers=0), size=size,
                     train=False, device="cpu", dtype=torch.uint8,
                     options=GPUOptions(decoder=pil_decoder, overlap=0))
    gpu = next(iter(dec))[0][0]
    assert gpu.shape == cpu.shape == (3, 224, 448)
    assert not gpu[:, :, :96].any() and not gpu[:, :, 352:].any()  # the padding: black
    assert gpu[:, :, 96:352].float().mean() > 10  # the photo
    assert (gpu.int() - cpu.int()).abs().float().mean() < 2
