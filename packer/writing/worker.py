"""A build's parallel part: the shard plan (by file sizes, whatever the worker count), and a
worker that reads, checks, encodes and writes whole shards itself."""
from __future__ import annotations

import gc
import os
import signal
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

from .._util.fsio import NotAFile, read_file, remove_own
from .._util.system import die_with_parent
from .check import BadImage, Checks, Transcode, check_image
from ..format.fields import Field, encode
from ..format.manifest import SHARD_PATTERN
from ..format.records import pack_fields, record_bytes
from ..sources.base import ImageList
from ..storage.files import RemoteFolder
from .._util.text import is_utf8
from .shard import ShardWriter

PLANNED_SHARDS = 256    # a dataset smaller than this many shards is cut into about this many,
MIN_PLANNED = 4 << 20   # but none planned under 4 MiB: shards for every core to write, and a
#                         short tail (the last wave of shards leaves cores idle)
FETCH_THREADS = 16  # GETs in flight per worker reading images from object storage


@dataclass(frozen=True)
class ShardTask:
    index: int           # the shard's number in the plan: its file name
    start: int           # entries [start, end)
    end: int
    expected_bytes: int  # the source files' bytes: the shard's first map size


@dataclass
class ShardDone:
    """What a worker reports for one planned shard; ``taken`` is set by the builder before
    journaling it, so an interrupted build never removes a listed shard."""
    task: ShardTask
    shard: Optional[dict] = None
    samples: List[tuple] = field(default_factory=list)
    in_bytes: int = 0
    failed: bool = False
    stopped: bool = False
    taken: bool = False


def plan_shards(sizes: Sequence[int], shard_size: int) -> List[Tuple[int, int, int]]:
    """(start, end, bytes) ranges of consecutive entries of at most ``shard_size`` of files (less
    for a small dataset, so every worker has shards)."""
    shard_size = min(shard_size, max(MIN_PLANNED, -(-sum(sizes) // PLANNED_SHARDS)))
    plan, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > shard_size:
            plan.append((start, i, total))
            start, total = i, 0
        total += n
    if start < len(sizes):
        plan.append((start, len(sizes), total))
    return plan


def file_sizes(source: ImageList) -> List[int]:
    """Each entry's file size (0 where it cannot be read: the worker reports why)."""
    if isinstance(source.root, RemoteFolder):
        listed = source.root.sizes()
        return [listed.get(rel, 0) for rel, _ in source.entries]
    root, out = str(source.root), []
    for rel, _ in source.entries:
        try:
            out.append(os.stat(os.path.join(root, rel)).st_size)
        except (OSError, ValueError):
            out.append(0)
    return out


class FieldMaker:
    """An entry's stored fields (label, fitted annotation row) packed, and its column values."""

    def __init__(self, source: ImageList, fields: List[Field], column_names: list):
        self.source, self.column_names = source, column_names
        self.label = [f for f in fields if f.name == "label"]
        self.others = [f for f in fields if f.name != "label"]
        self.upright = source.annotations is not None and source.annotations.upright

    def encoded(self, i: int, width: int, height: int, orientation: int = 1):
        ann = self.source.annotations
        stored = encode(self.label, {"label": self.source.entries[i][1]}) if self.label else {}
        reasons: list = []
        if ann is not None:
            turn = (orientation,) if self.upright else ()
            row, reasons = ann.fit(ann.rows[i], width, height, *turn) if ann.fit else \
                (ann.rows[i], [])
            stored.update(row if ann.stored else encode(self.others, row))
        return pack_fields(stored), {k: stored[k] for k in self.column_names}, reasons


@dataclass
class ShardJob:
    """What a worker needs besides the task; ``progress``/``stop``: shared (None in-process)."""
    dst: Path
    fields: FieldMaker
    transcode: Optional[Transcode]
    checks: Checks
    progress: object = None
    stop: object = None


_JOB: list = [None]  # this worker's ShardJob


def init_worker(parent: int, job: ShardJob) -> None:
    # Ctrl-C reaches the whole process group: only the parent handles it (and sets ``stop``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()  # the parent's objects (annotation rows) are never garbage here: a collection
    # walking them would only copy their pages into this process
    die_with_parent(parent)
    _JOB[0] = job


def fetch_entry(job: ShardJob, i: int) -> Union[bytes, str]:
    """The bytes of entry ``i``'s file, or why it cannot be read (a store that keeps failing
    raises: the build stops and resumes on a re-run)."""
    root, rel = job.fields.source.root, job.fields.source.entries[i][0]
    if not is_utf8(rel):  # records and the manifest store paths as UTF-8 text
        return ("file name is not valid UTF-8: rename it (e.g. `convmv -r -f latin1 -t utf8 "
                "--notest SRC`)")
    limit = job.checks.max_image_bytes
    try:
        if isinstance(root, RemoteFolder):
            return root.read(rel, limit, "max_image_bytes")
        return read_file(os.path.join(root, rel), limit, "max_image_bytes")
    except NotAFile as e:
        return str(e)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"


def fetched(job: ShardJob, task: ShardTask) -> Iterator[Union[bytes, str]]:
    """``fetch_entry`` for the task's entries, in order; from object storage FETCH_THREADS at
    once, at most twice that many ahead (memory stays bounded)."""
    todo = iter(range(task.start, task.end))
    if not isinstance(job.fields.source.root, RemoteFolder):
        yield from (fetch_entry(job, i) for i in todo)
        return
    with ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="packer-get") as pool:
        ahead = deque(pool.submit(fetch_entry, job, i) for i in islice(todo, 2 * FETCH_THREADS))
        try:
            while ahead:
                got = ahead.popleft().result()
                ahead.extend(pool.submit(fetch_entry, job, i) for i in islice(todo, 1))  # the next
                yield got
        finally:
            for f in ahead:
                f.cancel()


def write_shard(task: ShardTask, job: Optional[ShardJob] = None) -> ShardDone:
    """Check and store the task's entries into shard file ``task.index`` (``job`` given when
    in-process). A set ``stop``, or a strict build's problem, abandons it (temp files removed)."""
    job = job or _JOB[0]
    done, writer = ShardDone(task), None
    entries, reads = job.fields.source.entries, fetched(job, task)
    try:
        for i in range(task.start, task.end):
            if job.stop is not None and job.stop.is_set():
                done.stopped = True
                break
            c = next(reads)  # the file's bytes, or why it cannot be read
            if not isinstance(c, str):
                done.in_bytes += len(c)
                try:
                    c = check_image(c, transcode=job.transcode, max_pixels=job.checks.max_pixels,
                                    orientation=job.fields.upright)
                except BadImage as e:
                    c = str(e)
            if not isinstance(c, str):
                try:
                    packed, columns, reasons = job.fields.encoded(i, c.width, c.height,
                                                                  c.orientation)
                except ValueError as e:
                    c = f"annotation: {e}"
            if isinstance(c, str):  # skipped, and why
                done.samples.append((i, None, c))
                reasons = [c]
            else:
                if writer is None:
                    writer = ShardWriter(job.dst / SHARD_PATTERN.format(task.index),
                                         expected_bytes=task.expected_bytes)
                writer.append(record_bytes(c.data, path=entries[i][0], width=c.width,
                                           height=c.height, format=c.format, mode=c.mode,
                                           fields=packed))
                done.samples.append((i, (c.width, c.height, columns), reasons))
            if job.checks.strict and reasons:
                done.failed = True
                break
            if job.progress is not None:  # the parent's progress bar, image by image
                with job.progress.get_lock():
                    job.progress.value += 1
        if writer is not None and not (done.failed or done.stopped):
            done.shard, writer = writer.finish(), None
    finally:
        reads.close()  # GETs still queued are dropped
        if writer is not None:  # stopped, failed or an exception: leave no temp files
            writer.abort()
    if done.failed and job.stop is not None:
        job.stop.set()  # the build fails: the other shards need not finish
    return done


def remove_untaken(dst: Path, results: List[Optional[ShardDone]]) -> None:
    """Remove the finished shards of ``results`` the builder has not taken (None: no result)."""
    for done in results:
        if done is not None and done.shard is not None and not done.taken:
            remove_own(dst, done.shard["path"])
