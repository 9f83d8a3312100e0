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
import posixpath
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

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
def cache_for(url: str, storage_options: Optional[Dict[str, Any]], cache_dir: Optional[os.PathLike],
              keep_all: bool = False):
    """A ``ShardCache`` of ``url`` in ``cache_dir``, or in a temporary folder removed after
    that keeps two shards at most (what a reader pins), so listing a dataset larger than
    the disk works."""
    from .cache import ShardCache
    tmp = None if cache_dir is not None else tempfile.mkdtemp(prefix="packer-cache-")
    try:
        cache = ShardCache(url, cache_dir if tmp is None else tmp, None, storage_options)
        if tmp is not None and not keep_all:
            cache.limit = 2 * max((s["bytes"] for s in cache.manifest["shards"]), default=0)
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
    with cache_for(name, storage_options, cache_dir, keep_all=True) as cache:
        with ThreadPoolExecutor(max(1, parallel)) as pool:
            list(pool.map(lambda k: cache.shard_path(k, pin=False), range(len(cache))))
        write_json_atomic(cache.root / MANIFEST, cache.manifest)
        yield cache.root


def merge_parts(parts: Sequence[Any], dst: Any, storage_options: Optional[Dict[str, Any]],
                *, overwrite: bool, merge: Callable[..., dict]) -> dict:
    """``merge`` where a part or ``dst`` is a URL; returns the merged manifest.

    Each URL part is staged (every file checked against its SHA-256) into a temporary
    folder laid out as the store is, and the parts are merged there. A ``dst`` in the same
    bucket as every part gets only the merged manifest and tables (manifest last): like a
    local merge, it refers to the parts' shards where they are, so keep them. Any other
    ``dst`` gets a self-contained copy (the merged dataset staged: into ``dst`` when local,
    else into the temporary folder, then uploaded). ``merge`` is ``packer.merge``, which
    merges the local folders."""
    from ..staging import stage
    from .destination import Destination
    urls = [p for p in parts if is_url(p)] + ([dst] if is_url(dst) else [])
    base = posixpath.commonpath([u.split("://", 1)[1] for u in urls]) if urls else ""
    in_place = bool(base) and len(urls) == len(parts) + 1 and len({u.split("://")[0] for u in urls}) == 1
    with tempfile.TemporaryDirectory(prefix="packer-merge-") as tmp:
        root = Path(tmp) / "store"
        dest = Destination(dst, storage_options, Path(tmp) / "flat") if is_url(dst) else None
        if dest is not None:
            dest.begin(overwrite)  # refused before any part is fetched
        local = []
        for p in parts:
            where = root / posixpath.relpath(p.split("://", 1)[1].rstrip("/"), base) if is_url(p) else Path(p)
            if is_url(p):
                stage(p, where, progress=False, storage_options=storage_options)
            local.append(where)
        if in_place:  # the manifest refers to the parts' shards, in the bucket already
            dest.work = root / posixpath.relpath(dst.split("://", 1)[1].rstrip("/"), base)
            named_parts(merge(local, dest.work), dest.work, parts)
        else:  # a self-contained copy
            named_parts(merge(local, Path(tmp) / "merged"), Path(tmp) / "merged", parts)
            stage(Path(tmp) / "merged", dst if dest is None else dest.work, progress=False)
            if dest is None:
                return read_manifest(dst)
        final = read_manifest(dest.work)
        dest.finish(final)
        return final


def named_parts(manifest: dict, folder: Path, parts: Sequence[Any]) -> dict:
    """The merged manifest naming its parts as given (URLs as shown), not as staged here."""
    manifest["options"]["merged_from"] = [shown(p) for p in parts]
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest
