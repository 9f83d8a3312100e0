"""The build: worker processes read, check and write whole planned shards
(``packer.writing.worker``); this process takes them in plan order into the journal and tables.

Crash safety rests on ordering: a shard is renamed into place only when complete, the
journal (``.packer-build.json``) lists finished shards only, and the manifest — the one
file readers require — is written last. Re-running the same command resumes after the last
finished shard; a different command restarts cleanly.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections import deque
from itertools import islice
from concurrent.futures import Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Deque, Iterator, List, Optional, Sequence

from tqdm.auto import tqdm

from . import journal
from .._util.fsio import FolderLock, remove_own
from .._util.system import usable_cores
from .check import DEFAULT_MAX_PIXELS, Transcode
from ..errors import PackerError
from ..format.manifest import LABEL_FIELD, MANIFEST, read_manifest, shard_number
from .packing import Packing
from .laterows import ROWS_NAME, LateRows, write_rows
from .worker import FieldMaker, ShardDone, ShardJob, ShardTask, file_sizes, init_worker, plan_shards, write_shard, write_shards
from ..sources.base import IMG_EXTENSIONS, ImageList, parse_part, read_list, scan_folder, select

DEFAULT_SHARD_SIZE = 1 << 30
MAX_SHARD_SIZE = 64 << 30
FIRST_GROUP = 4  # shards per worker's first task while the annotations are read


@dataclass
class BuildResult:
    manifest: dict
    seconds: float
    resumed_shards: int = 0

    def summary(self) -> str:
        m = self.manifest
        dropped = f", dropped {m['dropped_count']} annotation(s)" if m.get("dropped_count") else ""
        return (f"packed {m['count']} images in {len(m['classes'])} classes into "
                f"{len(m['shards'])} shard(s), {m['bytes'] / 1e6:.1f} MB; "
                f"skipped {len(m['skipped'])}{dropped}; {self.seconds:.1f} s")


def build(src: os.PathLike, dst: os.PathLike, *, list_file: Optional[os.PathLike] = None,
          shard_size: int = DEFAULT_SHARD_SIZE, workers: Optional[int] = None,
          transcode: Optional[Transcode] = None, shuffle: bool = False, seed: int = 0,
          part: Optional[str] = None, strict: bool = False, overwrite: bool = False,
          max_pixels: int = DEFAULT_MAX_PIXELS, progress: bool = True,
          coco: Optional[os.PathLike] = None, yolo: Optional[os.PathLike] = None,
          names: Optional[os.PathLike] = None, meta: Optional[os.PathLike] = None,
          label: Optional[str] = None, skip_empty: bool = False, allow_empty: bool = False,
          extensions: Optional[Sequence[str]] = None,
          is_valid_file: Optional[Callable[[str], bool]] = None) -> BuildResult:
    """Pack ``src`` into shards in ``dst``: an ImageFolder layout, or the images that
    ``list_file`` lines, a COCO instances JSON (``coco``), YOLO label files (``yolo`` with
    ``names``) or a JSONL/CSV table (``meta``, ``label`` naming its class column) describe.
    ImageFolder options as torchvision's: ``extensions`` or ``is_valid_file`` pick the
    files; an empty class folder is an error unless ``allow_empty``."""
    journal.check_dst(dst)  # before anything is written: packer writes only where asked
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    workers = usable_cores() if workers is None else workers
    _check_arguments(src, dst, list_file, shard_size, workers, max_pixels)
    given = {"list": list_file, "coco": coco, "yolo": yolo, "meta": meta}
    folder = {"extensions": extensions, "is_valid_file": is_valid_file, "allow_empty": allow_empty}
    options = {"shard_size": shard_size, "transcode": asdict(transcode) if transcode else None,
               "shuffle": shuffle, "seed": seed, "part": part, "strict": strict,
               "max_pixels": max_pixels, "list": str(list_file) if list_file else None}
    for key, value in (("coco", coco), ("yolo", yolo), ("names", names), ("meta", meta),
                       ("label", label), ("skip_empty", skip_empty or None),
                       ("allow_empty", allow_empty or None),
                       ("extensions", ",".join(extensions) if extensions else None),
                       ("is_valid_file", getattr(is_valid_file, "__qualname__", None))):
        if value is not None:  # only what was given: older manifests' options stay as they were
            options[key] = value if isinstance(value, (bool, str)) else str(value)
    run = _Run(src, dst, options, workers, transcode, parse_part(part), overwrite, progress)
    check_source_options(**given, names=names, label=label, skip_empty=skip_empty)
    outline = None
    if coco is not None and not skip_empty and workers > 1 and sys.platform == "linux":
        from ..sources.cocooutline import coco_outline  # the workers start before the rows
        outline = coco_outline(src, coco, workers)
    try:
        source = outline.source if outline is not None else \
            load_source(src, **given, names=names, label=label, skip_empty=skip_empty,
                        workers=workers, **folder)
        manifest, resumed = run.pack(source, outline)
    except _ReadAgain as again:  # the full read disagrees with the outline: start afresh
        manifest, resumed = run.pack(again.source, None)
    return BuildResult(manifest, time.perf_counter() - t0, resumed)


class _ReadAgain(Exception):
    """The annotation file, read whole, lists other images or classes than its outline."""

    def __init__(self, source: ImageList):
        super().__init__("the source changed while read")
        self.source = source


@dataclass
class _Run:
    """One build's settings, for ``pack``."""
    src: Path
    dst: Path
    options: dict
    workers: int
    transcode: Optional[Transcode]
    part: Optional[tuple]
    overwrite: bool
    progress: bool

    def pack(self, source: ImageList, outline) -> tuple:
        """(manifest, shards resumed): ``source`` packed into ``dst``. With an ``outline``,
        the source has no rows yet: the workers start on the images while it reads them."""
        src, dst, o = self.src, self.dst, self.options
        if not source.entries:
            raise PackerError(f"found no images in {src} (extensions: "
                              f"{', '.join(IMG_EXTENSIONS)}, any case); nothing to pack")
        source = select(source, part=self.part, shuffle=o["shuffle"], seed=o["seed"])
        made = not dst.exists()
        dst.mkdir(parents=True, exist_ok=True)
        try:
            return self.pack_locked(source, outline)
        except BaseException:
            if made and outline is not None:  # as when the file is read first: no folder
                try:
                    dst.rmdir()  # only if empty (``pack_locked`` removed its journal)
                except OSError:
                    pass
            raise

    def pack_locked(self, source: ImageList, outline) -> tuple:
        src, dst, o = self.src, self.dst, self.options
        with FolderLock(dst, f"packer build into {dst}"):
            if (dst / MANIFEST).exists():
                if not self.overwrite:
                    raise PackerError(f"{dst} already holds a finished dataset; replace it with "
                                      f"overwrite=True (--overwrite)")
                journal.remove_dataset(dst, read_manifest(dst))
            fp = journal.fingerprint(source, o)
            run = Packing(dst, fp, journal.load(dst, fp), schema=source_schema(source),
                          shard_size=o["shard_size"], strict=o["strict"])
            resumed = len(run.shards)
            bar = tqdm(total=len(source.entries), initial=run.start, unit="img",
                       disable=not self.progress, desc=f"packing {src.name or src}",
                       dynamic_ncols=True, smoothing=0.05)
            late, reading, stop = None, None, None
            if outline is None:
                _drop_unusable(run, source)
            else:  # forked workers: events made now reach them
                stop = mp.get_context("fork").Event()
                late = LateRows(dst / ROWS_NAME, mp.get_context("fork").Event(), stop)
                reading = (outline.start, lambda started: self.deliver(outline, started, source,
                                                                       run, late))
            try:
                job = ShardJob(dst, FieldMaker(source, run.fields, run.column_names, late),
                               self.transcode, o["max_pixels"], o["strict"], stop=stop)
                _pack(source, run, job, self.workers, bar, reading)
            except BaseException:
                run.abort()
                if outline is not None and not run.shards:  # e.g. the annotations are
                    remove_own(dst, journal.JOURNAL)  # broken: DST as it was found
                raise
            finally:
                bar.close()
                if late is not None:
                    remove_own(dst, ROWS_NAME)
            ann = source.annotations
            manifest = run.finish(classes=source.classes, source=str(source.root.resolve()),
                                  options=o, extra=ann.extra if ann is not None else None)
            journal.remove_leftovers(dst, {s["path"] for s in manifest["shards"]})
        return manifest, resumed

    def deliver(self, outline, started: list, source: ImageList, run: Packing,
                late: LateRows) -> None:
        """The annotations read in full, checked against what the workers started on, and
        handed to them (``laterows``)."""
        o = self.options
        full = outline.finish(started)
        chosen = select(full, part=self.part, shuffle=o["shuffle"], seed=o["seed"])
        if (chosen.entries != source.entries or chosen.classes != source.classes
                or chosen.annotations.extra != source.annotations.extra):
            raise _ReadAgain(full)
        _drop_unusable(run, chosen)
        write_rows(self.dst / ROWS_NAME, chosen.annotations.rows)
        late.written.set()


def _drop_unusable(run: Packing, source: ImageList) -> None:
    """The annotations the parser could not use (entry -1: not tied to one image), unless
    the resumed journal has them."""
    ann = source.annotations
    if ann is not None and not any(d["entry"] < 0 for d in run.dropped):
        for d in ann.dropped:
            run.drop(-1, d["path"], [d["reason"]])


def load_source(src: Path, *, list: Optional[os.PathLike] = None,
                coco: Optional[os.PathLike] = None, yolo: Optional[os.PathLike] = None,
                meta: Optional[os.PathLike] = None, names: Optional[os.PathLike] = None,
                label: Optional[str] = None, skip_empty: bool = False, allow_empty: bool = False,
                extensions: Optional[Sequence[str]] = None,
                is_valid_file: Optional[Callable[[str], bool]] = None,
                workers: int = 0) -> ImageList:
    """What to pack, from the one source the options name (ImageFolder when none);
    ``workers`` processes may share the reading (a large COCO file's annotations)."""
    check_source_options(list=list, coco=coco, yolo=yolo, meta=meta, names=names, label=label,
                         skip_empty=skip_empty)
    if coco is not None:
        from ..sources.coco import read_coco
        return read_coco(src, coco, skip_empty=skip_empty, workers=workers)
    if yolo is not None:
        from ..sources.yolo import read_yolo
        return read_yolo(src, yolo, names)
    if meta is not None:
        from ..sources.table import read_meta
        return read_meta(src, meta, label=label)
    if list is not None:
        return read_list(src, list)
    return scan_folder(src, extensions=extensions, is_valid_file=is_valid_file,
                       allow_empty=allow_empty)


def check_source_options(*, list=None, coco=None, yolo=None, meta=None, names=None, label=None,
                         skip_empty: bool = False) -> None:
    """A PackerError where the source options do not go together."""
    chosen = [k for k, v in (("list", list), ("coco", coco), ("yolo", yolo), ("meta", meta))
              if v is not None]
    if len(chosen) > 1:
        raise PackerError(f"pass one source: {' and '.join('--' + c for c in chosen)} exclude "
                          f"each other")
    if (names is not None) != (yolo is not None):
        raise PackerError("--yolo LABELS_DIR and --names NAMES go together")
    if label is not None and meta is None:
        raise PackerError("--label COLUMN picks a column of --meta FILE; pass --meta too")
    if skip_empty and coco is None:
        raise PackerError("--skip-empty applies to --coco datasets (images with no annotation)")


def source_schema(source: ImageList) -> dict:
    """The schema a source's records get: ``label`` for classification (ImageFolder,
    ``--list``, ``--meta --label``), then the annotation fields."""
    ann = source.annotations
    labelled = ann is None or bool(source.entries) and source.entries[0][1] >= 0
    fields = [dict(LABEL_FIELD)] if labelled else []
    if ann is None:
        return {"task": "classification", "fields": fields}
    task = "classification" if fields and not ann.schema else ann.task
    return {"task": task, "fields": fields + list(ann.schema)}


def _pack(source: ImageList, run: Packing, job: ShardJob, workers: int, bar,
          reading: Optional[tuple] = None) -> None:
    """The planned shards, written by the workers, taken in plan order: each one's samples
    into the side tables and skip lists, then the shard into the journal. Shards after one
    that was cut short are not taken (a strict build's failure stopped them). ``reading``:
    the annotations still to read (see ``_shards``)."""
    sizes = file_sizes(source)
    broken, in_bytes = False, 0
    for done in _shards(_remaining(sizes, run, source), workers, job, bar, reading):
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
        rate = in_bytes / 1e6 / max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix(MBps=f"{rate:.1f}", skipped=len(run.skipped), refresh=False)
    if broken:
        raise PackerError("the build was stopped before every shard was written")


def _remaining(sizes: List[int], run: Packing, source: ImageList) -> List[ShardTask]:
    """The plan's shards from ``run.start`` (where an interrupted run stopped, a shard
    boundary); if the files changed size since, the rest planned afresh, numbered on."""
    plan = plan_shards(sizes, run.shard_size)
    starts = [p[0] for p in plan]
    if run.start >= len(source.entries):
        return []
    if run.start in starts:
        k = starts.index(run.start)
        return [ShardTask(k + j, a, e, n) for j, (a, e, n) in enumerate(plan[k:])]
    last = max(shard_number(s["path"]) for s in run.shards) if run.shards else -1
    rest = plan_shards(sizes[run.start:], run.shard_size)
    return [ShardTask(last + 1 + j, run.start + a, run.start + e, n)
            for j, (a, e, n) in enumerate(rest)]


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


def _is_within(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


# -- workers ---------------------------------------------------------------------------------

def _shards(tasks: List[ShardTask], workers: int, job: ShardJob, bar,
            reading: Optional[tuple] = None) -> Iterator[ShardDone]:
    """Finished shards in plan order, about two per worker in flight; the bar follows the
    workers' shared image counter. ``reading``: ``(start, deliver)`` where the annotations
    are read while the workers run: ``start(submit)`` hands the pool its share of the
    reading before any shard, ``deliver(started)`` finishes it and hands the rows over.

    On an error (a full disk, Ctrl-C, a strict build's bad image) the ``stop`` event makes
    running shards give up at their next image, queued ones are cancelled, and shards that
    finished but were not taken into the journal are removed: what stays is what the journal
    lists. Workers are never killed: one killed while sending its result leaves the parent
    blocked reading half a message, forever — what ``Pool.terminate`` did here.
    """
    if workers == 0:
        current: Optional[ShardDone] = None  # handed out, not yet taken (the next call takes it)
        try:
            for t in tasks:
                current = write_shard(t, job)
                bar.update(len(current.samples))
                yield current
                current = None
        finally:
            _remove_untaken(job.dst, [current])
        return
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    job.progress, job.stop = ctx.Value("q", 0), job.stop or ctx.Event()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker,
                               initargs=(os.getpid(), job))
    pending: Deque[Future] = deque()
    todo, base = iter(tasks), bar.n
    # shards in each worker's first task: more while the annotations are read, if every
    # worker still gets some
    group = max(1, min(FIRST_GROUP, len(tasks) // (2 * workers))) if reading else 1
    batch: List[ShardDone] = []  # a finished task's shards, not all taken yet
    try:
        started = reading[0](pool.submit) if reading else None
        while True:
            while len(pending) < 2 * workers:
                chunk = [t for t in islice(todo, group if len(pending) < workers else 1)]
                if not chunk:
                    break
                pending.append(pool.submit(write_shards, chunk))
            if reading:
                reading[1](started)  # the workers check images meanwhile
                reading, group = None, 1
            if not pending:
                break
            while not pending[0].done():
                wait([pending[0]], timeout=0.2)
                bar.update(base + job.progress.value - bar.n)
            batch = pending.popleft().result()
            for done in batch:
                yield done
            batch = []
    finally:
        job.stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        bar.update(base + job.progress.value - bar.n)
        _remove_untaken(job.dst, batch + [d for f in pending if f.done() and not f.cancelled()
                                            and f.exception() is None for d in f.result()])


def _remove_untaken(dst: Path, results: List[Optional[ShardDone]]) -> None:
    for done in results:
        if done is not None and done.shard is not None and not done.taken:
            remove_own(dst, done.shard["path"])
