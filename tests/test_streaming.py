"""PackedIterableDataset: every record once per epoch across ranks x workers, seeded shuffling.

Also PackedSampler end to end on a real packed dataset (PackedDataset + make_loader).
"""
import zlib
from collections import Counter
from types import SimpleNamespace

import pytest
from PIL import Image
from torch.utils.data import DataLoader

import packer.reading.iterable as streaming
from packer import build
from packer.sources import Coco
from packer.reading.reader import ShardReader
from packer.reading.sampler import PackedSampler, global_order
from packer.reading.iterable import PackedIterableDataset

N = 48  # conftest's photo_src: realistic JPEGs, made once per session


@pytest.fixture(scope="module")
def packed(photo_src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("streaming") / "packed"
    build(photo_src, dst, workers=0, progress=False)
    assert len(ShardReader(dst)) == N
    return dst


@pytest.fixture(scope="module")
def ids(packed):
    """crc32 of each record's image bytes -> its global index (records are all distinct)."""
    reader = ShardReader(packed)
    table = {zlib.crc32(reader.record(i)["image"]): i for i in range(len(reader))}
    assert len(table) == N
    return table


def stream(packed, ids, *, worker=None, **kw):
    """Indices one (rank, worker) yields; `worker=(id, count)` fakes a DataLoader worker."""
    ds = PackedIterableDataset(packed, decode=zlib.crc32, **kw)
    if worker is not None:
        info = SimpleNamespace(id=worker[0], num_workers=worker[1])
        original, streaming.get_worker_info = streaming.get_worker_info, lambda: info
    try:
        return [ids[crc] for crc, _ in ds]
    finally:
        if worker is not None:
            streaming.get_worker_info = original


def test_default_yields_images_and_labels_like_packed_dataset(packed):
    ds = PackedIterableDataset(packed, shuffle=False, target_transform=lambda t: t * 10)
    reader = ShardReader(packed)
    items = list(ds)
    assert len(items) == len(ds) == N
    for i, (image, target) in enumerate(items):
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert image.size == (reader.record(i)["width"], reader.record(i)["height"])
        assert target == reader.record(i)["label"] * 10


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_record_once_across_ranks_and_workers(packed, ids, drop_last):
    for w in range(1, 9):
        for workers in (1, 2, 3, 5):
            per_rank = []
            for r in range(w):
                got = []
                for k in range(workers):
                    got += stream(packed, ids, worker=(k, workers), num_replicas=w, rank=r,
                                  drop_last=drop_last, shuffle_buffer=8, block_size=8, seed=1)
                per_rank.append(got)
            expected = N // w if drop_last else -(-N // w)
            assert [len(p) for p in per_rank] == [expected] * w
            counts = Counter(i for p in per_rank for i in p)
            if drop_last:
                assert max(counts.values()) == 1 and len(counts) == expected * w
            else:
                assert set(counts) == set(range(N))
                assert sum(counts.values()) - N == expected * w - N < w  # padding only


def test_real_workers_split_without_loss(packed, ids):
    parts = []
    for rank in range(2):
        ds = PackedIterableDataset(packed, decode=zlib.crc32, num_replicas=2, rank=rank,
                                   shuffle_buffer=4, block_size=8)
        dl = DataLoader(ds, batch_size=3, num_workers=2)
        parts.append([ids[c] for crcs, _ in dl for c in crcs.tolist()])
    assert sorted(parts[0] + parts[1]) == list(range(N))
    assert len(parts[0]) == len(parts[1]) == N // 2


def test_shuffle_is_seeded_per_epoch_and_sequential_without(packed, ids):
    a = stream(packed, ids, seed=3, shuffle_buffer=10, block_size=8)
    assert a == stream(packed, ids, seed=3, shuffle_buffer=10, block_size=8)
    assert sorted(a) == list(range(N)) and a != list(range(N))
    ds = PackedIterableDataset(packed, decode=zlib.crc32, seed=3, shuffle_buffer=10, block_size=8)
    ds.set_epoch(1)
    b = [ids[c] for c, _ in ds]
    assert sorted(b) == list(range(N)) and b != a
    assert stream(packed, ids, shuffle=False) == list(range(N))
    # shuffle_buffer 0: blocks permuted, each read front to back
    c = stream(packed, ids, seed=3, shuffle_buffer=0, block_size=8)
    assert sorted(c) == list(range(N)) and c != list(range(N))
    assert all(c[i + 1] == c[i] + 1 for i in range(0, N, 8) for i in range(i, i + 7))


def test_set_epoch_reaches_persistent_workers(packed, ids):
    ds = PackedIterableDataset(packed, decode=zlib.crc32, shuffle_buffer=6, block_size=4, seed=2)
    dl = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        epochs.append([ids[c] for crcs, _ in dl for c in crcs.tolist()])
    fresh = PackedIterableDataset(packed, decode=zlib.crc32, shuffle_buffer=6, block_size=4, seed=2)
    fresh.set_epoch(1)
    expected = [ids[c] for crcs, _ in DataLoader(fresh, batch_size=4, num_workers=2)
                for c in crcs.tolist()]
    assert epochs[1] == expected != epochs[0]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(N))


def test_bad_arguments(packed):
    with pytest.raises(ValueError, match="shuffle_buffer"):
        PackedIterableDataset(packed, shuffle_buffer=-1)
    with pytest.raises(ValueError, match="block_size"):
        PackedIterableDataset(packed, block_size=0)
    with pytest.raises(ValueError, match="rank must be in"):
        PackedIterableDataset(packed, num_replicas=2, rank=5)


def test_packed_sampler_with_packed_dataset_and_make_loader(packed):
    from packer.reading.dataset import PackedDataset
    from packer.transforms.decode import DecodeCenterCrop
    from packer.loading.loader import make_loader
    ds = PackedDataset(packed, decode=DecodeCenterCrop(16))
    order = global_order(N, seed=4, epoch=1, order="block", block_size=4, window=2).tolist()
    got = []
    for rank in range(2):
        s = PackedSampler(ds, seed=4, num_replicas=2, rank=rank, order="block", block_size=4, window=2)
        s.set_epoch(1)
        dl = make_loader(ds, batch_size=5, sampler=s, num_workers=2)
        labels = [t for _, targets in dl for t in targets.tolist()]
        assert labels == [ds.target(i) for i in order[rank::2]]
        got.append(labels)
    assert len(got[0]) == len(got[1]) == N // 2


def test_streaming_a_detection_dataset_gives_its_targets(tmp_path):
    from packer import PackedIterableDataset, PackedDataset, build
    from packer.demo.scenes import make_detection_folder
    root = make_detection_folder(tmp_path / "det", images=10, seed=1)
    build(Coco(root / "images", root / "annotations.json"), tmp_path / "p", progress=False,
          workers=0)
    by_id = {t["image_id"]: t for _, t in PackedDataset(tmp_path / "p")}
    got = [t for _, t in PackedIterableDataset(tmp_path / "p", shuffle=False)]
    assert len(got) == 10
    for t in got:
        assert t["boxes"].tolist() == by_id[t["image_id"]]["boxes"].tolist()


def test_a_block_larger_than_the_dataset_costs_no_more_than_the_dataset(packed, ids):
    """One block past the end is the whole dataset in order: memory follows the records,
    not ``block_size`` (1e12 once asked for 8 TB per worker), and the order is unchanged."""
    huge = stream(packed, ids, seed=3, shuffle_buffer=0, block_size=10 ** 12)
    assert huge == stream(packed, ids, seed=3, shuffle_buffer=0, block_size=N) == list(range(N))
    assert stream(packed, ids, seed=3, shuffle_buffer=6, block_size=10 ** 12) == \
        stream(packed, ids, seed=3, shuffle_buffer=6, block_size=N)
