"""A reader whose files are replaced under it fails clearly.

Readers open shard files lazily, in whichever process reads (DataLoader workers start
later, by fork). If the dataset is re-staged in place between opening the dataset and
reading it, those files are another dataset's: reading them with the offsets and labels
read at opening would hand out wrong records and labels. Each process that opens a shard
must notice the file is not the one the dataset was opened on and raise a FormatError.
"""
from __future__ import annotations

import json
import re

import pytest
import torch.utils.data

from packer import PackedDataset, build, stage, unstage
from packer.demo import make_image_folder
from packer.errors import FormatError


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory) -> tuple:
    """A and B: different images and labels (B: other photos, 2 classes, 30 images)."""
    root = tmp_path_factory.mktemp("identity")
    a = build(make_image_folder(root / "src_a", images=24, classes=3), root / "a",
              progress=False, workers=0)
    b = build(make_image_folder(root / "src_b", images=30, classes=2, seed=9), root / "b",
              progress=False, workers=0)
    assert a.manifest["shards"][0]["path"] == b.manifest["shards"][0]["path"]
    return root / "a", root / "b"


@pytest.fixture()
def replaced(two_datasets, tmp_path):
    """``PackedDataset(TARGET)`` opened on A (nothing read yet); TARGET then unstaged and
    B staged into it."""
    a, b = two_datasets
    target = tmp_path / "target"
    stage(a, target, progress=False)
    ds = PackedDataset(target)
    assert len(ds) == 24
    unstage(target)
    assert not target.exists()
    stage(b, target, progress=False)
    assert len(PackedDataset(target)) == 30
    return ds


def test_reading_in_this_process_after_restage_fails_clearly(replaced):
    with pytest.raises(FormatError, match="replaced"):
        replaced[0]
    with pytest.raises(FormatError, match="replaced"):
        replaced.load(len(replaced) - 1)


def test_dataloader_workers_started_after_restage_fail_clearly(replaced):
    loader = torch.utils.data.DataLoader(replaced, batch_size=4, num_workers=2,
                                         collate_fn=lambda batch: batch)
    batches = iter(loader)
    try:
        for _ in batches:
            pass
    except Exception as e:  # a worker's exception, re-raised here by the DataLoader
        error = e.with_traceback(None)  # holds no frame, so the workers stop at the `del`
    else:
        error = None
    del batches
    assert error is not None, "the DataLoader read another dataset's files without an error"
    assert isinstance(error, FormatError) and "replaced" in str(error), repr(error)


def test_each_build_gets_its_own_build_id(tmp_path):
    src = make_image_folder(tmp_path / "src", images=24, classes=3)
    ids = []
    for name in ("one", "two"):
        build(src, tmp_path / name, progress=False, workers=0)
        ids.append(json.loads((tmp_path / name / "manifest.json").read_text()).get("build_id"))
    for i in ids:
        assert isinstance(i, str) and re.fullmatch(r"[0-9a-f]{32}", i), i
    assert ids[0] != ids[1]
    # The shards of the two builds are byte for byte the same; only the id tells them apart.
    assert (tmp_path / "one" / "shard-00000.lmdb").read_bytes() == \
        (tmp_path / "two" / "shard-00000.lmdb").read_bytes()
