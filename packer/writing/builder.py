"""The build: workers (or an engine's tasks) write whole planned shards; this process takes
them in plan order into the journal and tables, the manifest last, so a re-run of the same
command resumes after the last finished shard."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Deque, Iterator, List, Optional, Union

from tqdm.auto import tqdm

from . import journal
from .._util.fsio import FolderLock
from .._util.system import human_size, usable_cores
from .check import Checks, Transcode, as_checks
from ..errors import PackerError
from ..format.manifest import LABEL_FIELD, MANIFEST, classes_text, read_manifest, shard_number
from .packing import Packing
from .worker import (FieldMaker, ShardDone, ShardJob, ShardTask, file_sizes, init_worker,
                     plan_shards, remove_untaken, write_shard)
from ..sources.base import ImageList, Source, parse_part, select
from ..sources.folder import ImageFolder
from ..storage.destination import as_destination

DEFAULT_SHARD_SIZE = 1 << 30
MAX_SHARD_SIZE = 64 << 30


@dataclass
class BuildResult:
    manifest: dict
    seconds: float
    resumed_shards: int = 0

    def summary(self) -> str:
        """The line a build ends with: what was packed, skipped, left out and dropped."""
        m = self.manifest
        parts = [f"skipped {len(m['skipped'])}"]
        if m.get("skipped_empty"):
            parts.append(f"left out {m['skipped_empty']} without annotations (--skip-empty)")
        if m.get("dropped_count"):
            parts.append(f"dropped {m['dropped_count']} annotation(s)")
        classes = classes_text(m)
        return (f"packed {m['count']} images {'with' if classes.startswith('no ') else 'in'} "
                f"{classes} into {len(m['shards'])} shard(s), {human_size(m['bytes'])}; "
                f"{', '.join(parts)}; {self.seconds:.1f} s")


def build(source: Union[os.PathLike, str, Source], dst: os.PathLike, *,
          shard_size: int = DEFAULT_SHARD_SIZE, workers: Optional[int] = None,
          engine: Union[str, Any] = "local", transcode: Optional[Transcode] = None,
          shuffle: bool = False, seed: int = 0, part: Optional[str] = None,
          checks: Checks = Checks(), overwrite: bool = False, progress: bool = True) -> BuildResult:
    """Pack ``source`` (a folder path, or a ``packer.sources`` object) into shards in ``dst``.

    ``shard_size``: bytes of source files per shard; ``workers``: processes (0: this one;
    default: the usable cores); ``engine``: ``"local"``, ``"ray"`` or an engine object
    (``as_engine``), the same dataset whichever; ``transcode``: smaller JPEGs;
    ``shuffle``/``seed``: a seeded record order; ``part``: ``"K/N"`` (join with ``merge``);
    ``checks``: what is refused (``Checks``); ``overwrite``: replace a finished dataset.
    ``dst`` may be a URL or a ``packer.storage.Destination``: shards upload as they finish."""
    t0 = time.perf_counter()
    remote = as_destination(dst)
    if remote is not None:
        dst = remote.work
    journal.check_dst(dst)  # before anything is written: packer writes only where asked
    source, dst = as_source(source), Path(dst)
    workers = as_engine(engine, workers)
    checks = as_checks(checks)
    check_shard_size(shard_size)
    if isinstance(workers, int) and workers < 0:
        raise PackerError("workers must be >= 0 (0 checks images in this process)")
    if remote is not None:  # only now, with the arguments checked, may the URL change
        if not isinstance(workers, int) and not remote.keep:
            raise PackerError(f"building into {remote} on an engine (Ray) needs Destination("
                              f"url, work_dir=...): a folder at the same path on every node")
        remote.begin(overwrite)
    chosen = parse_part(part)
    source.check_destination(dst)
    # the source's options after the build's own; "list" always present
    options = {"shard_size": shard_size, "transcode": asdict(transcode) if transcode else None,
               "shuffle": shuffle, "seed": seed, "part": part, **checks.options(), "list": None,
               **source.options()}
    on_shard = remote.shard_done if remote is not None else None
    try:
        manifest, resumed = _pack(source.read(), dst, options, workers, transcode, checks, chosen,
                                  overwrite, progress, on_shard)
    except BaseException:
        if remote is not None:
            remote.abort()  # the uploads running finish, so that their record is true
        raise
    if remote is not None:
        remote.finish(manifest)
    return BuildResult(manifest, time.perf_counter() - t0, resumed)


def as_source(source: Union[os.PathLike, str, Source]) -> Source:
    """``source`` itself, or for a folder path the ImageFolder it names."""
    if isinstance(source, (str, os.PathLike)):
        return ImageFolder(source)
    if not callable(getattr(source, "read", None)):
        raise PackerError(f"build(source, dst): source must be a folder path or a source "
                          f"(packer.sources.ImageFolder, FileList, Coco, Yolo, Table), got "
                          f"{type(source).__name__}")
    return source


def as_engine(engine: Union[str, Any], workers: Optional[int]) -> Union[int, Any]:
    """What writes the shards: a process count, or an engine: any object with ``shards(tasks,
    job, bar)`` that runs ``worker.write_shard`` per ``ShardTask``, yields the ``ShardDone``
    results in order and on close removes finished shards not marked ``taken``."""
    if engine == "local":
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool)):
            raise PackerError(f"workers must be a process count, got {workers!r}")
        return usable_cores() if workers is None else workers
    if workers is not None:
        raise PackerError(f"workers counts this machine's processes (engine='local'); "
                          f"engine={engine!r} decides its own")
    if engine == "ray":
        from .ray_engine import RayEngine
        return RayEngine()
    if callable(getattr(engine, "shards", None)):
        return engine
    raise PackerError(f"engine must be 'local', 'ray' or an engine object (e.g. "
                      f"packer.writing.ray_engine.RayEngine()), got {engine!r}")


def _pack(source: ImageList, dst: Path, options: dict, workers: Union[int, Any],
          transcode: Optional[Transcode], checks: Checks, part: Optional[tuple], overwrite: bool,
          progress: bool, on_shard: Optional[Callable[[dict], None]]) -> tuple:
    """(manifest, shards resumed); ``on_shard`` gets each shard once the journal lists it."""
    src = source.root
    if not source.entries:
        raise PackerError(f"{src}: no images to pack")
    # parts cut from different listings must not merge: the manifest records the listing (not
    # the fingerprint's options, which a part built by an older packer resumes under)
    part_of = journal.input_digest(source) if part is not None else None
    source = select(source, part=part, shuffle=options["shuffle"], seed=options["seed"])
    dst.mkdir(parents=True, exist_ok=True)
    with FolderLock(dst, f"packer build into {dst}"):
        fp = journal.fingerprint(source, options)
        if (dst / MANIFEST).exists():
            done = None if overwrite else journal.finished(dst, fp)
            if done is not None:  # this very build finished: a re-run changes nothing
                return done, len(done["shards"])
            if not overwrite:
                raise PackerError(f"{dst} already holds a finished dataset (of another source "
                                  f"or options, or an older packer); replace it with "
                                  f"overwrite=True")
            journal.remove_dataset(dst, read_manifest(dst))
        run = Packing(dst, fp, journal.load(dst, fp), schema=source_schema(source),
                      shard_size=options["shard_size"], strict=options["strict"])
        resumed = len(run.shards)
        for shard in run.shards if on_shard is not None else []:
            on_shard(shard)  # a resumed build's shards go up while it goes on
        bar = tqdm(total=len(source.entries), initial=run.start, unit="img",
                   disable=not progress, desc=f"packing {src.name or src}",
                   dynamic_ncols=True, smoothing=0.05)
        ann = source.annotations
        if ann is not None and not any(d["entry"] < 0 for d in run.dropped):
            for d in ann.dropped:  # not tied to one image (entry -1), unless resumed with them
                run.drop(-1, d["path"], [d["reason"]])
        try:  # (no run.abort(): a build's shards are written by ShardJobs, never by run.add)
            job = ShardJob(dst, FieldMaker(source, run.fields, run.column_names), transcode,
                           checks)
            _take(source, run, job, workers, bar, on_shard)
        finally:
            bar.close()
        manifest = run.finish(classes=source.classes, source=str(source.root.resolve()),
                              options=dict(options, part_of=part_of) if part_of else options,
                              extra=ann.extra if ann is not None else None)
    return manifest, resumed


def source_schema(source: ImageList) -> dict:
    """A source's record schema: ``label`` for classification, then the annotation fields."""
    ann = source.annotations
    labelled = ann is None or bool(source.entries) and source.entries[0][1] >= 0
    fields = [dict(LABEL_FIELD)] if labelled else []
    if ann is None:
        return {"task": "classification", "fields": fields}
    task = "classification" if fields and not ann.schema else ann.task
    return {"task": task, "fields": fields + list(ann.schema)}


def _take(source: ImageList, run: Packing, job: ShardJob, workers, bar, on_shard) -> None:
    """The planned shards taken in plan order: their samples into the tables and skip lists,
    then the shard into the journal; none after one cut short (a strict build's failure)."""
    sizes = file_sizes(source)
    broken, in_bytes = False, 0
    for done in _shards(_remaining(sizes, run, source), workers, job, bar):
        in_bytes += done.in_bytes
        if not done.failed and (done.stopped or broken):
            broken = True
            continue
        for i, kept, extra in done.samples:  # a strict build raises at its first problem
            rel = source.entries[i][0]
            if kept is None:
                run.skip(i, rel, extra)
            else:
                run.drop(i, rel, extra)
                run.add_row(kept[2], rel, kept[0], kept[1])
        done.taken = True  # from here the journal may list it: never removed as untaken
        run.add_shard(done.shard, done.task.end)
        if on_shard is not None and done.shard is not None:
            on_shard(done.shard)
        rate = in_bytes / 1e6 / max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix(MBps=f"{rate:.1f}", skipped=len(run.skipped), refresh=False)
    if broken:
        raise PackerError("the build was stopped before every shard was written")


def _remaining(sizes: List[int], run: Packing, source: ImageList) -> List[ShardTask]:
    """The plan's shards from ``run.start`` (where an interrupted run stopped, a shard
    boundary); if the files changed size since, the rest planned afresh. Numbered after the
    finished shards whatever the plan says: a new shard never replaces a journaled one."""
    if run.start >= len(source.entries):
        return []
    plan = plan_shards(sizes, run.shard_size)
    k = next((k for k, (a, _, _) in enumerate(plan) if a == run.start), None)
    if k is None:
        k, plan = 0, [(run.start + a, run.start + e, n)
                      for a, e, n in plan_shards(sizes[run.start:], run.shard_size)]
    first = max([k] + [shard_number(s["path"]) + 1 for s in run.shards])
    return [ShardTask(first + j, *p) for j, p in enumerate(plan[k:])]


def check_shard_size(shard_size: int) -> None:
    """A PackerError unless ``shard_size`` is 1 MiB to 64 GiB (build's and write's rule)."""
    if not 1 << 20 <= shard_size <= MAX_SHARD_SIZE:
        raise PackerError(f"shard_size must be between 1 MiB and 64 GiB, got {shard_size}: "
                          f"shards are mapped whole into each reader's address space")


def _shards(tasks: List[ShardTask], workers, job: ShardJob, bar) -> Iterator[ShardDone]:
    """Finished shards in plan order, about two per worker in flight. On an error, ``stop`` makes
    running shards give up, queued ones are cancelled and untaken finished ones removed.
    Workers are never killed (one killed mid-result would block the parent forever)."""
    if not isinstance(workers, int):
        yield from workers.shards(tasks, job, bar)
        return
    workers = min(workers, len(tasks))  # a process per shard at most, whatever was asked
    if workers == 0:
        current: Optional[ShardDone] = None  # handed out, not yet taken (the next call takes it)
        try:
            for t in tasks:
                current = write_shard(t, job)
                bar.update(len(current.samples))
                yield current
                current = None
        finally:
            remove_untaken(job.dst, [current])
        return
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    job.progress, job.stop = ctx.Value("q", 0), ctx.Event()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker,
                               initargs=(os.getpid(), job))
    pending: Deque[Future] = deque()
    todo, base = iter(tasks), bar.n
    done: Optional[ShardDone] = None  # finished, not taken yet
    try:
        while True:
            while len(pending) < 2 * workers and (task := next(todo, None)) is not None:
                pending.append(pool.submit(write_shard, task))
            if not pending:
                break
            while not pending[0].done():
                wait([pending[0]], timeout=0.2)
                bar.update(base + job.progress.value - bar.n)
            done = pending.popleft().result()
            yield done
            done = None
    except BrokenProcessPool:
        raise PackerError(f"a build worker process died (killed; out of memory?) while packing "
                          f"into {job.dst}; the finished shards are kept: re-run the same build "
                          f"to resume, with fewer workers (workers=N) if memory ran out") from None
    finally:
        job.stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        bar.update(base + job.progress.value - bar.n)
        remove_untaken(job.dst, [done] + [f.result() for f in pending if f.done()
                                          and not f.cancelled() and f.exception() is None])
