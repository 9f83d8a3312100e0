"""Fixtures of the GPU-path tests: a packed dataset mixing photo JPEGs with every kind of
file nvJPEG does not take (those are decoded by the workers)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import KINDS, kind_bytes
from packer import build
from packer.demo import make_image_folder

@pytest.fixture(scope="module")
def mixed_built(tmp_path_factory, photos):
    tmp = tmp_path_factory.mktemp("gpu_decode")
    src = make_image_folder(tmp / "src", images=20, classes=2, seed=3)
    for k, name in enumerate(KINDS):
        (src / "class_01" / f"odd_{name}").write_bytes(kind_bytes(photos, name, seed=k))
    build(src, tmp / "packed", workers=0, progress=False)
    return tmp / "packed"


@pytest.fixture
def mixed(mixed_built, tmp_path):
    """A packed dataset of 20 photo JPEGs in 2 classes plus one file of each odd kind.

    A fresh copy per test (1.5 MB): DataLoader workers forked while the parent process has
    a shard of the same file open cannot open it (py-lmdb refuses a second open).
    """
    return Path(shutil.copytree(mixed_built, tmp_path / "packed"))


