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

import multiprocessing.util
import os
import tempfile
import warnings
from pathlib import Path

import pytest

from helpers import OddTree, make_odd_tree
from packer.demo import load_photos, make_image_folder


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """``TMPDIR`` (and so ``tempfile``'s, multiprocessing's and torch's temporary folders, in
    this process and the ones it starts) inside pytest's basetemp, before the test modules
    are imported: importing torchvision already makes a folder in the temporary folder."""
    factory = getattr(config, "_tmp_path_factory", None)  # set by pytest's tmp_path plugin
    if factory is not None:
        # Except this process's multiprocessing folder (its listeners' sockets): made now, in
        # the system's, as multiprocessing removes it at exit, after pytest removed basetemp.
        multiprocessing.util.get_temp_dir()
        config.stash[OLD_TMPDIR] = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(factory.mktemp("TMPDIR", numbered=False))
        tempfile.tempdir = None  # recomputed from TMPDIR on next use


def pytest_unconfigure(config):
    if OLD_TMPDIR in config.stash:
        if config.stash[OLD_TMPDIR] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = config.stash[OLD_TMPDIR]
        tempfile.tempdir = None


OLD_TMPDIR = pytest.StashKey()

# Files the default run leaves to `pytest -m slow` (the README's second command; CI runs
# both): their tests start interpreters or run scripts end to end, seconds each (importing
# torch alone takes ~4 s on 2 cores). Single slow tests carry @pytest.mark.slow themselves.
SLOW_FILES = {"test_snippets.py", "test_install.py", "test_train_example.py",
              "test_distributed_recipes.py", "test_loader_exit.py", "test_platforms.py",
              "test_hostile_lmdb.py", "test_gpu_worker.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if path.name in SLOW_FILES or path.parent.name == "benchmarks":
            item.add_marker(pytest.mark.slow)


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
    from packer.sources import ImageFolder
    dst = tmp_path_factory.mktemp("odd_built") / "dst"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(ImageFolder(odd_tree.root, allow_empty=True), dst, workers=2, progress=False,
              shard_size=1 << 20)
    return dst


@pytest.fixture(scope="session")
def photo_src(tmp_path_factory) -> Path:
    """48 ImageNet-like JPEGs (~3.5 MB) in 4 classes."""
    return make_image_folder(tmp_path_factory.mktemp("photos") / "src", images=48, classes=4, seed=1)


