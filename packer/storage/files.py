"""A build's source in object storage: ``RemoteFolder``, a prefix of images (an ImageFolder, or
the images a COCO/YOLO/table file names) listed once with sizes, each file read whole with
retries; and ``ObjectFile``, an annotation file named by URL."""
from __future__ import annotations

import copy
import os
import posixpath
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

from .._util.fsio import NotAFile
from .objects import Grown, NotFound, Store
from .urls import is_url


class RemoteFolder:
    """The folder at ``url`` (``storage_options`` as for ``Store``): what ``ImageList.root`` is
    for a source in object storage. It has no ``__fspath__``: a local file call on it fails
    rather than read a local path of the same name."""

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None):
        self.store = Store(url, storage_options)
        self._sizes: Optional[Dict[str, int]] = None

    def __str__(self) -> str:
        return self.store.shown

    __repr__ = __str__

    @property
    def name(self) -> str:
        return posixpath.basename(self.store.shown.rstrip("/"))

    def resolve(self) -> "RemoteFolder":
        return self  # what the manifest records as the source: the URL as shown

    def __truediv__(self, rel: str) -> str:
        return self.store.show(rel)

    def sizes(self) -> Dict[str, int]:
        """Every object below the folder, by path relative to it: one paged recursive LIST.
        A key that is no plain path (``imgs/../x.jpg``, ``a//b``, ``./c``: S3 takes any
        string) is left out with a warning: read by its path it would be another object."""
        if self._sizes is None:
            root = self.store.root + "/"
            try:
                found = self.store.call(lambda: self.store.fs.find(root, detail=True),
                                        f"listing {self.store.shown}")
            except NotFound:
                found = {}
            listed = {name[len(root):]: int(info.get("size") or 0)
                      for name, info in found.items()
                      if name.startswith(root) and info.get("type") != "directory"
                      and not name.endswith("/")}
            odd = {r for r in listed if posixpath.normpath(r) != r or r.split("/")[0] == ".."}
            if odd:
                warnings.warn(f"{len(odd)} object(s) under {self} have keys that are no plain "
                              f"path ('..', '.' or an empty part, e.g. {min(odd)!r}); left out")
            self._sizes = {r: n for r, n in listed.items() if r not in odd}
        return self._sizes

    def subset(self, rels: Iterable[str]) -> "RemoteFolder":
        """The same folder knowing only the sizes of ``rels`` (what one task reads)."""
        out = copy.copy(self)
        listed = self.sizes()
        out._sizes = {r: listed[r] for r in rels if r in listed}
        return out

    def is_dir(self) -> bool:
        return bool(self.sizes())

    def read(self, rel: str, limit: Optional[int] = None, limit_name: str = "the limit") -> bytes:
        """The object ``rel`` whole (its listed size; retried), as ``read_file`` reads a local
        file: ``FileNotFoundError`` if not listed, ``NotAFile`` if larger than ``limit`` or
        than listed (replaced since the LIST: never its first ``size`` bytes only)."""
        size = self.sizes().get(rel)
        if size is None:
            raise FileNotFoundError(2, "not found", self / rel)
        if limit is not None and size > limit:
            raise NotAFile(f"{size:,} bytes, more than {limit_name} ({limit:,})")
        try:
            return self.store.get_whole(rel, size)
        except Grown:
            raise NotAFile(f"it holds more bytes than the {size:,} listed (it was replaced "
                           f"after the listing)") from None


class ObjectFile(str):
    """One object named by URL (an annotation file): the URL as shown, with a ``Path``'s
    ``name`` and ``suffix`` for messages; ``read()`` gets it whole."""

    def __new__(cls, url: str, storage_options: Optional[Dict[str, Any]] = None):
        parent, name = posixpath.split(url.rstrip("/"))
        store = Store(parent, storage_options)
        self = super().__new__(cls, store.show(name))
        self.store, self.key = store, name
        return self

    @property
    def name(self) -> str:
        return self.key

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.key)[1]

    def read(self, limit: int = 64 << 30) -> bytes:
        try:
            return self.store.read_bytes(self.key, limit)
        except NotFound:
            raise FileNotFoundError(2, "not found", str(self)) from None


def folder(where: os.PathLike, storage_options: Optional[Dict[str, Any]] = None):
    """``where`` as a source's image folder: a ``RemoteFolder`` for a URL (or one already
    made), else a ``Path``."""
    if isinstance(where, RemoteFolder):
        return where
    return RemoteFolder(where, storage_options) if is_url(where) else Path(where)


def source_file(where: os.PathLike, storage_options: Optional[Dict[str, Any]] = None):
    """``where`` as a source's annotation file: an ``ObjectFile`` for a URL (or one already
    made), else a ``Path``."""
    if isinstance(where, ObjectFile):
        return where
    return ObjectFile(where, storage_options) if is_url(where) else Path(where)
