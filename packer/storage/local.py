"""A dataset named by path or URL, made local for the read-only commands (info, ls, cat,
verify) and for merge.

A local path passes through untouched (nothing here imports fsspec for it). A URL goes
through a ``ShardCache`` in ``cache_dir`` (a temporary folder, removed afterwards, when none
is given): ``manifest`` reads only the manifest; ``opened_reader`` fetches a shard the first
time a record of it is read; ``local_root`` fetches every shard (each one's SHA-256 checked
as it arrives) and writes the manifest beside them, so the folder is a local dataset that
the local checks then read.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from .._util.fsio import write_json_atomic
from ..format.manifest import MANIFEST, read_manifest
from .urls import is_url, redact


def shown(name: Any) -> str:
    """``name`` as messages and results show it (a URL without its credentials)."""
    return redact(name) if is_url(name) else str(name)


def manifest(name: Any, storage_options: Optional[Dict[str, Any]] = None) -> dict:
    """The manifest of the dataset at a path or URL (for a URL: one HEAD and one GET)."""
    if not is_url(name):
        return read_manifest(name)
    from .objects import Store
    from .remote import fetch_manifest
    return fetch_manifest(Store(name, storage_options))


@contextlib.contextmanager
def cache_for(url: str, storage_options: Optional[Dict[str, Any]], cache_dir: Optional[os.PathLike]):
    """A ``ShardCache`` of ``url`` in ``cache_dir``, or in a temporary folder removed after."""
    from .cache import ShardCache
    tmp = None if cache_dir is not None else tempfile.mkdtemp(prefix="packer-cache-")
    try:
        cache = ShardCache(url, cache_dir if tmp is None else tmp, None, storage_options)
        try:
            yield cache
        finally:
            cache.close()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def opened_reader(name: Any, storage_options: Optional[Dict[str, Any]] = None,
                  cache_dir: Optional[os.PathLike] = None) -> Iterator[Any]:
    """A ``ShardReader`` of the dataset at a path or URL (a URL's shards fetched on first use)."""
    from ..reading.reader import ShardReader
    with contextlib.ExitStack() as stack:
        if is_url(name):
            reader = ShardReader(None, cache=stack.enter_context(cache_for(name, storage_options, cache_dir)))
        else:
            reader = ShardReader(name)
        stack.callback(reader.close)
        yield reader


@contextlib.contextmanager
def local_root(name: Any, storage_options: Optional[Dict[str, Any]] = None,
               cache_dir: Optional[os.PathLike] = None, *, parallel: int = 4) -> Iterator[Path]:
    """A local folder holding the whole dataset at a path or URL: the path itself, or for a
    URL the cache folder with every shard fetched and verified and ``manifest.json`` naming
    the cached files (removed afterwards unless ``cache_dir`` was given)."""
    if not is_url(name):
        yield Path(name)
        return
    with cache_for(name, storage_options, cache_dir) as cache:
        with ThreadPoolExecutor(max(1, parallel)) as pool:
            list(pool.map(lambda k: cache.shard_path(k, pin=False), range(len(cache))))
        write_json_atomic(cache.root / MANIFEST, cache.manifest)
        yield cache.root
