"""``packer.write``: pack any iterable of ``{"image": bytes | path | PIL.Image, field: value}``
samples, checked, written and resumed as ``packer build`` does."""
from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Union

import msgpack
from tqdm.auto import tqdm

from . import journal
from .._util.fsio import FolderLock, read_file
from .._util.system import usable_cores
from .._util.text import is_utf8, printable
from .builder import DEFAULT_SHARD_SIZE, BuildResult, check_shard_size
from .check import BadImage, Checked, Checks, Transcode, as_checks, check_image
from ..errors import PackerError
from ..format.fields import (Field, check_schema, detection_problem, encode, infer_field,
                              object_count_problem)
from ..format.manifest import FORMAT_VERSION, MANIFEST, read_manifest
from ..format.validation import TASKS
from .packing import Packing
from ..sources.base import DEFAULT_MAX_CLASSES


def write(dst: os.PathLike, samples: Iterable[Dict[str, Any]], *,
          schema: Optional[Sequence[dict]] = None, classes: Optional[Sequence[str]] = None,
          task: Optional[str] = None, shard_size: int = DEFAULT_SHARD_SIZE,
          workers: Optional[int] = None, transcode: Optional[Transcode] = None,
          checks: Checks = Checks(), overwrite: bool = False, progress: bool = True,
          total: Optional[int] = None) -> BuildResult:
    """Pack ``samples`` into a dataset in ``dst`` (what ``litdata.optimize`` and
    ``MDSWriter`` do, with packer's checks and crash safety); see :class:`DatasetWriter`."""
    t0 = time.perf_counter()
    if total is None and hasattr(samples, "__len__"):
        total = len(samples)  # type: ignore[arg-type]
    with DatasetWriter(dst, schema=schema, classes=classes, task=task, shard_size=shard_size,
                       workers=workers, transcode=transcode, checks=checks,
                       overwrite=overwrite) as w:
        with tqdm(total=total, unit="img", disable=not progress, desc=f"writing {Path(dst).name}",
                  dynamic_ncols=True) as bar:
            for sample in samples:
                w.add(sample)
                bar.update(1)
        manifest = w.finish()
    return BuildResult(manifest, time.perf_counter() - t0, w.resumed_shards)


class DatasetWriter:
    """Writes one dataset, a sample at a time: ``add(sample)``, then ``finish()`` (as a context
    manager: finished on success, resumable on error).

    Args:
        dst: the dataset folder (refused if it holds a finished dataset, unless ``overwrite``).
        schema: the fields (``packer.format.fields``); default: inferred from the first sample.
        classes: names of the ``label`` values; default ``str(i)`` for ``0..max(label)``.
        task: "classification", "detection" or "generic"; default from the fields.
        workers: threads checking images; default: the cores.
        transcode / checks / shard_size: as for ``packer.build``; PIL images are stored as PNG
            unless ``transcode`` makes them JPEG."""

    def __init__(self, dst: os.PathLike, *, schema: Optional[Sequence[dict]] = None,
                 classes: Optional[Sequence[str]] = None, task: Optional[str] = None,
                 shard_size: int = DEFAULT_SHARD_SIZE, workers: Optional[int] = None,
                 transcode: Optional[Transcode] = None, checks: Checks = Checks(),
                 overwrite: bool = False):
        journal.check_dst(dst)  # before anything is written: packer writes only where asked
        check_shard_size(shard_size)
        if task is not None and task not in TASKS:
            raise PackerError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        self.dst = Path(dst)
        self.schema = check_schema(list(schema), "schema") if schema is not None else None
        self.classes, self.task = check_classes(classes), task
        self.checks = as_checks(checks)
        self.options = {"shard_size": shard_size, **self.checks.options(),
                        "transcode": asdict(transcode) if transcode else None, "writer": True}
        self.transcode, self.overwrite = transcode, overwrite
        threads = usable_cores() if workers is None else max(1, workers)
        self.pool = ThreadPoolExecutor(threads)
        self.window = 4 * threads  # samples checked ahead of the one stored next
        self.pending: Deque = deque()
        self.entry = 0  # samples seen
        self.digest = hashlib.sha256()
        self.run: Optional[Packing] = None
        self.done: Optional[dict] = None  # the manifest a finished run of the same write left
        self.resumed_shards = 0
        self.dst.mkdir(parents=True, exist_ok=True)
        self.lock = FolderLock(self.dst, f"packer.write into {self.dst}")
        self.lock.__enter__()

    def _open(self, sample: Dict[str, Any]) -> None:
        if self.schema is None:
            self.schema = infer_schema(sample)
        self.task = self.task or guess_task(self.schema)
        problem = detection_problem(self.schema) if self.task == "detection" else ""
        if problem:
            raise PackerError(f"a detection dataset {problem}")
        self.by_name = {f.name: f for f in self.schema}
        label = self.by_name.get("label")
        if label is not None and label.type != "int":
            raise PackerError(f"field 'label' is a class index: an int (names in classes=[...]), "
                              f"not {label.type}")
        specs = [f.spec() for f in self.schema]
        self.fingerprint = hashlib.sha256(json.dumps(
            [FORMAT_VERSION, specs, self.task, self.classes, self.options],
            sort_keys=True).encode()).hexdigest()
        if (self.dst / MANIFEST).exists():
            man = read_manifest(self.dst)
            if not self.overwrite:  # the same write may have finished: finish() compares
                if str(man.get("fingerprint")).startswith(self.fingerprint + ":"):
                    self.done, self.replay = man, float("inf")  # every sample only checked
                    return
                raise PackerError(f"{self.dst} already holds a finished dataset; replace it with "
                                  f"overwrite=True")
            journal.remove_dataset(self.dst, man)
        fresh = self.overwrite and (self.dst / journal.JOURNAL).is_file()  # an interrupted write
        state = (journal.restart if fresh else journal.load)(self.dst, self.fingerprint)
        self.replay = state["next_entry"]  # samples the interrupted run packed
        self.want_digest = state["shards"][-1].get("input_digest") if state["shards"] else None
        self.run = Packing(self.dst, self.fingerprint, state, strict=self.checks.strict,
                           shard_size=self.options["shard_size"],
                           schema={"task": self.task, "fields": specs})
        self.run.shard_note = lambda: {"input_digest": self.digest.hexdigest()}
        self.resumed_shards = len(self.run.shards)

    def add(self, sample: Dict[str, Any]) -> None:
        """Queue one sample; its image is checked in a thread, stored in order."""
        if not isinstance(sample, dict) or "image" not in sample:
            raise PackerError(f"sample {self.entry} must be a dict with an 'image' (bytes, a path "
                              f"or a PIL image), got {type(sample).__name__}")
        if self.run is None and self.done is None:
            self._open(sample)
        i = self.entry
        self.entry += 1
        data, path = image_bytes(sample["image"], i, self.checks.max_image_bytes)
        path = str(sample.get("path", path))
        if not is_utf8(path):
            raise PackerError(f"sample {i}: 'path' {printable(path)} is not valid Unicode text")
        values = {k: v for k, v in sample.items() if k not in ("image", "path")}
        label = values.get("label")
        if self.classes is None and isinstance(label, int) and label >= DEFAULT_MAX_CLASSES:
            raise PackerError(f"sample {i}: label {label} would make {label + 1:,} classes "
                              f"(0..{label}); name them with classes=[...] (without it, labels "
                              f"must stay below {DEFAULT_MAX_CLASSES:,})")
        try:
            stored = encode(self.schema, values)
            problem = object_count_problem(self.by_name, stored) if self.task == "detection" else ""
            digest = sample_digest(data, path, stored)
        except ValueError as e:
            problem = str(e)
        if problem:
            raise PackerError(f"sample {i}: {problem}")
        if i < self.replay:  # packed by the interrupted (or finished) run: only checked
            self.digest.update(digest)
            if i + 1 == self.replay and self.digest.hexdigest() != self.want_digest:
                raise PackerError(
                    f"the samples differ from those an interrupted write into {self.dst} packed "
                    f"(its first {self.replay}); pass overwrite=True to start over, or the same "
                    f"samples in the same order to resume")
            return
        check = self.pool.submit(check_sample, data, self.transcode, self.checks.max_pixels)
        self.pending.append((i, path, stored, digest, check))
        while self.pending and (len(self.pending) > self.window or self.pending[0][4].done()):
            self._store(*self.pending.popleft())

    def _store(self, i: int, path: str, stored: dict, digest: bytes, check: Future) -> None:
        self.digest.update(digest)  # before the record: a shard it ends notes the digest
        c = check.result()
        if isinstance(c, str):
            self.run.skip(i, path, c)
        else:
            self.run.add(i, path, c.data, c.width, c.height, c.format, c.mode, stored)

    def finish(self) -> dict:
        """Store what is queued, write tables and manifest; the dataset's manifest."""
        if self.done is not None:  # a re-run of a finished write: the same samples change nothing
            done = journal.finished(self.dst, self._final_fingerprint())
            self.close()
            if done is None:  # other samples: refused, as for any finished dataset
                raise PackerError(f"{self.dst} already holds a finished dataset; replace it with "
                                  f"overwrite=True")
            self.resumed_shards = len(done["shards"])
            return done
        if self.run is None:
            raise PackerError("no samples were added; no dataset was written")
        if self.entry < self.replay:
            raise PackerError(f"only {self.entry} samples were given, the interrupted write "
                              f"packed {self.replay}; pass the same samples to resume")
        while self.pending:
            self._store(*self.pending.popleft())
        self.run.end_shard(self.entry)
        classes = self.classes
        if classes is None:
            classes = [str(i) for i in range(max(self.run.labels, default=-1) + 1)]
        manifest = self.run.finish(classes=classes, source="packer.write", options=self.options,
                                   fingerprint=self._final_fingerprint())
        self.close()
        return manifest

    def _final_fingerprint(self) -> str:
        return f"{self.fingerprint}:{self.entry}:{self.digest.hexdigest()}"

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.lock is not None:
            self.lock.__exit__(None, None, None)
            self.lock = None

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self.lock is not None:  # a body that did not finish()
                self.finish()
        finally:
            if self.lock is not None:  # the body or finish() raised: resumable, unlocked
                if self.run is not None:
                    self.run.abort()
                self.close()


def check_classes(classes: Optional[Sequence[str]]) -> Optional[List[str]]:
    """``classes`` as a list, refused unless distinct strings (what a manifest may hold)."""
    if classes is None:
        return None
    out = list(classes)
    if not all(isinstance(c, str) for c in out):
        raise PackerError("classes must be a list of strings (the names of labels 0, 1, ...)")
    if len(set(out)) != len(out):
        seen: set = set()
        twice = next(c for c in out if c in seen or seen.add(c))
        raise PackerError(f"classes names {twice!r} twice; give each class its own name")
    return out


def image_bytes(image: Any, i: int, max_bytes: int):
    """(stored bytes, default path) of a sample's image: bytes as given, a regular file's
    bytes (at most ``max_bytes``), or a PIL image encoded losslessly as PNG."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image), f"{i:08d}"
    if isinstance(image, (str, os.PathLike)):
        try:
            return read_file(image, max_bytes, "max_image_bytes"), os.fspath(image)
        except OSError as e:
            raise PackerError(f"sample {i}: cannot read image {image}: {e.strerror or e}") from None
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image
        out = io.BytesIO()
        try:
            image.save(out, "PNG")
        except (OSError, ValueError) as e:  # modes PNG has not: CMYK, F...
            raise PackerError(f"sample {i}: a PIL image of mode {image.mode} cannot be stored "
                              f"({e}); convert it, e.g. image.convert('RGB')") from None
        return out.getvalue(), f"{i:08d}"
    raise PackerError(f"sample {i}: 'image' must be bytes, a path or a PIL image, got "
                      f"{type(image).__name__}")


def sample_digest(data: bytes, path: str, stored: dict) -> bytes:
    """What makes a sample this sample: its image bytes, its path and its encoded fields;
    a ValueError names a field msgpack cannot store (a numpy scalar inside a list, say)."""
    h = hashlib.sha256(data)
    try:
        h.update(msgpack.packb([path, stored], use_bin_type=True))
    except TypeError:
        for name, v in stored.items():
            try:
                msgpack.packb(v, use_bin_type=True)
            except TypeError as e:
                raise ValueError(f"field {name!r}: {e} (store plain Python numbers: "
                                 f".tolist() or float())") from None
        raise
    return h.digest()


def check_sample(data: bytes, transcode, max_pixels: int) -> Union[Checked, str]:
    """In a thread: the checked image, or why it is skipped."""
    try:
        return check_image(data, transcode=transcode, max_pixels=max_pixels)
    except BadImage as e:
        return str(e)


def infer_schema(sample: Dict[str, Any]) -> List[Field]:
    """Fields from the first sample's values (see ``packer.format.fields.infer_field``)."""
    out = []
    for name, v in sample.items():
        if name in ("image", "path"):
            continue
        f = infer_field(name, v)
        if f is None:
            raise PackerError(f"cannot tell the type of field {name!r} from {str(v)[:60]!r} (an "
                              f"empty list?); pass schema=[...] (see docs/annotations.md)")
        out.append(f.spec())
    return check_schema(out, "the fields of the first sample")


def guess_task(schema: List[Field]) -> str:
    names = {f.name for f in schema}
    if {"boxes", "labels"} <= names:
        return "detection"
    return "classification" if names == {"label"} else "generic"
