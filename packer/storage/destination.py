"""Building into object storage: ``build(source, "s3://bucket/ds")`` or ``Destination(url, ...)``.
A local build into a work folder uploads each shard once journaled, the manifest last (a
reader sees a whole dataset or none); a re-run resumes and skips files already up."""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

from .._util.fsio import write_json_atomic
from ..errors import PackerError
from ..format.manifest import MANIFEST
from ..format.validation import is_plain_name
from .objects import ObjectInfo, Store
from .remote import UPLOAD_MARKER as MARKER, dataset_files, fetch_manifest
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
        self._claimed = False

    def __str__(self) -> str:
        return self.store.shown

    def __repr__(self) -> str:
        return f"Destination({self.store.shown!r}, work_dir={str(self.work)!r})"

    def begin(self, overwrite: bool) -> None:
        """Before the build. A finished dataset at the URL is refused unless ``overwrite`` (then
        unmade: its manifest first, then its files) or it is the work folder's own; objects
        packer did not write are refused. Whether the work folder's dataset is this build's is
        the build's to decide (its fingerprint)."""
        self._there = self.store.listing(missing_ok=True)
        local = self.work / MANIFEST
        local = local.read_bytes() if local.is_file() else None
        try:
            self._record = json.loads((self.work / RECORD).read_text("utf-8"))
        except (OSError, ValueError):
            self._record = {}
        if MANIFEST not in self._there:
            folder = posixpath.basename(self.store.root)  # "ds/", a console's folder object
            strangers = sorted(n for n, info in self._there.items() if n not in self._record
                               and n != MARKER and not (n == folder and info.size == 0))
            if strangers and MARKER not in self._there:
                raise PackerError(f"{self.store.shown} holds objects packer did not write "
                                  f"({', '.join(strangers[:5])}{', ...' if strangers[5:] else ''}"
                                  f"); pick a new or empty prefix for the dataset, or move "
                                  f"them away")
            self._claim()  # now: a bucket that cannot be written stops the build before it starts
            return
        if local is not None and not overwrite and self.store.read_bytes(MANIFEST) == local:
            return
        if not overwrite:
            raise PackerError(f"{self.store.shown} already holds a finished dataset; "
                              f"replace it with overwrite=True")
        try:
            old = [f["path"] for f in dataset_files(fetch_manifest(self.store))]
        except PackerError:  # not a manifest packer can read: only it goes
            old = []
        self._claim()  # before the manifest goes: a re-run knows the rest is packer's
        self.store.call(lambda: self.store.fs.rm_file(self.store.key(MANIFEST)),
                        f"replacing {self.store.show(MANIFEST)}")  # first: no reader takes half
        files = sorted({r for r in old if is_plain_name(r) and r in self._there})
        if files:
            self.store.call(lambda: self.store.fs.rm([self.store.key(r) for r in files]),
                            f"removing the old dataset's files from {self.store.shown}")
        for name in [MANIFEST] + files:
            del self._there[name]

    def _claim(self) -> None:
        """Put ``MARKER`` (the prefix is packer's: a re-run from another work folder may replace
        its objects) before this run's first change; ``finish`` removes it after the manifest."""
        if not self._claimed and MARKER not in self._there:
            self.store.call(lambda: self.store.fs.pipe_file(self.store.key(MARKER), b"{}"),
                            f"writing {self.store.show(MARKER)}")
        self._claimed = True

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
            self._claim()
            self.store.upload(self.work / MANIFEST, MANIFEST)
            self.uploaded.append(MANIFEST)
        if self._claimed or MARKER in self._there:
            self.store.call(lambda: self.store.fs.rm_file(self.store.key(MARKER)),
                            f"finishing {self.store.shown}")
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
        with self._lock:
            self._claim()
        version = self.store.upload(self.work / rel, rel).version
        with self._lock:
            self._record[rel] = [size, sha256, version]
            self._there[rel] = ObjectInfo(size, version)
            write_json_atomic(self.work / RECORD, self._record)
            self.uploaded.append(rel)


def as_destination(dst: Any) -> Optional[Destination]:
    """``dst`` as a ``Destination`` (a URL: options from the environment); None for a folder."""
    if isinstance(dst, Destination):
        return dst
    return Destination(dst) if is_url(dst) else None
