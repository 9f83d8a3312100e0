"""A batch crosses from a worker to the main process as one shared block
(``packer.loading.sharedbatch``), in slots the worker reuses (``packer.loading.batchpool``), and reads back
exactly as the worker made it."""
import os
import pickle

import pytest
import torch
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

from packer import PackedDataset, build, make_loader
from packer.transforms.decode import DecodeLetterbox
from packer.demo.scenes import make_detection_folder
from packer import PackedSampler
from packer.loading.batchpool import BatchPool, PooledCollate
from packer.loading.collate import collate_detection, default_collate_for
from packer.loading.sharedbatch import SharedBatch



@pytest.fixture(scope="module")
def detection(tmp_path_factory):
    pytest.importorskip("torchvision.tv_tensors")  # detection targets are tv_tensors
    base = tmp_path_factory.mktemp("shared")
    src = make_detection_folder(base / "coco", images=24, seed=5)
    build(src / "images", base / "packed", coco=src / "annotations.json", workers=0,
          progress=False)
    return PackedDataset(base / "packed", decode=DecodeLetterbox(160))


def tensors_of(targets):
    return [v for t in targets for v in t.values() if isinstance(v, torch.Tensor)]


def test_workers_hand_over_all_targets_of_a_batch_in_one_block(detection):
    """Every target tensor of a batch from a worker lies in one storage; without
    ``SharedBatch`` each had its own (a socket round trip each in the main process)."""
    loader = make_loader(detection, 8, num_workers=2, shuffle=False, pin_memory=False,
                         persistent_workers=False)
    local = make_loader(detection, 8, num_workers=0, shuffle=False, pin_memory=False)
    batches = 0
    for (images, targets), (want_images, want) in zip(loader, local):
        batches += 1
        assert type(targets) is list
        assert torch.equal(images, want_images)
        storages = {t.untyped_storage().data_ptr() for t in tensors_of(targets)}
        assert len(storages) == 1, "each target tensor crossed on its own"
        for got, exp in zip(targets, want):
            assert got.keys() == exp.keys()
            for k, v in exp.items():
                if isinstance(v, torch.Tensor):
                    assert type(got[k]) is type(v) and got[k].dtype == v.dtype
                    assert torch.equal(got[k].as_subclass(torch.Tensor), v.as_subclass(torch.Tensor))
                else:
                    assert got[k] == v
            assert got["boxes"].canvas_size == exp["boxes"].canvas_size
            assert got["boxes"].format == exp["boxes"].format
    assert batches == 3


def test_any_structure_round_trips_through_the_worker_pickler():
    tv_tensors = pytest.importorskip("torchvision.tv_tensors")
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[1.0, 2, 30, 40]]), format="XYXY",
                                     canvas_size=(50, 60))
    odd = torch.arange(12, dtype=torch.int16).reshape(3, 4)[:, ::2]  # not contiguous
    batch = SharedBatch([
        {"boxes": boxes, "labels": torch.tensor([3]), "image_id": 7, "caption": "a cat"},
        {"boxes": boxes[:0], "labels": torch.zeros(0, dtype=torch.int64), "image_id": 8,
         "nested": [odd, (torch.tensor(True), "x")]},
        torch.rand(3, 5, 7),
        torch.eye(3).to_sparse(),  # not dense: pickled on its own, unchanged
    ])
    out = pickle.loads(ForkingPickler.dumps(batch))
    assert type(out) is list and len(out) == 4
    assert out[3].is_sparse and torch.equal(out[3].to_dense(), torch.eye(3))
    assert isinstance(out[0]["boxes"], tv_tensors.BoundingBoxes)
    assert out[0]["boxes"].canvas_size == (50, 60) and torch.equal(out[0]["boxes"], boxes)
    assert (out[0]["image_id"], out[0]["caption"]) == (7, "a cat")
    assert out[1]["boxes"].shape == (0, 4) and out[1]["labels"].dtype == torch.int64
    assert torch.equal(out[1]["nested"][0], odd) and out[1]["nested"][0].dtype == torch.int16
    assert type(out[1]["nested"][1]) is tuple and out[1]["nested"][1][0].item() is True
    assert torch.equal(out[2], batch[2])
    ptrs = {t.untyped_storage().data_ptr() for t in (out[0]["boxes"], out[1]["nested"][0], out[2])}
    assert len(ptrs) == 1
    assert all(t.data_ptr() % 8 == 0 for t in (out[0]["labels"], out[2]))


def test_in_the_worker_it_is_the_list_it_holds():
    batch = SharedBatch([{"a": torch.ones(2)}])
    assert isinstance(batch, list) and len(batch) == 1
    assert torch.equal(batch[0]["a"], torch.ones(2))


# -- BatchPool: workers reuse shared slots ------------------------------------------------------

def mapping_name(ptr: int) -> str:
    """The name of this process's memory mapping holding address ``ptr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split(None, 5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= ptr < hi:
                return rest[4].strip() if len(rest) > 4 else ""
    raise AssertionError(f"{ptr:#x} is not mapped")


def three(i):
    return 3


class Numbered(torch.utils.data.Dataset):
    """Sample i: a 3x16x16 uint8 image filled with i % 251, and a target of ``size(i)``
    int64s all equal to i (detection-like: targets stay a list); 3 of them by default."""

    def __init__(self, n, size=None):
        self.n, self.size = n, size or three

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (torch.full((3, 16, 16), i % 251, dtype=torch.uint8),
                {"x": torch.full((self.size(i),), i, dtype=torch.int64)})


def check_batch(images, targets, first):
    for k, t in enumerate(targets):
        assert images[k].eq((first + k) % 251).all()
        assert t["x"].eq(first + k).all()


linux_only = pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                reason="BatchPool needs memfd_create (Linux)")


@linux_only
def test_streamed_batches_come_from_the_pool_slots_and_read_back_exactly(detection):
    """Batches a training loop drops at once cross in the workers' reused slots (memfd
    mappings named packer-batches-K), images and targets in one; without the pool each is a
    fresh shared file."""
    loader = make_loader(detection, 4, num_workers=2, shuffle=False, pin_memory=False)
    local = list(make_loader(detection, 4, num_workers=0, shuffle=False, pin_memory=False))
    for epoch in range(2):
        names, ptrs = set(), set()
        for (images, targets), (want_images, want) in zip(loader, local):
            assert torch.equal(images, want_images)
            assert images.is_contiguous(memory_format=torch.channels_last)
            for got, exp in zip(targets, want):
                assert torch.equal(got["boxes"].as_subclass(torch.Tensor),
                                   exp["boxes"].as_subclass(torch.Tensor))
                assert got["boxes"].canvas_size == exp["boxes"].canvas_size
                assert torch.equal(got["labels"], exp["labels"])
            storages = {t.untyped_storage().data_ptr() for t in [images, *tensors_of(targets)]}
            assert len(storages) == 1
            names.add(mapping_name(images.data_ptr()))
            ptrs.add(images.data_ptr())
        assert {n.split(" ")[0] for n in names} <= {"/memfd:packer-batches-0",
                                                    "/memfd:packer-batches-1"}, names
        assert len(ptrs) <= 2 * (loader.prefetch_factor + 2)  # slots, reused


@linux_only
def test_batches_held_by_the_loop_are_never_overwritten():
    """A loop that keeps batches (here: every batch of two epochs, then every third) must
    read them unchanged: a held slot is never reused; when all are held, fresh blocks."""
    ds = Numbered(96)
    loader = make_loader(ds, 4, num_workers=2, shuffle=False, pin_memory=False,
                         collate_fn=PooledCollate(collate_detection))
    kept = [(b, k * 4) for epoch in range(2) for k, b in enumerate(loader)]
    kept += [(b, k * 4) for k, b in enumerate(loader) if k % 3 == 0]
    for (images, targets), first in kept:
        check_batch(images, targets, first)
    pools = {mapping_name(b[0].data_ptr()).startswith("/memfd:packer-batches") for b, _ in kept}
    assert pools == {True, False}  # some in slots, the rest fresh once the slots ran out


@linux_only
def test_a_batch_larger_than_its_slot_falls_back_to_a_fresh_block():
    """Targets that outgrow the slot the first batches sized (200,000 int64s against 3) are
    handed over in one fresh block, whole and correct; the worker then makes a slot that
    fits, and the next batch (as large) and the smaller ones after it use slots again."""
    ds = Numbered(64, size=lambda i: 200_000 if 24 <= i < 32 else 3)
    loader = make_loader(ds, 4, num_workers=1, shuffle=False, pin_memory=False,
                         collate_fn=PooledCollate(collate_detection))
    where = []
    for k, (images, targets) in enumerate(loader):
        check_batch(images, targets, k * 4)
        assert [len(t["x"]) for t in targets] == [ds.size(k * 4 + j) for j in range(4)]
        where.append(mapping_name(images.data_ptr()).startswith("/memfd:packer-batches"))
    assert where[:6] == [True] * 6 and not where[6] and all(where[7:])


def test_spawned_workers_collate_without_a_pool():
    """A pool lives in the memory forked workers share; a spawned worker gets none (the
    collate pickles without it) and hands batches over the plain way, still correct."""
    collate = PooledCollate(collate_detection, channels_last=False)
    collate.pool = BatchPool.create(1, 2)
    clone = pickle.loads(pickle.dumps(collate))
    assert clone.pool is None and clone.keywords == {"channels_last": False}
    loader = make_loader(Numbered(16), 4, num_workers=1, shuffle=False, pin_memory=False,
                         collate_fn=PooledCollate(collate_detection),
                         multiprocessing_context="spawn", persistent_workers=False)
    for k, (images, targets) in enumerate(loader):
        check_batch(images, targets, k * 4)
        assert not mapping_name(images.data_ptr()).startswith("/memfd:packer-batches")


def in_pool(t) -> bool:
    return mapping_name(t.data_ptr()).startswith("/memfd:packer-batches")


class Images(torch.utils.data.Dataset):
    """Sample i: a 3 x side x side uint8 image filled with i % 251 and label i; a label of
    None (which no collate takes) for the indices in ``bad``."""

    def __init__(self, n, bad=(), side=64):
        self.n, self.bad, self.side = n, set(bad), side

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        image = torch.full((3, self.side, self.side), i % 251, dtype=torch.uint8)
        return image, None if i in self.bad else i


@linux_only
def test_batches_that_grow_after_every_slot_exists_move_to_larger_slots():
    """Once a worker has all its slots, a batch larger than each of them takes a free one
    to a larger place in its file (the old pages handed back): 16-image batches after
    4-image ones are pooled, not handed over fresh for good."""
    sizes = [4] * 24 + [16] * 24
    batches, at = [], 0
    for n in sizes:
        batches.append(list(range(at, at + n)))
        at += n
    loader = make_loader(Images(at, side=224), None, batch_sampler=batches, num_workers=1,
                         prefetch_factor=2, pin_memory=False)  # 0.6 MB batches, then 2.4 MB
    it = iter(loader)
    held = [next(it) for _ in range(4)]  # every slot made and in use at once
    del held
    out = [(in_pool(x), y.tolist()) for x, y in it]
    assert [y for _, y in out] == batches[4:]
    assert all(p for p, _ in out[-20:]), [p for p, _ in out]


@linux_only
def test_a_batch_whose_collate_fails_gives_its_slot_back():
    """A collate that raises after the images were written (here: a label of None) must
    free the slot; before, each failure kept one for good, and after ``prefetch_factor + 2``
    of them the worker never used its pool again."""
    bad = set(range(0, 40, 4))  # one bad sample in each of the first ten batches
    loader = make_loader(Images(80, bad=bad), 4, num_workers=1, shuffle=False,
                         prefetch_factor=2, pin_memory=False, persistent_workers=True)
    it, pooled = iter(loader), []
    for _ in range(20):
        try:
            x, _ = next(it)
        except TypeError:
            continue
        pooled.append(in_pool(x))
    assert pooled == [True] * 10


@linux_only
def test_loaders_sharing_one_collate_each_keep_their_own_pool():
    """Two loaders built with the same collate object (e.g. train and validation): the
    second one's workers get a new pool, and the first one's batches still arrive, from its
    own (its iterator holds it)."""
    ds = Images(64)
    collate = default_collate_for(ds)
    train = make_loader(ds, 4, sampler=PackedSampler(ds, shuffle=False), num_workers=1,
                        collate_fn=collate, pin_memory=False)
    val = make_loader(ds, 4, shuffle=False, num_workers=1, collate_fn=collate,
                      pin_memory=False)
    for epoch in range(2):
        train.set_epoch(epoch)
        got = [y.tolist() for _, y in train]
        assert [i for y in got for i in y] == list(range(64))
        assert [i for _, y in val for i in y.tolist()] == list(range(64))


@linux_only
def test_a_pool_that_cannot_be_made_leaves_no_file_open():
    """Out of file descriptors halfway through: no pool, and the files already made are
    closed (they were left open)."""
    import gc
    import resource

    def pool_files():
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor, gone by now
                pass
        return sum("packer-batches" in n for n in names)

    gc.collect()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    had = pool_files()
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 3, hard))
    try:
        pool = BatchPool.create(8, 4)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert pool is None
    gc.collect()
    assert pool_files() == had


@linux_only
def test_a_slot_that_cannot_grow_leaves_the_pool_as_it_was(monkeypatch):
    """No memory for a larger file (ENOSPC from ftruncate): the batch is told to go the
    fresh way, and the worker's slots stay usable as they were."""
    import errno
    pool = BatchPool.create(1, 2)
    first = pool.claim(0, 1000)
    assert first == 0 and pool.table == [(0, 1 << 20)]

    def full(fd, size):
        raise OSError(errno.ENOSPC, "no space")
    with monkeypatch.context() as m:
        m.setattr(os, "ftruncate", full)
        assert pool.claim(0, 5 << 20) is None  # a new, larger slot cannot be made
        pool.release(0, 0)
        assert pool.claim(0, 5 << 20) is None  # nor can slot 0 move to a larger place
    assert pool.table == [(0, 1 << 20)] and pool.end == 1 << 20
    assert pool.claim(0, 1000) == 0  # and it still serves batches that fit


def pool_rss_kb() -> int:
    """This process's resident memory in pool files (their mappings' Rss, in kB)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                inside = "packer-batches" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@linux_only
def test_a_batch_kept_beyond_its_loader_keeps_only_its_own_memory():
    """When a pool goes, the pages of its files that no kept batch views go back: one batch
    kept from each of three epochs of fresh workers holds about three batches of memory, not
    every slot of every worker's file (it held ~4x before), and reads back unchanged."""
    import gc
    ds = Images(64, side=224)  # 0.6 MB batches of 4: 1 MiB slots
    loader = make_loader(ds, 4, sampler=torch.utils.data.SequentialSampler(ds), num_workers=1,
                         pin_memory=False, persistent_workers=False, prefetch_factor=2)
    kept = []
    for epoch in range(3):
        for k, (x, y) in enumerate(loader):
            int(x.sum())  # every page of every batch read here: mapped in this process
            if k == epoch:
                kept.append((x, y))
    del loader, x, y
    gc.collect()
    assert all(in_pool(x) for x, _ in kept)
    held_kb = sum(x.nbytes + y.nbytes for x, y in kept) / 1024
    assert pool_rss_kb() <= 1.05 * held_kb + 64, (pool_rss_kb(), held_kb)  # 2x without
    for epoch, (x, y) in enumerate(kept):
        assert y.tolist() == [epoch * 4 + j for j in range(4)]
        for j in range(4):
            assert x[j].eq((epoch * 4 + j) % 251).all()


@linux_only
def test_when_a_pool_goes_only_the_slots_still_viewed_keep_their_pages():
    """In-process, on the pool's real file: three lent slots; once the pool goes, the free
    slot's pages go back at once, a kept one's as soon as it is dropped, and the batch still
    kept reads back unchanged."""
    import gc
    pool = BatchPool.create(1, 4)
    fd = os.dup(pool.files[0])  # to watch the file's pages after the pool closes its own
    views = []
    for k in range(3):
        slot = pool.claim(0, 600_000)
        start, _ = pool.table[slot]
        pool.view[start:start + 600_000].fill_(k + 1)
        views.append(pool.lend(0, slot, start, 600_000))

    def used_mb():
        return os.fstat(fd).st_blocks * 512 / 2 ** 20

    try:
        assert 1.7 < used_mb() < 2.0
        del views[1]  # freed while the pool lives: the worker would reuse it
        gc.collect()
        assert 1.7 < used_mb() < 2.0
        del pool, slot
        gc.collect()  # the pool goes: the free slot's pages go back
        assert 1.1 < used_mb() < 1.3
        del views[1]  # a kept batch dropped after its pool: its pages go back too
        gc.collect()
        assert 0.5 < used_mb() < 0.7
        assert views[0].eq(1).all()
    finally:
        os.close(fd)
