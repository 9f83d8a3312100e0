"""A packed dataset in object storage: ``RemoteDataset`` (what staging reads from a URL) and
``upload_dataset`` (the manifest last, so a reader never sees half of one)."""
from __future__ import annotations

import json
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set

from ..errors import FormatError, PackerError
from ..format.manifest import MANIFEST, parse_manifest, read_manifest, side_tables
from .objects import NotFound, ObjectInfo, Store

UPLOAD_MARKER = ".packer-upload.json"  # present while an upload is unfinished


def dataset_files(man: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The manifest's file entries (``path``, ``bytes``, ``sha256``): shards, then side tables."""
    return man["shards"] + [entry for _, entry, _ in side_tables(man)]


def fetch_manifest(store: Store) -> Dict[str, Any]:
    """The manifest of the dataset at ``store``; a missing one says it is not (yet) a dataset."""
    try:
        data = store.read_bytes(MANIFEST)
    except NotFound:
        raise FormatError(f"{store.shown} is not a packer dataset: {store.show(MANIFEST)} not "
                          f"found (a wrong URL, or an upload that has not finished)") from None
    return parse_manifest(data, store.show(MANIFEST))


def check_parts(store: Store, paths: Iterable[str], known: Set[str]) -> None:
    """Refuse a shard path outside the dataset folder (a merged dataset's part, ``../p0/NAME``)
    whose folder is not a packer dataset, as for a local dataset: else a manifest could name
    any object of the bucket. One HEAD per folder not in ``known`` (then added to it)."""
    for rel in paths:
        parent = posixpath.dirname(rel)
        if parent and parent not in known:
            try:
                store.stat(posixpath.join(parent, MANIFEST))
            except NotFound:
                raise FormatError(f"shard {rel} in {store.show(MANIFEST)} lies in "
                                  f"{store.show(parent)}, which is not a packer dataset; "
                                  f"refusing it") from None
            known.add(parent)


class RemoteDataset(str):
    """The dataset at ``url`` (see the module docstring); ``storage_options`` as for ``Store``."""
    store: Store

    def __new__(cls, url: str, storage_options: Optional[Dict[str, Any]] = None):
        store = Store(url, storage_options)
        self = super().__new__(cls, store.shown)
        self.store, self._listing, self._parts = store, None, set()
        return self

    def resolve(self) -> "RemoteDataset":
        """Itself: the source a staged copy records (as a local dataset records its real path)."""
        return self

    def __deepcopy__(self, memo) -> "RemoteDataset":
        return self

    def __reduce__(self):
        return str, (str(self),)  # pickled, it is the URL as shown, nothing more

    def read_manifest(self) -> Dict[str, Any]:
        return fetch_manifest(self.store)

    def __truediv__(self, rel: str) -> "RemoteFile":
        return RemoteFile(self, rel)

    def shard(self, rel: str) -> "RemoteFile":
        """The shard at manifest path ``rel``. As for a local dataset, one outside the folder
        (a merged dataset's part) must lie in a packer dataset."""
        check_parts(self.store, [rel], self._parts)
        return RemoteFile(self, rel)

    def info(self, rel: str) -> Optional[ObjectInfo]:
        """``rel`` as listed (one LIST for the folder; a HEAD for a part's file); None if absent."""
        if "/" not in rel:
            if self._listing is None:
                self._listing = self.store.listing(missing_ok=True)
            return self._listing.get(rel)
        try:
            return self.store.stat(rel)
        except NotFound:
            return None


class RemoteFile(str):
    """One file of a ``RemoteDataset``: its URL as shown, its listed size, and a download."""

    def __new__(cls, dataset: RemoteDataset, rel: str):
        self = super().__new__(cls, dataset.store.show(rel))
        self.dataset, self.rel = dataset, rel
        return self

    def __reduce__(self):
        return str, (str(self),)

    @property
    def size(self) -> Optional[int]:
        info = self.dataset.info(self.rel)
        return None if info is None else info.size

    def download(self, dest: Path, size: int, sha256: Optional[str], progress=None) -> None:
        """Into the new file ``dest``, verified (``Store.download``)."""
        self.dataset.store.download(self.rel, dest, size, sha256, progress,
                                    expect=self.dataset.info(self.rel))


def upload_dataset(src: os.PathLike, url: str, storage_options: Optional[Dict[str, Any]] = None,
                   *, workers: int = 4) -> List[str]:
    """Put the finished local dataset ``src`` under ``url``, the manifest last; an interrupted
    upload resumes (``.packer-upload.json``); an older dataset there is unmade first. Returns
    the names uploaded."""
    src = Path(src)
    man = read_manifest(src)
    files = dataset_files(man)
    if any("/" in f["path"] for f in files):
        raise PackerError(f"{src} is a merged dataset whose shards live in its parts; stage it "
                          f"into one folder first (packer stage), then upload the staged copy")
    store = Store(url, storage_options)
    body = (src / MANIFEST).read_bytes()
    ident = json.dumps({"build_id": man.get("build_id"), "manifest_bytes": len(body),
                        "shards": [s["sha256"] for s in man["shards"]]}).encode()
    there = store.listing(missing_ok=True)
    if MANIFEST in there and store.read_bytes(MANIFEST) == body:
        return []
    resuming = UPLOAD_MARKER in there and store.read_bytes(UPLOAD_MARKER) == ident
    store.call(lambda: store.fs.pipe_file(store.key(UPLOAD_MARKER), ident), f"writing {store.shown}")
    if MANIFEST in there:
        store.call(lambda: store.fs.rm_file(store.key(MANIFEST)), f"replacing {store.show(MANIFEST)}")
    todo = [f["path"] for f in files
            if not (resuming and f["path"] in there and there[f["path"]].size == f["bytes"])]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        list(pool.map(lambda rel: store.upload(src / rel, rel), todo))
    store.upload(src / MANIFEST, MANIFEST)
    store.call(lambda: store.fs.rm_file(store.key(UPLOAD_MARKER)), f"finishing {store.shown}")
    return todo + [MANIFEST]
