"""A build's parallel part: the shard plan, and a worker writing whole shards.

Each shard is a planned range of entries, cut by the source files' sizes (so the same input
and options give the same shards whatever the worker count). A worker reads, checks and
encodes every image of its range and writes the shard file itself (``ShardWriter``: temp
file, compaction, fsync, hash, rename), so no single process touches every image; it hands
back only what the side tables, skip lists and journal need. The build's main process
(``packer.writing.builder``) takes finished shards in plan order.
"""
from __future__ import annotations

import gc
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .._util.system import die_with_parent
from .check import BadImage, Checked, Transcode, check_image
from ..format.fields import encode
from ..format.manifest import SHARD_PATTERN
from ..format.records import pack_fields, record_bytes
from .laterows import LateRows
from ..sources.base import ImageList
from .._util.text import is_utf8
from .shard import ShardWriter

PROGRESS_EVERY = 16  # images between a worker's progress reports (a shared counter)
HOLD_BYTES = 64 << 20  # a worker's checked images held while the annotations are read
PLANNED_SHARDS = 256    # a dataset smaller than this many shards is cut into about this many,
MIN_PLANNED = 4 << 20   # but none planned under 4 MiB: shards for every core to write, and a
#                         short tail (the last wave of shards leaves cores idle)


@dataclass(frozen=True)
class ShardTask:
    index: int           # the shard's number in the plan: its file name
    start: int           # entries [start, end)
    end: int
    expected_bytes: int  # the source files' bytes: the shard's first map size


@dataclass
class ShardDone:
    """What a worker reports for one planned shard. ``samples``: per entry, in order,
    ``(entry, None, reason)`` for a skipped image or ``(entry, (width, height, columns),
    drop_reasons)`` for a stored one. ``shard``: the manifest entry (None: nothing stored).
    ``failed``: the entry whose problem ends a strict build; ``stopped``: cut short.
    ``taken``: set by the builder before it journals the shard, so an interrupted build
    never removes a shard its journal may list."""
    task: ShardTask
    shard: Optional[dict] = None
    samples: List[tuple] = field(default_factory=list)
    in_bytes: int = 0
    failed: bool = False
    stopped: bool = False
    taken: bool = False


def plan_shards(sizes: Sequence[int], shard_size: int) -> List[Tuple[int, int, int]]:
    """(start, end, bytes) ranges of consecutive entries whose files add up to at most the
    target (at least one entry each): ``shard_size``, or for a dataset under
    ``PLANNED_SHARDS`` x that, 1/``PLANNED_SHARDS`` of it (``MIN_PLANNED`` at least), so a
    small dataset still has a shard for every worker. A function of the input alone: the
    same shards whatever the worker count."""
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
    root, out = str(source.root), []
    for rel, _ in source.entries:
        try:
            out.append(os.stat(os.path.join(root, rel)).st_size)
        except (OSError, ValueError):
            out.append(0)
    return out


class FieldMaker:
    """Each entry's stored fields for an image of a given size: its label, and its
    annotation row fitted (``Annotations.fit``), encoded (``packer.format.fields``) and packed as
    msgpack, with the values its side tables take. Forked workers share the rows, or take
    them from ``late`` (``LateRows``) when they were read after the workers started."""

    def __init__(self, source: ImageList, fields: list, column_names: list,
                 late: Optional[LateRows] = None):
        self.source, self.fields, self.column_names = source, fields, column_names
        self.has_label = any(f["name"] == "label" for f in fields)
        self.late = late
        ann = source.annotations
        self.rows = late if late is not None else ann.rows if ann is not None else None

    def ready(self, wait: bool = False) -> bool:
        """Whether ``encoded`` can run now (False: the rows are not read yet; with ``wait``,
        only when the build stopped meanwhile)."""
        return self.late is None or self.late.ready(wait)

    def check(self, i: int) -> None:
        """For an entry whose image is skipped: the PackerError its row would have given
        when fitted (``Annotations.check``)."""
        ann = self.source.annotations
        if ann is not None and ann.check is not None:
            ann.check(self.rows[i])

    def encoded(self, i: int, width: int, height: int):
        ann = self.source.annotations
        values: dict = {"label": self.source.entries[i][1]} if self.has_label else {}
        reasons: list = []
        if ann is not None:
            row = self.rows[i]
            row, reasons = ann.fit(row, width, height) if ann.fit is not None else (row, [])
            values.update(row)
        stored = encode(self.fields, values)
        return pack_fields(stored), {k: stored[k] for k in self.column_names}, reasons


@dataclass
class ShardJob:
    """Everything a worker needs besides the task; set once per worker (inherited when
    forked). ``progress``/``stop``: a shared counter and event (None in-process)."""
    dst: Path
    fields: FieldMaker
    transcode: Optional[Transcode]
    max_pixels: int
    strict: bool
    progress: object = None
    stop: object = None


_JOB: list = [None]  # this worker's ShardJob


def init_worker(parent: int, job: ShardJob) -> None:
    # Ctrl-C reaches the whole process group: only the parent handles it (and sets ``stop``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()  # the parent's objects (the annotation rows) are never garbage here: a
    # collection walking them would only copy their pages into this process
    die_with_parent(parent)
    _JOB[0] = job


def read_entry(job: ShardJob, i: int):
    """(status, payload, bytes read) for entry ``i``'s image: ("skip", reason) or ("ok",
    the checked image)."""
    root, rel = job.fields.source.root, job.fields.source.entries[i][0]
    if not is_utf8(rel):  # records and the manifest store paths as UTF-8 text
        return "skip", ("file name is not valid UTF-8: rename it (e.g. `convmv -r -f latin1 "
                        "-t utf8 --notest SRC`)"), 0
    try:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
    except OSError as e:
        return "skip", f"unreadable: {e.strerror or e}", 0
    try:
        return "ok", check_image(data, transcode=job.transcode, max_pixels=job.max_pixels), \
            len(data)
    except BadImage as e:
        return "skip", str(e), len(data)


def with_fields(job: ShardJob, i: int, c: Checked):
    """(status, payload) for entry ``i`` whose image checked out as ``c``: ("skip", reason)
    or ("ok", (stored bytes, width, height, format, mode, packed fields, columns, drop
    reasons))."""
    try:
        packed, columns, reasons = job.fields.encoded(i, c.width, c.height)
    except ValueError as e:
        return "skip", f"annotation: {e}"
    return "ok", (c.data, c.width, c.height, c.format, c.mode, packed, columns, reasons)


class ShardFill:
    """One shard being written, entry by entry in order. While the annotation rows are not
    read yet (``FieldMaker.ready``), checked images are held, up to ``HOLD_BYTES``, and
    stored once they are: the workers check images while the main process reads."""

    def __init__(self, task: ShardTask, job: ShardJob):
        self.task, self.job, self.done = task, job, ShardDone(task)
        self.writer: Optional[ShardWriter] = None
        self.held: List[tuple] = []  # (entry, status, checked image or skip reason)
        self.held_bytes = self.unreported = 0

    def take(self, i: int) -> None:
        status, payload, nbytes = read_entry(self.job, i)
        self.done.in_bytes += nbytes
        self.held.append((i, status, payload))
        self.held_bytes += nbytes
        # a strict build's first problem must be the first in order: rows for those before
        self.flush(self.held_bytes > HOLD_BYTES or self.job.strict and status == "skip")

    def flush(self, wait: bool) -> None:
        """Store the held entries if the rows can be read (with ``wait``: once they can;
        the build stopping meanwhile stops the shard)."""
        if not self.job.fields.ready(wait):
            if wait:  # the build stopped first
                self.done.stopped = True
            return
        entries = self.job.fields.source.entries
        for i, status, payload in self.held:
            if status == "ok":
                status, payload = with_fields(self.job, i, payload)
            else:
                self.job.fields.check(i)
            reasons = self.store(i, status, payload, entries[i][0])
            if self.job.strict and (status == "skip" or reasons):
                self.done.failed = True
                break
            self.unreported = _report(self.job, self.unreported + 1)
        self.held, self.held_bytes = [], 0

    def take_all(self) -> None:
        """Every entry's image, checked and held or stored (until a stop or a failure)."""
        for i in range(self.task.start, self.task.end):
            if self.job.stop is not None and self.job.stop.is_set():
                self.done.stopped = True
                return
            self.take(i)
            if self.done.failed or self.done.stopped:
                return

    def complete(self) -> None:
        """Store what is held (waiting for the rows), then finish the shard file (or
        abandon it: stopped or failed)."""
        done = self.done
        if self.held and not (done.failed or done.stopped):
            self.flush(wait=True)
        _report(self.job, self.unreported, force=True)
        self.unreported = 0
        if self.writer is not None:
            if done.failed or done.stopped:
                self.writer.abort()
            else:
                done.shard = self.writer.finish()
            self.writer = None

    def store(self, i: int, status: str, payload, rel: str) -> list:
        if status == "skip":
            self.done.samples.append((i, None, payload))
            return []
        data, width, height, fmt, mode, packed, columns, reasons = payload
        if self.writer is None:
            self.writer = ShardWriter(self.job.dst / SHARD_PATTERN.format(self.task.index),
                                      expected_bytes=self.task.expected_bytes)
        self.writer.append(record_bytes(data, path=rel, width=width, height=height,
                                        format=fmt, mode=mode, fields=packed))
        self.done.samples.append((i, (width, height, columns), reasons))
        return reasons


def write_shard(task: ShardTask, job: Optional[ShardJob] = None) -> ShardDone:
    """Check and store entries ``task.start .. task.end`` into the shard file ``task.index``
    (runs in a worker; ``job`` given when run in-process). A set ``stop`` event, or a
    problem in a strict build, abandons the shard (its temp files removed)."""
    return write_shards([task], job)[0]


def write_shards(tasks: List[ShardTask], job: Optional[ShardJob] = None) -> List[ShardDone]:
    """``write_shard`` for consecutive shards. While the annotation rows are not read yet,
    a shard whose images are all checked stays open and the next one's images are checked
    (up to ``HOLD_BYTES`` held): a worker's first task covers the time the read takes."""
    job = job or _JOB[0]
    fills: List[ShardFill] = []
    open_fills: List[ShardFill] = []
    try:
        for task in tasks:
            fill = ShardFill(task, job)
            fills.append(fill)
            open_fills.append(fill)
            fill.take_all()
            if (not fill.done.failed and not fill.done.stopped and not job.strict
                    and not job.fields.ready() and task is not tasks[-1]
                    and sum(f.held_bytes for f in open_fills) < HOLD_BYTES):
                continue  # its rows are not read yet: on to the next shard's images
            for f in open_fills:
                f.complete()
            open_fills = []
            if fill.done.failed or fill.done.stopped:
                break
    finally:
        for f in fills:
            if f.writer is not None:  # an exception: leave no temp files
                f.writer.abort()
    if any(f.done.failed for f in fills) and job.stop is not None:
        job.stop.set()  # the build fails: the other shards need not finish
    return [f.done for f in fills]


def _report(job: ShardJob, n: int, force: bool = False) -> int:
    """Add ``n`` images to the shared progress counter every PROGRESS_EVERY; what is left."""
    if job.progress is None or not n or (n < PROGRESS_EVERY and not force):
        return n
    with job.progress.get_lock():
        job.progress.value += n
    return 0
