"""Shared fixtures: small, realistic image folders made on the fly (no downloads).

``odd_tree`` is one ImageFolder tree with every awkward case the issue lists (odd modes,
broken files, unicode and spaces, nesting, symlinks, an empty class); ``photo_src`` is a
plain folder of ImageNet-like JPEGs for the shard, resume and disk-full tests. Both are
session-scoped and must be treated as read-only; builds go to each test's ``tmp_path``
(or to the session-scoped ``odd_built``, also read-only: copy it before tampering).
Helper functions are in ``helpers.py``.

Whatever the code under test (or a process it starts) puts in a temporary folder lands under
pytest's own basetemp (``TMPDIR``): a test run leaves nothing else in /tmp.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import pytest

from helpers import OddTree, make_odd_tree
from packer.demo import load_photos, make_image_folder


@pytest.fixture(scope="session", autouse=True)
def tmpdir_under_basetemp(tmp_path_factory):
    """``TMPDIR`` (and so ``tempfile``, multiprocessing's and torch's temporary folders, in
    this process and the ones it starts) inside pytest's basetemp for the session."""
    tmp = tmp_path_factory.mktemp("TMPDIR", numbered=False)
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # recomputed from TMPDIR on next use
    yield tmp
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def photos():
    return load_photos()


@pytest.fixture(scope="session")
def odd_tree(tmp_path_factory, photos) -> OddTree:
    return make_odd_tree(tmp_path_factory.mktemp("odd"), photos)


@pytest.fixture(scope="session")
def odd_built(odd_tree, tmp_path_factory) -> Path:
    """``odd_tree`` built with default options (read-only: copy before changing it)."""
    from packer import build
    dst = tmp_path_factory.mktemp("odd_built") / "dst"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(odd_tree.root, dst, workers=2, progress=False, shard_size=1 << 20, allow_empty=True)
    return dst


@pytest.fixture(scope="session")
def photo_src(tmp_path_factory) -> Path:
    """48 ImageNet-like JPEGs (~3.5 MB) in 4 classes."""
    return make_image_folder(tmp_path_factory.mktemp("photos") / "src", images=48, classes=4, seed=1)


