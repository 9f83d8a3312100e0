"""The workers' side of the GPU path (packer.gpu.encoded, packer.gpu.loader): JPEG header
parsing, routing to the CPU fallback, the decode hook and collate, make_gpu_loader, and the
CUDA hardware-queue setting. Everything here runs without CUDA."""
import io
import os
import sys

import pytest
import torch
from PIL import Image

from packer.gpu import EncodedImage, collate_encoded, make_gpu_loader
from packer.gpu.encoded import EncodedBatch, EncodedSample, JpegInfo, gpu_decodable, jpeg_info
from packer.reading.dataset import PackedDataset
from packer.transforms.decode import DecodeCenterCrop

from helpers import KINDS, kind_bytes

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


def in_ring(loader, t) -> bool:
    ring = loader.collate_fn.ring
    return ring is not None and ring.base + ring.head <= t.data_ptr() < ring.base + ring.nbytes


def test_make_gpu_loader_routes_fallbacks_in_workers(mixed):
    loader = make_gpu_loader(mixed, 4, shuffle=False, num_workers=2)
    ds = loader.dataset
    assert isinstance(ds.decode, EncodedImage) and loader.pin_memory is torch.cuda.is_available()
    seen = {}
    for batch in loader:
        assert isinstance(batch, EncodedBatch)
        assert batch.data.is_shared() or batch.data.is_pinned() or in_ring(loader, batch.data)
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


def test_a_batch_crosses_from_a_worker_as_one_shared_block(mixed, tmp_path, monkeypatch):
    """Only the bytes cross as shared memory; offsets, sizes, flags and labels travel in the
    message (each shared tensor costs the training process ~30 system calls to take in).
    Without a ring (PACKER_BATCH_RING=0) the bytes are a shared block of their own."""
    monkeypatch.setenv("PACKER_BATCH_RING", "0")
    from packer import build
    from packer.demo.scenes import make_detection_folder
    from packer.gpu.detection import DetectionTargets
    from packer.sources import Coco
    det = make_detection_folder(tmp_path / "det", images=6, seed=3)
    build(Coco(det / "images", det / "annotations.json"), tmp_path / "det-packed", progress=False,
          workers=0)
    for root in (mixed, tmp_path / "det-packed"):
        alone = list(make_gpu_loader(root, 3, shuffle=False, num_workers=0, pin_memory=False))
        crossed = list(make_gpu_loader(root, 3, shuffle=False, num_workers=1, pin_memory=False))
        assert len(alone) == len(crossed) > 0
        for a, b in zip(alone, crossed):
            assert b.data.is_shared()
            small = [b.offsets, b.sizes, b.decoded]
            small += ([b.labels.boxes, b.labels.counts, *b.labels.per_box.values()]
                      if isinstance(b.labels, DetectionTargets) else [b.labels])
            assert not any(t.is_shared() for t in small)
            assert torch.equal(a.data, b.data) and torch.equal(a.sizes, b.sizes)
            assert torch.equal(a.offsets, b.offsets) and torch.equal(a.decoded, b.decoded)
            if isinstance(a.labels, DetectionTargets):
                assert torch.equal(a.labels.boxes, b.labels.boxes)
                assert torch.equal(a.labels.counts, b.labels.counts)
                assert {k: v.tolist() for k, v in a.labels.per_box.items()} == \
                    {k: v.tolist() for k, v in b.labels.per_box.items()}
                assert (a.labels.per_image, a.labels.keys) == (b.labels.per_image, b.labels.keys)
            else:
                assert torch.equal(a.labels, b.labels)


def test_the_workers_blocks_are_freed_in_a_thread_of_their_own(mixed, monkeypatch):
    """A batch's shared block from a worker stays referenced for ``HELD`` more batches, then a
    thread of its own drops it: unmapping a block (~5 ms for 17 MB) is then not paid by the
    thread the pipeline waits on (the DataLoader's pin thread). PACKER_SHM_RELEASE=0: off;
    no more than ``HELD_BYTES`` are kept."""
    import threading
    import time
    import weakref
    from packer.gpu import encoded
    monkeypatch.setenv("PACKER_BATCH_RING", "0")
    for env, limit, held in (("1", None, encoded._Releaser.HELD), ("0", None, 0), ("1", 0, 0)):
        monkeypatch.setenv("PACKER_SHM_RELEASE", env)
        rel = encoded._Releaser()
        if limit is not None:
            rel.HELD_BYTES = limit
        monkeypatch.setattr(encoded, "_RELEASER", rel)
        refs = [weakref.ref(b.data) for b in
                make_gpu_loader(mixed, 2, shuffle=False, num_workers=1, pin_memory=False)]
        assert len(refs) > held + 2 and len(rel.held) == held
        deadline = time.monotonic() + 10
        while any(r() is not None for r in refs[:len(refs) - held]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(r() is None for r in refs[:len(refs) - held])  # freed
        assert all(r() is not None for r in refs[len(refs) - held:])  # still held
        threads = [t for t in threading.enumerate() if t.name == "packer-shm-release"]
        assert (rel.pid == os.getpid()) == (env == "1") and (len(threads) >= 1 or not held)


def test_batches_travel_in_a_ring_of_slots_the_workers_reuse(mixed):
    """Forked workers write each batch into a free slot of the loader's ``BatchRing`` and send
    where it is (no new shared block per batch); the slot stays the training process's while
    a tensor on it lives, then is free for the workers again. Same bytes as without workers."""
    import gc
    from packer.gpu.loader import RING_SPARE
    from packer.gpu.ring import MAIN, FREE, BatchRing
    alone = list(make_gpu_loader(mixed, 3, shuffle=False, num_workers=0, pin_memory=False))
    loader = make_gpu_loader(mixed, 3, shuffle=False, num_workers=2, pin_memory=False)
    ring = loader.collate_fn.ring
    assert ring.slots == 2 * loader.prefetch_factor + RING_SPARE
    # Room for a whole epoch held at once plus the workers' run into the next one:
    loader.collate_fn.ring = ring = BatchRing(4 * ring.slots, ring.slot_bytes)
    for _ in range(2):  # the second epoch reuses the slots the first one freed
        got = list(loader)
        assert len(got) == len(alone)
        for a, b in zip(alone, got):
            assert torch.equal(a.data, b.data) and torch.equal(a.offsets, b.offsets)
            assert torch.equal(a.decoded, b.decoded) and torch.equal(a.labels, b.labels)
        inside = [in_ring(loader, b.data) for b in got]
        fits = [b.data.nbytes <= ring.slot_bytes for b in got]
        assert inside == fits and sum(inside) >= len(got) - 2
        slots = [(b.data.data_ptr() - ring.base - ring.head) // ring.slot_bytes
                 for b, i in zip(got, inside) if i]
        assert [ring.owner[k] for k in slots] == [MAIN] * len(slots)
        del got, b
        gc.collect()
        if torch.cuda.is_available():  # pinned: a slot is free once the work queued is done
            torch.cuda.synchronize()
        ring.reap()  # free, or already claimed by a worker running on into the next epoch
        assert all(ring.owner[k] == FREE or ring.owner[k] > 0 for k in slots)


def test_a_full_ring_or_a_large_batch_falls_back_to_a_block_of_its_own(mixed):
    """A batch larger than a slot, or one that finds every slot taken, travels as a shared
    block as before: no worker waits for a slot (the training process may hold them all)."""
    import subprocess
    from packer.gpu.ring import BatchRing
    alone = list(make_gpu_loader(mixed, 3, shuffle=False, num_workers=0, pin_memory=False))
    for ring, inside in ((BatchRing(1, 1 << 20), 1), (BatchRing(4, 16), 0)):
        loader = make_gpu_loader(mixed, 3, shuffle=False, num_workers=2, pin_memory=False)
        loader.collate_fn.ring = ring  # before the workers start
        got = list(loader)
        assert [torch.equal(a.data, b.data) for a, b in zip(alone, got)] == [True] * len(alone)
        assert sum(in_ring(loader, b.data) for b in got) == inside
        assert sum(b.data.is_shared() for b in got) == len(got) - inside
    # A slot claimed by a worker that died before its batch arrived is claimed again.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    loader = make_gpu_loader(mixed, 3, shuffle=False, num_workers=1, pin_memory=False)
    loader.collate_fn.ring = ring = BatchRing(2, 1 << 20)
    ring.owner[0] = ring.owner[1] = dead.pid
    assert in_ring(loader, next(iter(loader)).data)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_started_by_spawn_or_forkserver_write_into_the_ring(mixed, context):
    """Workers that are not forked are handed the ring's memory file as they start (Python
    3.14 makes forkserver Linux's default): their batches arrive in slots too, the same
    bytes, and the next pass's new workers reuse the slots."""
    import pickle
    alone = list(make_gpu_loader(mixed, 8, shuffle=False, num_workers=0, pin_memory=False))
    loader = make_gpu_loader(mixed, 8, shuffle=False, num_workers=1, pin_memory=False,
                             multiprocessing_context=context, persistent_workers=False)
    ring = loader.collate_fn.ring
    for _ in range(2):
        got = list(loader)
        assert [torch.equal(a.data, b.data) for a, b in zip(alone, got)] == [True] * len(alone)
        inside = [in_ring(loader, b.data) for b in got]
        assert inside == [b.data.nbytes <= ring.slot_bytes for b in got] and any(inside)
        del got
    # Pickled anywhere but to a worker being started, a ring is one that never claims.
    assert pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(ring)))).claim(1) is None


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


def test_a_worker_killed_holding_the_ring_lock_stops_no_one(tmp_path):
    """A worker killed (OOM, terminate) inside a claim leaves the ring's lock taken for good:
    the other workers' batches then travel as blocks of their own instead of waiting."""
    import multiprocessing as mp
    from packer.gpu.ring import BatchRing
    ring = BatchRing(4, 1 << 16)
    holder = mp.get_context("fork").Process(target=die_holding, args=(ring,))
    holder.start()
    holder.join(30)
    worker = mp.get_context("fork").Process(target=claim_twice, args=(ring,))
    worker.start()
    worker.join(30)
    assert worker.exitcode == 0, f"the claim waited for the dead holder (exit {worker.exitcode})"


def die_holding(ring):
    ring.lock.acquire()
    os._exit(0)


def claim_twice(ring):
    import signal
    signal.alarm(10)
    assert ring.claim(100) is None and ring.claim(100) is None


def test_a_batch_whose_labels_fail_to_collate_leaves_the_ring_alone(photos):
    """A failed collate in a worker (its exception goes to the training loop) must not keep
    a slot: with persistent workers it would be the worker's for good."""
    from torch.utils.data import DataLoader
    from packer.gpu.encoded import EncodedCollate
    from packer.gpu.ring import FREE, BatchRing
    data = kind_bytes(photos, "baseline.jpg")
    info = jpeg_info(data)
    rows = [(EncodedSample(data, info.height, info.width, False), label)
            for label in (1, "a", 2, "b")]  # ints and text: default_collate refuses
    ring = BatchRing(2, 1 << 20)
    loader = DataLoader(rows, batch_size=2, num_workers=1, persistent_workers=True,
                        collate_fn=EncodedCollate(ring), multiprocessing_context="fork")
    it = iter(loader)
    with pytest.raises(TypeError):
        next(it)
    assert list(ring.owner) == [FREE, FREE]
    del it


def test_a_ring_view_collected_in_a_forked_process_frees_nothing():
    """A slot's view in garbage at a fork (a reference cycle not yet collected) is collected
    in the worker too: that must not free the slot, which stays the training process's until
    its own collection (a worker could claim it meanwhile, then have it freed under it)."""
    import gc
    import multiprocessing as mp
    from packer.gpu.ring import FREE, MAIN, BatchRing
    ring = BatchRing(2, 1 << 16)
    ring.owner[0] = os.getpid()
    cycle = [ring.view(0, 16)]
    cycle.append(cycle)
    gc.disable()
    try:
        del cycle
        child = mp.get_context("fork").Process(target=gc.collect)
        child.start()
        child.join(30)
        assert child.exitcode == 0 and ring.owner[0] == MAIN
    finally:
        gc.enable()
    gc.collect()
    if torch.cuda.is_available():  # pinned: freed once the stream's queued work is done
        torch.cuda.synchronize()
    ring.reap()
    assert ring.owner[0] == FREE


def test_two_threads_reaping_one_ring_free_only_what_is_done():
    """Batches of two loaders arrive in two threads, and each arrival reaps every ring: a
    slot whose copy is still running must stay held whatever the interleaving."""
    import threading
    import time
    from packer.gpu.ring import FREE, MAIN, BatchRing

    class Copy:  # stands in for a CUDA event: done or not, slow to ask
        def __init__(self, done):
            self.done = done

        def query(self):
            time.sleep(0.02)  # both threads ask about the first slot at once
            return self.done
    ring = BatchRing(2, 1 << 16)
    ring.owner[0] = ring.owner[1] = MAIN
    ring.pending.extend([(0, Copy(True)), (1, Copy(False))])
    threads = [threading.Thread(target=ring.reap) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert list(ring.owner) == [FREE, MAIN]
