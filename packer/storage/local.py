"""A dataset named by path or URL, made local for info/ls/cat/verify and merge: a path passes
through; a URL goes through a ``ShardCache`` (a temporary one unless ``cache_dir``)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from .._util.fsio import write_json_atomic
from ..errors import PackerError
from ..format.manifest import MANIFEST, read_manifest
from .cache import ShardCache
from .objects import Store
from .remote import dataset_files, fetch_manifest
from .urls import is_url, redact


def shown(name: Any) -> str:
    """``name`` as messages and results show it (a URL without its credentials)."""
    return redact(name) if is_url(name) else str(name)


def manifest(name: Any, storage_options: Optional[Dict[str, Any]] = None) -> dict:
    """The manifest of the dataset at a path or URL (for a URL: one HEAD and one GET)."""
    if not is_url(name):
        return read_manifest(name)
    return fetch_manifest(Store(name, storage_options))


@contextlib.contextmanager
def cache_for(url: str, storage_options: Optional[Dict[str, Any]], cache_dir: Optional[os.PathLike],
              keep_all: bool = False):
    """A ``ShardCache`` of ``url`` in ``cache_dir``, or in a temporary one keeping two shards at
    most, so listing a dataset larger than the disk works."""
    with contextlib.ExitStack() as stack:
        tmp = None if cache_dir is not None else tempfile.mkdtemp(prefix="packer-cache-")
        if tmp is not None:
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        cache = ShardCache(url, cache_dir if tmp is None else tmp, None, storage_options)
        stack.callback(cache.close)
        if tmp is not None and not keep_all:
            cache.limit = 2 * max((s["bytes"] for s in cache.manifest["shards"]), default=0)
        yield cache


@contextlib.contextmanager
def local_root(name: Any, storage_options: Optional[Dict[str, Any]] = None,
               cache_dir: Optional[os.PathLike] = None, *, parallel: int = 4) -> Iterator[Path]:
    """A local folder holding the whole dataset at a path or URL (for a URL, every shard fetched
    and verified; removed afterwards unless ``cache_dir`` was given)."""
    if not is_url(name):
        yield Path(name)
        return
    with cache_for(name, storage_options, cache_dir, keep_all=True) as cache:
        with ThreadPoolExecutor(max(1, parallel)) as pool:
            list(pool.map(lambda k: cache.shard_path(k, pin=False), range(len(cache))))
        cache.write_manifest()
        yield cache.root


def fetch_dataset(url: str, folder: os.PathLike, storage_options: Optional[Dict[str, Any]] = None,
                  *, parallel: int = 4) -> Path:
    """A plain copy of the dataset at ``url`` in ``folder``, its files under their own names,
    each checked against its SHA-256, the manifest last (a folder already holding this very
    manifest is complete and kept). For ``merge`` of parts in object storage."""
    folder, store = Path(folder), Store(url, storage_options)
    man = fetch_manifest(store)
    if (folder / MANIFEST).is_file() and read_manifest(folder) == man:
        return folder
    files = dataset_files(man)
    if any("/" in f["path"] for f in files):
        raise PackerError(f"{store.shown} is itself a merged dataset; merge its parts instead")
    folder.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        list(pool.map(lambda f: store.download(f["path"], folder / f["path"], f["bytes"],
                                               f.get("sha256")), files))
    write_json_atomic(folder / MANIFEST, man)
    return folder
