"""The build: worker processes read and check images, one writer appends them to shards.

Crash safety rests on ordering: a shard is renamed into place only when complete, the
journal (``.packer-build.json``) lists finished shards only, and the manifest — the one
file readers require — is written last. Re-running the same command resumes after the last
finished shard; a different command restarts cleanly.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from array import array
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import islice
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Deque, Iterator, List, Optional, Tuple

from tqdm.auto import tqdm

from . import __version__
from . import journal
from ._fsio import FolderLock, write_json_atomic
from ._system import die_with_parent, pil_summary, usable_cores
from .check import DEFAULT_MAX_PIXELS, BadImage, Transcode, check_image
from .errors import PackerError
from .format import (FORMAT_NAME, FORMAT_VERSION, LABELS, MANIFEST, OFFSETS, SHARD_PATTERN, crc32,
                     pack_record, read_manifest)
from .source import IMG_EXTENSIONS, ImageList, is_utf8, parse_part, read_list, scan_folder, select
from .text import printable
from .shardfile import shard_records
from .writer import ShardWriter, disk_errors, write_table

DEFAULT_SHARD_SIZE = 1 << 30
MAX_SHARD_SIZE = 64 << 30
CHUNK = 8  # entries per task sent to a worker: amortizes the IPC, keeps the order fine-grained


@dataclass
class BuildResult:
    manifest: dict
    seconds: float
    resumed_shards: int = 0

    def summary(self) -> str:
        m = self.manifest
        return (f"packed {m['count']} images in {len(m['classes'])} classes into "
                f"{len(m['shards'])} shard(s), {m['bytes'] / 1e6:.1f} MB; "
                f"skipped {len(m['skipped'])}; {self.seconds:.1f} s")


def build(src: os.PathLike, dst: os.PathLike, *, list_file: Optional[os.PathLike] = None,
          shard_size: int = DEFAULT_SHARD_SIZE, workers: Optional[int] = None,
          transcode: Optional[Transcode] = None, shuffle: bool = False, seed: int = 0,
          part: Optional[str] = None, strict: bool = False, overwrite: bool = False,
          max_pixels: int = DEFAULT_MAX_PIXELS, progress: bool = True) -> BuildResult:
    """Pack ``src`` (ImageFolder layout, or ``list_file`` lines) into shards in ``dst``."""
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    workers = usable_cores() if workers is None else workers
    _check_arguments(src, dst, list_file, shard_size, workers, max_pixels)
    source = read_list(src, list_file) if list_file else scan_folder(src)
    if not source.entries:
        raise PackerError(f"found no images in {src} (extensions: "
                          f"{', '.join(IMG_EXTENSIONS)}, any case); nothing to pack")
    source = select(source, part=parse_part(part), shuffle=shuffle, seed=seed)
    options = {"shard_size": shard_size, "transcode": asdict(transcode) if transcode else None,
               "shuffle": shuffle, "seed": seed, "part": part, "strict": strict,
               "max_pixels": max_pixels, "list": str(list_file) if list_file else None}
    dst.mkdir(parents=True, exist_ok=True)
    with FolderLock(dst, f"packer build into {dst}"):
        if (dst / MANIFEST).exists():
            if not overwrite:
                raise PackerError(f"{dst} already holds a finished dataset; replace it with "
                                  f"overwrite=True (--overwrite)")
            journal.remove_dataset(dst, read_manifest(dst))
        fp = journal.fingerprint(source, options)
        run = _Run(source, dst, fp, journal.load(dst, fp), shard_size, strict)
        resumed = len(run.shards)
        bar = tqdm(total=len(source.entries), initial=run.start, unit="img", disable=not progress,
                   desc=f"packing {src.name or src}", dynamic_ncols=True, smoothing=0.05)
        try:
            run.pack(_process(source, run.start, workers, transcode, max_pixels), bar)
        finally:
            bar.close()
        if not run.labels:
            first = run.skipped[0]
            raise PackerError(f"all {len(run.skipped)} images were skipped (e.g. {first['path']}: "
                              f"{first['reason']}); no dataset was written")
        manifest = _finish(dst, source, run.shards, run.skipped, run.labels, options)
        journal.remove_leftovers(dst, {s["path"] for s in manifest["shards"]})
    return BuildResult(manifest, time.perf_counter() - t0, resumed)


def _check_arguments(src: Path, dst: Path, list_file, shard_size: int, workers: int,
                     max_pixels: int) -> None:
    if not 1 << 20 <= shard_size <= MAX_SHARD_SIZE:
        raise PackerError(f"shard_size must be between 1 MiB and 64 GiB, got {shard_size}: "
                          f"shards are mapped whole into each reader's address space")
    if max_pixels < 1:
        raise PackerError(f"max_pixels must be a positive pixel count, got {max_pixels}")
    if workers < 0:
        raise PackerError("workers must be >= 0 (0 checks images in this process)")
    if not list_file and _is_within(dst, src):
        raise PackerError(f"DST {dst} is inside the source folder {src}: it would become a class "
                          f"of its own source; put the dataset outside SRC")


class _Run:
    """One pass of the writer over checked images: shards, skip list, labels, journal."""

    def __init__(self, source: ImageList, dst: Path, fingerprint: str, journal: dict,
                 shard_size: int, strict: bool):
        self.source, self.dst, self.fingerprint = source, dst, fingerprint
        self.shard_size, self.strict = shard_size, strict
        self.shards: List[dict] = journal["shards"]
        self.skipped: List[dict] = journal["skipped"]
        self.start = journal["next_entry"]
        self.labels = _labels_so_far(source, self.start, self.skipped)
        self.writer: Optional[ShardWriter] = None

    def pack(self, results: Iterator, bar) -> None:
        in_bytes = 0
        try:
            for i, status, payload, label, nbytes in results:
                bar.update(1)
                in_bytes += nbytes
                self.add(i, status, payload, label)
                if bar.n % 256 == 0:
                    rate = in_bytes / 1e6 / max(bar.format_dict["elapsed"], 1e-9)
                    bar.set_postfix(MBps=f"{rate:.1f}", skipped=len(self.skipped), refresh=False)
            if self.writer is not None:
                self.shards.append(self.writer.finish())
                self.writer = None
        except BaseException:
            if self.writer is not None:
                self.writer.abort()
            raise

    def add(self, i: int, status: str, payload, label: int) -> None:
        rel = self.source.entries[i][0]
        if status == "ok" and isinstance(payload, tuple):
            payload = stored_record(self.source.root, rel, label, payload)
            if payload is None:
                status, payload = "skip", "changed or vanished while the build read it"
        if status == "skip":
            if self.strict:
                raise PackerError(f"strict: {printable(rel)}: {payload}; no dataset was written "
                                  f"(fix or remove the file, then re-run)")
            self.skipped.append({"path": printable(rel), "reason": payload, "entry": i})
            return
        if self.writer is None:
            self.writer = ShardWriter(self.dst / SHARD_PATTERN.format(len(self.shards)),
                                      expected_bytes=self.shard_size)
        self.writer.append(payload)
        self.labels.append(label)
        if self.writer.bytes >= self.shard_size:
            self.shards.append(self.writer.finish())
            self.writer = None
            journal.save(self.dst, self.fingerprint, self.shards, self.skipped, i + 1)


def _is_within(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


# -- workers ---------------------------------------------------------------------------------

def _work(task) -> Tuple[int, str, object, int, int]:
    """Runs in a worker: read, check (and maybe transcode) one image, return a packed record."""
    i, root, rel, label, transcode, max_pixels = task
    if not is_utf8(rel):  # records and the manifest store paths as UTF-8 text
        return i, "skip", ("file name is not valid UTF-8: rename it (e.g. `convmv -r -f latin1 "
                           "-t utf8 --notest SRC`)"), label, 0
    try:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
    except OSError as e:
        return i, "skip", f"unreadable: {e.strerror or e}", label, 0
    try:
        c = check_image(data, transcode=transcode, max_pixels=max_pixels)
    except BadImage as e:
        return i, "skip", str(e), label, len(data)
    if transcode is None:  # unchanged bytes: the parent re-reads them (see stored_record)
        return i, "ok", (crc32(data), c.width, c.height, c.format, c.mode), label, len(data)
    rec = pack_record(c.data, label=label, path=rel, width=c.width, height=c.height,
                      format=c.format, mode=c.mode)
    return i, "ok", rec, label, len(data)


def stored_record(root: Path, rel: str, label: int, checked) -> Optional[bytes]:
    """The record of a file a worker checked, its bytes read again here, from the page cache.

    Cheaper than shipping them back through a pipe (pickle, two copies, many syscalls) on
    machines where the writer shares few cores with the workers. The checksum makes sure
    the bytes stored are the bytes checked; None if the file changed in between.
    """
    crc, width, height, fmt, mode = checked
    try:
        with open(root / rel, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if crc32(data) != crc:
        return None
    return pack_record(data, label=label, path=rel, width=width, height=height, format=fmt, mode=mode)


def _worker_init(parent: int) -> None:
    # Ctrl-C reaches the whole process group: only the parent handles it (and terminates the
    # pool). A worker dying of KeyboardInterrupt mid-queue-operation can hang Pool.terminate().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def _process(source: ImageList, start: int, workers: int, transcode, max_pixels) -> Iterator:
    """Results in entry order, with at most a few chunks per worker in flight.

    On an error (a full disk, Ctrl-C) queued chunks are cancelled and running ones finish
    (milliseconds). Workers are never killed: one killed while sending its results leaves
    the parent blocked reading half a message, forever — what ``Pool.terminate`` did here.
    """
    root = str(source.root)
    tasks = ((i, root, rel, label, transcode, max_pixels)
             for i, (rel, label) in enumerate(source.entries) if i >= start)
    if workers == 0:
        yield from map(_work, tasks)
        return
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                               initargs=(os.getpid(),))
    pending: Deque[Future] = deque()
    try:
        while True:
            while len(pending) < 4 * workers:
                chunk = list(islice(tasks, CHUNK))
                if not chunk:
                    break
                pending.append(pool.submit(_work_chunk, chunk))
            if not pending:
                break
            yield from pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _work_chunk(chunk):
    return [_work(t) for t in chunk]


# -- journal, labels, manifest ---------------------------------------------------------------

def _labels_so_far(source: ImageList, start: int, skipped: List[dict]) -> array:
    gone = {s["entry"] for s in skipped}
    return array("i", (lab for i, (_, lab) in enumerate(source.entries[:start]) if i not in gone))


def _offsets(dst: Path, shards: List[dict]) -> array:
    """Every record's byte range in its shard, read once now so readers never walk LMDB."""
    table = array("Q")
    for s in shards:
        table.extend(shard_records(dst / s["path"]))
    return table


def _finish(dst: Path, source: ImageList, shards: List[dict], skipped: List[dict],
            labels: array, options: dict) -> dict:
    count = sum(s["count"] for s in shards)
    assert count == len(labels), (count, len(labels))
    label_entry = write_table(dst, LABELS, labels)
    offsets_entry = write_table(dst, OFFSETS, _offsets(dst, shards))
    class_counts = [0] * len(source.classes)
    for lab in labels:
        class_counts[lab] += 1
    manifest = new_manifest(
        classes=source.classes, class_counts=class_counts,
        shards=[{k: s[k] for k in ("path", "count", "bytes", "sha256")} for s in shards],
        labels=label_entry, offsets=offsets_entry,
        skipped=[{"path": s["path"], "reason": s["reason"]} for s in skipped],
        source=str(source.root.resolve()), options=options)
    with disk_errors(dst / MANIFEST):
        write_json_atomic(dst / MANIFEST, manifest)
    return manifest


def new_manifest(*, classes, class_counts, shards, labels, offsets, skipped, source, options) -> dict:
    extra = {"offsets": offsets} if offsets is not None else {}
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "packer_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "count": sum(s["count"] for s in shards), "bytes": sum(s["bytes"] for s in shards),
        "classes": list(classes), "class_to_idx": {c: i for i, c in enumerate(classes)},
        "class_counts": list(class_counts), "shards": shards, "labels": labels, **extra,
        "skipped": skipped, "source": source, "options": options, "pil": pil_summary(),
        "build_id": uuid.uuid4().hex,
    }
