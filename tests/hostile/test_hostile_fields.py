"""Crafted records and side tables of format 1.2 (typed fields, paths table, columns): every
reader gives a FormatError naming the problem, never a raw exception or an allocation sized
by the attacker; ``packer verify`` reports them."""
from __future__ import annotations

import shutil
import subprocess
import sys
from array import array
from pathlib import Path

import msgpack
import pytest

from packer import PackedDataset, build, verify, write
from packer.sources import Coco
from packer.demo.images import load_photos, make_image
from packer.demo.scenes import make_detection_folder
from packer.errors import FormatError, PackerError
from packer.format.records import pack_record

from helpers import edit_manifest, retable, rewrite_first_record, sha


@pytest.fixture(scope="module")
def det(tmp_path_factory) -> Path:
    root = make_detection_folder(tmp_path_factory.mktemp("det") / "det", images=6, seed=4)
    dst = root.parent / "ds"
    build(Coco(root / "images", root / "annotations.json"), dst, progress=False, workers=0)
    return dst


@pytest.fixture
def ds(det, tmp_path) -> Path:
    out = tmp_path / "ds"
    shutil.copytree(det, out)
    return out


def test_offsets_past_the_shard_are_refused_before_reading(ds):
    table = array("Q", (ds / "offsets.u64").read_bytes())
    table[1] = 1 << 40  # record 0's length: a 1 TiB read
    retable(ds, "offsets", "offsets.u64", table)
    with pytest.raises(FormatError, match="offsets.u64 points past the end"):
        PackedDataset(ds)[0]
    rep = verify(ds, progress=False)
    assert not rep.ok and any("points past the end" in p for p in rep.problems)


@pytest.mark.parametrize("kind", ["truncated", "deep", "int key"])
def test_records_that_are_not_msgpack_are_format_errors(ds, kind):
    good = pack_record(b"\xff\xd8" * 10, path="a.jpg", width=1, height=1, format="JPEG",
                       mode="RGB")
    deep = b"\x82\xa5image\xc4\x01x\xacsegmentation" + b"\x91" * 10000 + b"\x90"  # 10,000 deep
    record = {"truncated": good[:-3], "deep": deep,
              "int key": msgpack.packb({1: 2, "image": b"x"})}[kind]
    rewrite_first_record(ds, record)
    with pytest.raises(FormatError):
        PackedDataset(ds)[0]
    rep = verify(ds, progress=False)  # reports, and goes on to the other records
    assert not rep.ok and rep.checked_records == 6
    res = subprocess.run([sys.executable, "-m", "packer", "ls", "--json", str(ds)],
                         capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.startswith("Error: ") and "Traceback" not in res.stderr


def test_a_paths_table_out_of_order_is_refused(ds):
    table = array("Q", (ds / "paths.u64").read_bytes())
    table[0] = table[3]  # ends going backwards
    retable(ds, "paths.index", "paths.u64", table)
    with pytest.raises(FormatError, match="does not index"):
        PackedDataset(ds).samples[0]
    assert any("does not index" in p for p in verify(ds, progress=False).problems)


def test_a_path_that_disagrees_with_its_record_is_reported(ds):
    text = bytearray((ds / "paths.utf8").read_bytes())
    text[0:1] = b"X"
    (ds / "paths.utf8").write_bytes(bytes(text))
    edit_manifest(ds, lambda m: m["paths"]["text"].update(sha256=sha(ds / "paths.utf8")))
    rep = verify(ds, progress=False)
    assert not rep.ok and any("paths.utf8's" in p for p in rep.problems)


def test_a_column_whose_dtype_is_not_its_fields_is_refused(ds):
    edit_manifest(ds, lambda m: m["columns"]["width"].update(dtype="float64"))
    with pytest.raises(FormatError, match="columns.width.dtype.*int32"):
        PackedDataset(ds)


def test_masks_of_a_crafted_rle_are_refused_before_allocating(ds):
    rec = PackedDataset(ds).load(0)
    rec["segmentation"] = [{"size": [100000, 100000], "counts": [1, 2]}] * len(
        rec["segmentation"])
    rewrite_first_record(ds, msgpack.packb(rec, use_bin_type=True))
    with pytest.raises(FormatError, match="RLE of size"):
        PackedDataset(ds, masks=True)[0]
    assert any("segmentation: an RLE" in p for p in verify(ds, progress=False).problems)


def test_epoch_loader_follows_a_new_seed(tmp_path):
    from packer import PackedSampler, make_loader
    import torch
    from torch.utils.data import Dataset

    class Idx(Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return torch.zeros(3, 2, 2, dtype=torch.uint8), i
    ds = Idx()
    s = PackedSampler(ds, seed=0)
    fast = make_loader(ds, 4, sampler=s, num_workers=2, pin_memory=False)
    list(fast)
    s.load_state_dict({"seed": 7, "epoch": 1, "consumed": 0})
    got = [y.tolist() for _, y in fast]
    ref = PackedSampler(ds, seed=7)
    ref.set_epoch(1)
    want = list(ref)
    assert [i for b in got for i in b] == want


def test_write_resume_checks_paths_too(tmp_path):
    import random
    rng, photos = random.Random(0), load_photos()
    images = [make_image(rng, photos) for _ in range(30)]

    def samples(prefix, crash=None):
        for i, im in enumerate(images):
            if i == crash:
                raise RuntimeError("killed")
            yield {"image": im, "path": f"{prefix}/{i}.jpg", "n": i}
    with pytest.raises(RuntimeError):
        write(tmp_path / "w", samples("a", crash=28), shard_size=1 << 20, workers=1,
              progress=False)
    with pytest.raises(PackerError, match="samples differ"):
        write(tmp_path / "w", samples("b"), shard_size=1 << 20, progress=False)
    assert write(tmp_path / "w", samples("a"), shard_size=1 << 20, progress=False).resumed_shards
