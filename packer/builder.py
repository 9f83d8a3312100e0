"""The build: worker processes read and check images, one writer appends them to shards.

Crash safety rests on ordering: a shard is renamed into place only when complete, the
journal (``.packer-build.json``) lists finished shards only, and the manifest — the one
file readers require — is written last. Re-running the same command resumes after the last
finished shard; a different command restarts cleanly.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import islice
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Deque, Iterator, Optional, Sequence, Tuple

from tqdm.auto import tqdm

from . import journal
from ._fsio import FolderLock
from ._system import die_with_parent, usable_cores
from .check import DEFAULT_MAX_PIXELS, BadImage, Transcode, check_image
from .errors import PackerError
from .fields import encode
from .format import LABEL_FIELD, MANIFEST, crc32, pack_fields, read_manifest
from .packing import Packing
from .source import IMG_EXTENSIONS, ImageList, is_utf8, parse_part, read_list, scan_folder, select

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
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    workers = usable_cores() if workers is None else workers
    _check_arguments(src, dst, list_file, shard_size, workers, max_pixels)
    given = {"list": list_file, "coco": coco, "yolo": yolo, "meta": meta}
    folder = {"extensions": extensions, "is_valid_file": is_valid_file, "allow_empty": allow_empty}
    source = load_source(src, **given, names=names, label=label, skip_empty=skip_empty, **folder)
    if not source.entries:
        raise PackerError(f"found no images in {src} (extensions: "
                          f"{', '.join(IMG_EXTENSIONS)}, any case); nothing to pack")
    source = select(source, part=parse_part(part), shuffle=shuffle, seed=seed)
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
    dst.mkdir(parents=True, exist_ok=True)
    with FolderLock(dst, f"packer build into {dst}"):
        if (dst / MANIFEST).exists():
            if not overwrite:
                raise PackerError(f"{dst} already holds a finished dataset; replace it with "
                                  f"overwrite=True (--overwrite)")
            journal.remove_dataset(dst, read_manifest(dst))
        fp = journal.fingerprint(source, options)
        run = Packing(dst, fp, journal.load(dst, fp), schema=source_schema(source),
                      shard_size=shard_size, strict=strict)
        resumed = len(run.shards)
        ann = source.annotations
        if ann is not None and not any(d["entry"] < 0 for d in run.dropped):
            for d in ann.dropped:  # found while parsing (entry -1: not tied to one image)
                run.drop(-1, d["path"], [d["reason"]])
        bar = tqdm(total=len(source.entries), initial=run.start, unit="img", disable=not progress,
                   desc=f"packing {src.name or src}", dynamic_ncols=True, smoothing=0.05)
        try:
            maker = FieldMaker(source, run.fields, run.column_names)
            _pack(source, run, _process(source, run.start, workers, transcode, max_pixels,
                                        maker), bar)
        except BaseException:
            run.abort()
            raise
        finally:
            bar.close()
        manifest = run.finish(classes=source.classes, source=str(source.root.resolve()),
                              options=options, extra=ann.extra if ann is not None else None)
        journal.remove_leftovers(dst, {s["path"] for s in manifest["shards"]})
    return BuildResult(manifest, time.perf_counter() - t0, resumed)


def load_source(src: Path, *, list: Optional[os.PathLike] = None,
                coco: Optional[os.PathLike] = None, yolo: Optional[os.PathLike] = None,
                meta: Optional[os.PathLike] = None, names: Optional[os.PathLike] = None,
                label: Optional[str] = None, skip_empty: bool = False, allow_empty: bool = False,
                extensions: Optional[Sequence[str]] = None,
                is_valid_file: Optional[Callable[[str], bool]] = None) -> ImageList:
    """What to pack, from the one source the options name (ImageFolder when none)."""
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
    if coco is not None:
        from .sources.coco import read_coco
        return read_coco(src, coco, skip_empty=skip_empty)
    if yolo is not None:
        from .sources.yolo import read_yolo
        return read_yolo(src, yolo, names)
    if meta is not None:
        from .sources.meta import read_meta
        return read_meta(src, meta, label=label)
    if list is not None:
        return read_list(src, list)
    return scan_folder(src, extensions=extensions, is_valid_file=is_valid_file,
                       allow_empty=allow_empty)


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


def _pack(source: ImageList, run: Packing, results: Iterator, bar) -> None:
    """Checked images, in entry order, into the run (their fields fitted to each image's size
    and encoded by the workers)."""
    in_bytes = 0
    for i, status, payload, nbytes in results:
        bar.update(1)
        in_bytes += nbytes
        rel = source.entries[i][0]
        if status == "ok":
            data, crc, width, height, fmt, mode, fields, columns, reasons = payload
            data = data if data is not None else reread(source.root, rel, crc)
            if data is None:
                status, payload = "skip", "changed or vanished while the build read it"
        if status == "skip":
            run.skip(i, rel, payload)
        else:
            run.drop(i, rel, reasons)
            run.add_packed(i, rel, data, width, height, fmt, mode, fields, columns)
        if bar.n % 256 == 0:
            rate = in_bytes / 1e6 / max(bar.format_dict["elapsed"], 1e-9)
            bar.set_postfix(MBps=f"{rate:.1f}", skipped=len(run.skipped), refresh=False)
    run.end_shard(len(source.entries))


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

def _work(task, fields: Optional["FieldMaker"] = None) -> Tuple[int, str, object, int]:
    """Runs in a worker: read, check (and maybe transcode) one image, fit its annotation to
    its size and encode its fields (work the single writer process need not do). The result
    carries the stored bytes only when transcoded (else the writer re-reads them, see
    ``reread``)."""
    i, root, rel, transcode, max_pixels = task
    fields = fields or _WORKER_FIELDS[0]
    if not is_utf8(rel):  # records and the manifest store paths as UTF-8 text
        return i, "skip", ("file name is not valid UTF-8: rename it (e.g. `convmv -r -f latin1 "
                           "-t utf8 --notest SRC`)"), 0
    try:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
    except OSError as e:
        return i, "skip", f"unreadable: {e.strerror or e}", 0
    try:
        c = check_image(data, transcode=transcode, max_pixels=max_pixels)
    except BadImage as e:
        return i, "skip", str(e), len(data)
    try:
        packed, columns, reasons = fields.encoded(i, c.width, c.height)
    except ValueError as e:
        return i, "skip", f"annotation: {e}", len(data)
    kept = c.data if transcode is not None else None
    return i, "ok", (kept, crc32(c.data), c.width, c.height, c.format, c.mode, packed, columns,
                     reasons), len(data)


class FieldMaker:
    """Each entry's stored fields for an image of a given size: its label, and its
    annotation row fitted (``Annotations.fit``), encoded (``packer.fields``) and packed as
    msgpack, with the values its side tables take. The build's workers make them, so the
    writer process only concatenates; forked workers share the rows without copying."""

    def __init__(self, source: ImageList, fields: list, column_names: list):
        self.source, self.fields, self.column_names = source, fields, column_names
        self.has_label = any(f["name"] == "label" for f in fields)

    def encoded(self, i: int, width: int, height: int):
        ann = self.source.annotations
        values: dict = {"label": self.source.entries[i][1]} if self.has_label else {}
        reasons: list = []
        if ann is not None:
            row, reasons = (ann.fit(ann.rows[i], width, height) if ann.fit is not None
                            else (ann.rows[i], []))
            values.update(row)
        stored = encode(self.fields, values)
        return pack_fields(stored), {k: stored[k] for k in self.column_names}, reasons


def reread(root: Path, rel: str, crc: int) -> Optional[bytes]:
    """The bytes of a file a worker checked, read again here, from the page cache.

    Cheaper than shipping them back through a pipe (pickle, two copies, many syscalls) on
    machines where the writer shares few cores with the workers. The checksum makes sure
    the bytes stored are the bytes checked; None if the file changed in between.
    """
    try:
        with open(root / rel, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data if crc32(data) == crc else None


_WORKER_FIELDS: list = [None]  # a worker's FieldMaker, set once when the worker starts


def _worker_init(parent: int, fields: "FieldMaker") -> None:
    # Ctrl-C reaches the whole process group: only the parent handles it (and terminates the
    # pool). A worker dying of KeyboardInterrupt mid-queue-operation can hang Pool.terminate().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    _WORKER_FIELDS[0] = fields  # forked: inherited, not pickled (spawn: pickled once)


def _process(source: ImageList, start: int, workers: int, transcode, max_pixels,
             fields: "FieldMaker") -> Iterator:
    """Results in entry order, with at most a few chunks per worker in flight.

    On an error (a full disk, Ctrl-C) queued chunks are cancelled and running ones finish
    (milliseconds). Workers are never killed: one killed while sending its results leaves
    the parent blocked reading half a message, forever — what ``Pool.terminate`` did here.
    """
    root = str(source.root)
    tasks = ((i, root, rel, transcode, max_pixels)
             for i, (rel, _) in enumerate(source.entries) if i >= start)
    if workers == 0:
        yield from (_work(t, fields) for t in tasks)
        return
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                               initargs=(os.getpid(), fields))
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


