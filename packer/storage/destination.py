"""Building into object storage: ``build(source, "s3://bucket/ds")`` or ``Destination(url, ...)``.
A local build into a work folder uploads each shard once journaled, the manifest last (a
reader sees a whole dataset or none); a re-run resumes and skips files already up."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

from .._util.fsio import write_json_atomic
from ..errors import PackerError
from ..format.manifest import MANIFEST
from .objects import ObjectInfo, Store
from .remote import dataset_files
from .urls import is_url

RECORD = ".packer-uploaded.json"  # in the work folder: what went up, with its version


class Destination:
    """A dataset's place in object storage, for ``build``: ``url``, ``storage_options`` (as for
    ``Store``) and the local ``work_dir`` (default: one under the temp dir named after the URL,
    removed after a successful upload). ``str()`` is the URL with credentials redacted."""

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None,
                 work_dir: Optional[os.PathLike] = None, *, parallel: int = 4):
        if not is_url(url):
            raise PackerError(f"Destination(url): {url!r} is not a URL (s3://bucket/prefix); "
                              f"build into a local folder by passing its path")
        self.store = Store(url, storage_options)
        self.keep = work_dir is not None
        self.work = Path(work_dir) if work_dir is not None else Path(tempfile.gettempdir()) / (
            "packer-build-" + hashlib.sha256(self.store.shown.encode()).hexdigest()[:16])
        self.parallel = max(1, parallel)
        self.uploaded: List[str] = []  # what this run sent, in order
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None
        self._futures: List[Future] = []
        self._there: Dict[str, ObjectInfo] = {}
        self._record: Dict[str, list] = {}

    def __str__(self) -> str:
        return self.store.shown

    def __repr__(self) -> str:
        return f"Destination({self.store.shown!r}, work_dir={str(self.work)!r})"

    def begin(self, overwrite: bool) -> Optional[dict]:
        """Before the build: the work folder's finished manifest when only uploading is left, else
        None. A finished dataset at the URL is refused unless ``overwrite`` (then unmade first)."""
        self._there = self.store.listing(missing_ok=True)
        local = self.work / MANIFEST
        local = local.read_bytes() if local.is_file() else None
        try:
            self._record = json.loads((self.work / RECORD).read_text("utf-8"))
        except (OSError, ValueError):
            self._record = {}
        if MANIFEST in self._there:
            if local is not None and not overwrite and self.store.read_bytes(MANIFEST) == local:
                return json.loads(local)
            if not overwrite:
                raise PackerError(f"{self.store.shown} already holds a finished dataset; "
                                  f"replace it with overwrite=True")
            self.store.call(lambda: self.store.fs.rm_file(self.store.key(MANIFEST)),
                            f"replacing {self.store.show(MANIFEST)}")
            del self._there[MANIFEST]
            return None
        return json.loads(local) if local is not None and not overwrite else None

    def shard_done(self, shard: dict) -> None:
        """A shard the build finished (in ``work``): uploaded in the background. Raises the
        error of an earlier upload that failed, which stops the build."""
        for f in self._futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="packer-upload")
        self._futures.append(self._pool.submit(self._put, shard["path"], shard["bytes"], shard["sha256"]))

    def finish(self, manifest: dict) -> None:
        """After the build: wait for the shards, send what is not there yet, the manifest
        last; then remove a default work folder."""
        files = [f for f in dataset_files(manifest)
                 if "/" not in f["path"]]  # the others are a merge's parts, there already
        try:
            for f in self._futures:
                f.result()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="packer-upload")
            list(self._pool.map(lambda f: self._put(f["path"], f["bytes"], f["sha256"]), files))
        finally:
            self.abort()
        body = (self.work / MANIFEST).read_bytes()
        if MANIFEST not in self._there or self.store.read_bytes(MANIFEST) != body:
            self.store.upload(self.work / MANIFEST, MANIFEST)
            self.uploaded.append(MANIFEST)
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    def abort(self) -> None:
        """Stop: queued uploads dropped, running ones waited for (so the record is true)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._futures = []

    def _put(self, rel: str, size: int, sha256: str) -> None:
        there, sent = self._there.get(rel), self._record.get(rel)
        if there is not None and sent == [size, sha256, there.version] and there.size == size:
            return  # uploaded by an earlier run, unchanged since
        version = self.store.upload(self.work / rel, rel).version
        with self._lock:
            self._record[rel] = [size, sha256, version]
            self._there[rel] = ObjectInfo(size, version)
            write_json_atomic(self.work / RECORD, self._record)
            self.uploaded.append(rel)


def as_destination(dst: Any) -> Optional[Destination]:
    """``dst`` as a ``Destination`` (a URL: storage options from the environment), or None
    for a local folder."""
    if isinstance(dst, Destination):
        return dst
    return Destination(dst) if is_url(dst) else None
