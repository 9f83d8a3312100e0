"""make_loader and the uint8 collate (CPU; runs in CI)."""
import math
import pickle
import shutil

import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset, DistributedSampler

from packer import build
from packer.reading.dataset import PackedDataset
from packer.demo import make_image_folder
from packer.transforms.decode import DecodeCenterCrop, DecodeRandomResizedCrop
from packer.loading import PackedLoader, collate_uint8
import packer.loading.loader as loader_module
from packer._util.system import usable_cores
from packer.loading.loader import TOTAL_PREFETCH, default_num_workers, make_loader
from packer.reading.sampler import PackedSampler
from packer.loading.threaded import background

UNIQUE, COPIES, CLASSES = 48, 4, 4


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(source folder, packed dataset folder): 192 realistic JPEGs (48 distinct, each 4x)."""
    tmp = tmp_path_factory.mktemp("loader")
    make_image_folder(tmp / "unique", images=UNIQUE, classes=CLASSES)
    src = tmp / "src"
    for f in sorted((tmp / "unique").rglob("*.jpg")):
        (src / f.parent.name).mkdir(parents=True, exist_ok=True)
        for k in range(COPIES):
            shutil.copyfile(f, src / f.parent.name / f"{f.stem}_{k}.jpg")
    build(src, tmp / "packed", workers=0, progress=False)
    return src, tmp / "packed"


class Indexed(Dataset):
    """(image, label, index, worker RSS in bytes): lets tests see order, split and memory."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, i, _rss()


class PILDataset(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return Image.new("RGB", (8, 8)), i


def _rss() -> int:
    """Private (anonymous) resident memory: what per-sample objects, copy-on-write of the
    parent's pages and leaks grow. File-backed pages of the shards are shared page cache."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


def pil_to_uint8(im):
    """PILToTensor without torchvision."""
    t = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return t.view(im.size[1], im.size[0], 3).permute(2, 0, 1)


def _source(src, ds, i):
    rec = ds.load(i)
    return (src / rec["path"]).read_bytes(), rec["label"], rec["path"]


# -- pixels and labels -------------------------------------------------------------------------

@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_batches_equal_decoding_the_source_files(packed, context):
    src, root = packed
    decode = DecodeCenterCrop(40)
    ds = PackedDataset(root, decode=decode)
    loader = make_loader(Indexed(ds), 16, shuffle=False, num_workers=2,
                         multiprocessing_context=context, pin_memory=False)
    classes = sorted(p.name for p in src.iterdir())
    seen = []
    for epoch in range(2):  # persistent workers serve the second epoch too
        for x, y, idx, _ in loader:
            assert x.dtype == torch.uint8 and x.shape == (16, 3, 40, 40)
            assert x.is_contiguous(memory_format=torch.channels_last)
            assert y.dtype == torch.int64
            for j, i in enumerate(idx.tolist()):
                data, label, path = _source(src, ds, i)
                assert torch.equal(x[j], decode(data)), path
                assert y[j].item() == label == classes.index(path.split("/")[0])
            seen += idx.tolist()
    assert seen == list(range(len(ds))) * 2


def test_fork_workers_after_the_parent_read(packed):
    """py-lmdb's registry of open environments survives fork: the reader must cope."""
    ds = PackedDataset(packed[1], decode=DecodeCenterCrop(16))
    try:
        first = ds[0][0]  # e.g. a look at one sample before training
        loader = make_loader(ds, 4, shuffle=False, num_workers=1, multiprocessing_context="fork",
                             pin_memory=False)
        assert torch.equal(next(iter(loader))[0][0], first)
    finally:
        ds.reader.close()


def test_pil_path_pixels_equal_imagefolder_loader(packed):
    src, root = packed
    ds = PackedDataset(root, transform=pil_to_uint8)
    loader = make_loader(ds, 1, shuffle=False, num_workers=0, pin_memory=False)
    for i, (x, y) in enumerate(loader):
        if i % 17:
            continue
        data, label, path = _source(src, ds, i)
        with Image.open(src / path) as im:
            ref = pil_to_uint8(im.convert("RGB"))  # torchvision's default loader
        assert torch.equal(x[0], ref) and y.item() == label


def test_random_resized_crop_batches(packed):
    _, root = packed
    ds = PackedDataset(root, decode=DecodeRandomResizedCrop(32))
    x, y = next(iter(make_loader(ds, 8, num_workers=1, pin_memory=False)))
    assert x.shape == (8, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)


def test_pil_samples_get_an_actionable_error(packed):
    _, root = packed
    with pytest.raises(ValueError, match="decode=DecodeRandomResizedCrop"):
        make_loader(PackedDataset(root), 8)
    with pytest.raises(TypeError, match="decode=DecodeRandomResizedCrop"):
        next(iter(make_loader(PILDataset(), 2, num_workers=0)))


# -- collate -----------------------------------------------------------------------------------

def _hwc_images(n, h=5, w=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    # What the decoders hand out: (3, H, W) views of contiguous (H, W, 3) buffers.
    return [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
            for _ in range(n)]


@pytest.mark.parametrize("channels_last", [True, False])
def test_collate_stacks_uint8(channels_last):
    imgs = _hwc_images(4)
    x, y = collate_uint8([(im, i) for i, im in enumerate(imgs)], channels_last=channels_last)
    assert x.dtype == torch.uint8 and x.shape == (4, 3, 5, 7)
    assert torch.equal(x, torch.stack(imgs))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert x.is_contiguous(memory_format=fmt)
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 3]


def test_collate_nested_and_fallback():
    imgs = _hwc_images(3)
    batch = [{"image": im, "meta": (float(i), torch.ones(2)), "views": [im, im]}
             for i, im in enumerate(imgs)]
    out = collate_uint8(batch)
    assert torch.equal(out["image"], torch.stack(imgs))
    assert out["image"].is_contiguous(memory_format=torch.channels_last)
    assert out["views"][1].is_contiguous(memory_format=torch.channels_last)
    assert out["meta"][0].dtype == torch.float64 and out["meta"][1].shape == (3, 2)
    floats = [torch.rand(3, 4, 4) for _ in range(2)]  # not uint8: default_collate's rules
    assert torch.equal(collate_uint8([(f, 0) for f in floats])[0], torch.stack(floats))


def test_collate_refuses_mixed_sizes():
    with pytest.raises(ValueError, match="fixed size"):
        collate_uint8([(_hwc_images(1, 5, 7)[0], 0), (_hwc_images(1, 6, 7)[0], 1)])


def test_collate_crosses_workers_in_channels_last():
    class Images(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return _hwc_images(1, 9, 11, seed=i)[0], i

    loader = make_loader(Images(), 4, shuffle=False, num_workers=1, pin_memory=False)
    x, y = next(iter(loader))
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x, torch.stack([Images()[i][0] for i in range(4)]))


# -- make_loader options ------------------------------------------------------------------------

def test_make_loader_defaults(packed):
    ds = PackedDataset(packed[1], decode=DecodeCenterCrop(32))
    loader = make_loader(ds, 8)
    assert isinstance(loader, PackedLoader)
    n = default_num_workers()
    assert loader.num_workers == n >= 1
    assert loader.persistent_workers and loader.pin_memory == torch.cuda.is_available()
    assert loader.prefetch_factor == max(2, math.ceil(TOTAL_PREFETCH / n))
    assert isinstance(loader.sampler, PackedSampler) and loader.sampler.shuffle
    assert loader.collate_fn.keywords == {"channels_last": True}
    serial = make_loader(ds, 8, num_workers=0)
    assert not serial.persistent_workers and serial.prefetch_factor is None
    sampled = make_loader(ds, 8, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    assert isinstance(sampled, PackedLoader) and isinstance(sampled.sampler, DistributedSampler)


def test_default_workers_shared_by_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = default_num_workers()
    assert alone == usable_cores()  # one rank: a worker on every core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert default_num_workers() == max(1, alone // 64 - 1)
    monkeypatch.setattr(loader_module, "usable_cores", lambda: 32)
    assert default_num_workers() == 1  # never 0: 32 // 64 - 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_num_workers() == 15  # each rank's process keeps a core of its 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_num_workers() == 32


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 4, "num_workers": -1}, "num_workers"),
    ({"batch_size": 4, "num_workers": 2, "prefetch_factor": 0}, "prefetch_factor"),
    ({"batch_size": 4, "num_workers": 0, "prefetch_factor": 2}, "num_workers > 0"),
    ({"batch_size": 4, "shuffle": True, "sampler": [0, 1]}, "exclusive"),
    ({"batch_size": 4, "batch_sampler": [[0, 1]]}, "batch_size=None"),
])
def test_make_loader_rejects_bad_arguments(packed, kwargs, match):
    ds = PackedDataset(packed[1], decode=DecodeCenterCrop(32))
    with pytest.raises(ValueError, match=match):
        make_loader(ds, **kwargs)


def test_make_loader_batch_sampler(packed):
    ds = PackedDataset(packed[1], decode=DecodeCenterCrop(16))
    loader = make_loader(ds, None, batch_sampler=[[3, 1], [0]], num_workers=0)
    assert [y.tolist() for _, y in loader] == [[ds.target(3), ds.target(1)], [ds.target(0)]]


def test_distributed_sampler_split(packed):
    ds = Indexed(PackedDataset(packed[1], decode=DecodeCenterCrop(16)))
    orders = {}
    for epoch in (0, 1):
        for rank in (0, 1):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
            sampler.set_epoch(epoch)
            loader = make_loader(ds, 16, sampler=sampler, num_workers=1, pin_memory=False)
            orders[epoch, rank] = [i for b in loader for i in b[2].tolist()]
        a, b = orders[epoch, 0], orders[epoch, 1]
        assert len(a) == len(b) == len(ds) // 2 and not set(a) & set(b)
        assert sorted(a + b) == list(range(len(ds)))
    assert orders[0, 0] != orders[1, 0]  # set_epoch reshuffles


def test_pickling(packed):
    ds = PackedDataset(packed[1], decode=DecodeRandomResizedCrop(24))
    ds[0]  # opens the shards in this process: they must not travel
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[5][0].shape == (3, 24, 24) and clone.target(5) == ds.target(5)
    loader = make_loader(ds, 4, channels_last=False)
    collate = pickle.loads(pickle.dumps(loader.collate_fn))
    x, _ = collate([ds[i] for i in range(4)])
    assert x.is_contiguous()


def test_worker_rss_flat_over_an_epoch(packed):
    """Reading must not grow workers' private memory with the data read (no per-sample
    objects, no copy-on-write of the parent's): after the first batches it stays flat."""
    ds = Indexed(PackedDataset(packed[1], decode=DecodeCenterCrop(32)))
    loader = make_loader(ds, 4, shuffle=True, num_workers=2, pin_memory=False)
    rss = torch.cat([b[3] for b in loader]).tolist()  # per sample, from both workers
    warm = len(rss) // 6
    base, late = max(rss[:warm]), max(rss[warm:])
    data = sum(len(ds.ds.load(i)["image"]) for i in range(len(ds)))  # ~12 MB read
    assert late - base < min(2 << 20, data // 4), (base, late, data)


def test_background_over_a_loader(packed):
    ds = PackedDataset(packed[1], decode=DecodeCenterCrop(16))
    loader = make_loader(ds, 32, shuffle=False, num_workers=1, pin_memory=False)
    ys = [y for _, y in background(loader)]
    assert torch.cat(ys).tolist() == ds.targets


def test_start_method_names_how_workers_start_without_fixing_the_default():
    import multiprocessing as mp
    from packer.loading.loader import start_method
    before = mp.get_start_method(allow_none=True)
    assert start_method("spawn") == "spawn" and start_method(mp.get_context("forkserver")) == "forkserver"
    assert start_method(None) == (before or mp.get_all_start_methods()[0])
    assert mp.get_start_method(allow_none=True) == before


def test_epochs_of_no_batch_end_with_workers_too(packed):
    """Fewer samples than a batch with drop_last (a small validation set, many ranks): every
    epoch is empty, with workers too (the batch stream looked for a batch for ever)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path
    code = textwrap.dedent(f"""
        from packer import DecodeCenterCrop, PackedDataset, make_loader
        ds = PackedDataset({str(packed[1])!r}, decode=DecodeCenterCrop(32))
        for workers in (0, 2):
            loader = make_loader(ds, 256, drop_last=True,
                                 num_workers=workers, pin_memory=False)
            print(len(loader), *[len(list(loader)) for _ in range(2)])
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["0 0 0", "0 0 0"]
