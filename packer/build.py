"""The build: worker processes read and check images, one writer appends them to shards.

Crash safety rests on ordering: a shard is renamed into place only when complete, the
journal (``.packer-build.json``) lists finished shards only, and the manifest — the one
file readers require — is written last. Re-running the same command resumes after the last
finished shard; a different command restarts cleanly.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from array import array
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import islice
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Deque, Iterator, List, Optional, Sequence, Tuple

from tqdm.auto import tqdm

from . import __version__
from .errors import PackerError
from .format import (crc32, FORMAT_NAME, FORMAT_VERSION, LABELS, MANIFEST, OFFSETS, SHARD_PATTERN,
                     file_sha256, fsync_dir, pack_record, read_manifest, write_json_atomic)
from .imaging import DEFAULT_MAX_PIXELS, BadImage, Transcode, check_image, pil_summary
from .source import (IMG_EXTENSIONS, Source, is_utf8, parse_part, printable, read_list,
                     scan_folder, select)
from .reader import read_labels, read_offsets, shard_offsets
from .writer import ShardWriter, disk_errors, existing_shard_ok

JOURNAL = ".packer-build.json"
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
    if not 1 << 20 <= shard_size <= MAX_SHARD_SIZE:
        raise PackerError(f"--shard-size must be between 1 MiB and 64 GiB, got {shard_size}: "
                          f"shards are mapped whole into each reader's address space")
    if max_pixels < 1:
        raise PackerError(f"--max-pixels must be a positive pixel count, got {max_pixels}")
    workers = default_workers() if workers is None else workers
    if workers < 0:
        raise PackerError("--workers must be >= 0 (0 checks images in this process)")
    if not list_file and _is_within(dst, src):
        raise PackerError(f"DST {dst} is inside the source folder {src}: it would become a class "
                          f"of its own source; put the dataset outside SRC")
    source = read_list(src, list_file) if list_file else scan_folder(src)
    if not source.entries:
        raise PackerError(f"found no images in {src} (extensions: "
                          f"{', '.join(IMG_EXTENSIONS)}, any case); nothing to pack")
    source = select(source, part=parse_part(part), shuffle=shuffle, seed=seed)
    options = {"shard_size": shard_size, "transcode": asdict(transcode) if transcode else None,
               "shuffle": shuffle, "seed": seed, "part": part, "strict": strict,
               "max_pixels": max_pixels, "list": str(list_file) if list_file else None}
    fingerprint = _fingerprint(source, options)
    dst.mkdir(parents=True, exist_ok=True)
    if (dst / MANIFEST).exists():
        if not overwrite:
            raise PackerError(f"{dst} already holds a finished dataset; pass --overwrite to replace it")
        remove_dataset_files(dst)
    journal = _load_journal(dst, fingerprint)

    shards: List[dict] = journal["shards"]
    skipped: List[dict] = journal["skipped"]
    start = journal["next_entry"]
    labels = _labels_so_far(source, start, skipped)
    resumed = len(shards)

    bar = tqdm(total=len(source.entries), initial=start, unit="img", disable=not progress,
               desc=f"packing {src.name or src}", dynamic_ncols=True, smoothing=0.05)
    writer: Optional[ShardWriter] = None
    in_bytes = 0
    try:
        for i, status, payload, label, nbytes in _process(source, start, workers, transcode, max_pixels):
            bar.update(1)
            in_bytes += nbytes
            if status == "ok" and isinstance(payload, tuple):
                payload = _stored(source.root, source.entries[i][0], label, payload)
                if payload is None:
                    status, payload = "skip", "changed or vanished while the build read it"
            if status == "skip":
                if strict:
                    raise PackerError(f"--strict: {printable(source.entries[i][0])}: {payload}; "
                                      f"no dataset was written (fix or remove the file, then re-run)")
                skipped.append({"path": printable(source.entries[i][0]), "reason": payload, "entry": i})
                bar.set_postfix(skipped=len(skipped), refresh=False)
                continue
            if writer is None:
                writer = ShardWriter(dst / SHARD_PATTERN.format(len(shards)), expected_bytes=shard_size)
            writer.append(payload)
            labels.append(label)
            if writer.bytes >= shard_size:
                shards.append(writer.finish())
                writer = None
                _save_journal(dst, fingerprint, shards, skipped, i + 1)
            if bar.n % 256 == 0:
                bar.set_postfix(MBps=f"{in_bytes / 1e6 / max(bar.format_dict['elapsed'], 1e-9):.1f}",
                                skipped=len(skipped), refresh=False)
        if writer is not None:
            shards.append(writer.finish())
            writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        bar.close()

    if not labels:
        first = skipped[0]
        raise PackerError(f"all {len(skipped)} images were skipped (e.g. {first['path']}: "
                          f"{first['reason']}); no dataset was written")
    manifest = _finish(dst, source, shards, skipped, labels, options)
    _remove_leftovers(dst, {s["path"] for s in manifest["shards"]})
    return BuildResult(manifest, time.perf_counter() - t0, resumed)


def _is_within(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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
    if transcode is None:  # unchanged bytes: the parent re-reads them (see _stored)
        return i, "ok", (crc32(data), c.width, c.height, c.format, c.mode), label, len(data)
    rec = pack_record(c.data, label=label, path=rel, width=c.width, height=c.height,
                      format=c.format, mode=c.mode)
    return i, "ok", rec, label, len(data)


def _stored(root: Path, rel: str, label: int, checked) -> Optional[bytes]:
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


def _worker_init() -> None:
    # Ctrl-C reaches the whole process group: only the parent handles it (and terminates the
    # pool). A worker dying of KeyboardInterrupt mid-queue-operation can hang Pool.terminate().
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _process(source: Source, start: int, workers: int, transcode, max_pixels) -> Iterator:
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
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init)
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

def _fingerprint(source: Source, options: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT_VERSION, source.classes, options], sort_keys=True).encode())
    for rel, label in source.entries:
        h.update(f"{rel}\t{label}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _load_journal(dst: Path, fingerprint: str) -> dict:
    fresh = {"shards": [], "skipped": [], "next_entry": 0}
    path = dst / JOURNAL
    for p in dst.glob(".*.partial"):
        p.unlink()  # an interrupted shard: always redone
    for p in dst.glob(".*.compact"):
        p.unlink()
    if not path.exists():
        remove_dataset_files(dst)
        return fresh
    try:
        j = json.loads(path.read_text("utf-8"))
    except ValueError:
        j = {}
    if j.get("fingerprint") != fingerprint:
        remove_dataset_files(dst)  # different source or options: restart cleanly
        return fresh
    for n, shard in enumerate(j["shards"]):
        problem = existing_shard_ok(shard, dst)
        if problem is not None:  # keep what checks out, redo from the first bad shard
            cut = j["shards"][n - 1]["next_entry"] if n else 0
            j["shards"] = j["shards"][:n]
            j["skipped"] = [s for s in j["skipped"] if s["entry"] < cut]
            j["next_entry"] = cut
            break
    shards = [{k: v for k, v in s.items()} for s in j["shards"]]
    return {"shards": shards, "skipped": j["skipped"], "next_entry": j["next_entry"]}


def _save_journal(dst: Path, fingerprint: str, shards: List[dict], skipped: List[dict],
                  next_entry: int) -> None:
    shards[-1]["next_entry"] = next_entry
    with disk_errors(dst / JOURNAL):
        write_json_atomic(dst / JOURNAL, {"fingerprint": fingerprint, "shards": shards,
                                          "skipped": skipped, "next_entry": next_entry})


def _remove_leftovers(dst: Path, keep: set) -> None:
    """After the manifest: the journal, temp files, and shard files it does not list (left by
    an interrupted earlier attempt whose shards came out differently)."""
    for pattern in (JOURNAL, JOURNAL + ".tmp", "shard-*.lmdb", ".shard-*"):
        for p in dst.glob(pattern):
            if p.name not in keep:
                p.unlink(missing_ok=True)


def _labels_so_far(source: Source, start: int, skipped: List[dict]) -> array:
    gone = {s["entry"] for s in skipped}
    return array("i", (lab for i, (_, lab) in enumerate(source.entries[:start]) if i not in gone))


def remove_dataset_files(dst: Path) -> None:
    """Remove what a build writes (and nothing else a user may keep in the folder)."""
    if (dst / MANIFEST).exists():  # first, durably: a half-removed dataset must not look finished
        (dst / MANIFEST).unlink()
        fsync_dir(dst)
    for pattern in (MANIFEST + ".tmp", "shard-*.lmdb", ".shard-*", LABELS, LABELS + ".tmp",
                    OFFSETS, OFFSETS + ".tmp", JOURNAL, JOURNAL + ".tmp"):
        for p in dst.glob(pattern):
            p.unlink()


def write_table(dst: Path, name: str, table: array) -> dict:
    """Write a per-record table (labels, offsets) little-endian, atomically; its manifest entry."""
    if sys.byteorder != "little":
        table = array(table.typecode, table)
        table.byteswap()
    tmp = dst / (name + ".tmp")
    with disk_errors(dst / name):
        with open(tmp, "wb") as f:
            table.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst / name)
    return {"path": name, "bytes": (dst / name).stat().st_size, "sha256": file_sha256(dst / name)}


def _offsets(dst: Path, shards: List[dict]) -> Optional[array]:
    """Every record's byte range in its shard, read once now so readers never walk LMDB."""
    table = array("Q")
    for s in shards:
        part = shard_offsets(dst / s["path"])
        if part is None:
            return None
        table.extend(part)
    return table


def _finish(dst: Path, source: Source, shards: List[dict], skipped: List[dict],
            labels: array, options: dict) -> dict:
    count = sum(s["count"] for s in shards)
    assert count == len(labels), (count, len(labels))
    label_entry = write_table(dst, LABELS, labels)
    offsets = _offsets(dst, shards)
    offsets_entry = write_table(dst, OFFSETS, offsets) if offsets is not None else None
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
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "count": sum(s["count"] for s in shards), "bytes": sum(s["bytes"] for s in shards),
        "classes": list(classes), "class_to_idx": {c: i for i, c in enumerate(classes)},
        "class_counts": list(class_counts), "shards": shards, "labels": labels, **extra,
        "skipped": skipped, "source": source, "options": options, "pil": pil_summary(),
    }


# -- merge -----------------------------------------------------------------------------------

def merge(parts: Sequence[os.PathLike], dst: os.PathLike, *, overwrite: bool = False) -> dict:
    """Join finished part datasets into one, without copying shard data.

    The merged manifest points at the parts' shard files by relative path, so keep the parts
    where they are (or stage the merged dataset, which copies everything it references).
    """
    dst = Path(dst)
    if not parts:
        raise PackerError("merge needs at least one part")
    mans = [(Path(p), read_manifest(p)) for p in parts]
    seen: dict = {}
    for p, m in mans:  # the same folder twice, or the same part built twice: duplicate records
        same_part = json.dumps([m.get("source"), m.get("options")], sort_keys=True)
        for ident in (str(p.resolve()), same_part if m.get("options", {}).get("part") else None):
            if ident is not None and ident in seen:
                raise PackerError(f"{p} is the same part as {seen[ident]} (given more than once); "
                                  f"merging it twice would duplicate its records")
            seen[ident] = p
    classes = mans[0][1]["classes"]
    for p, m in mans[1:]:
        if m["classes"] != classes:
            raise PackerError(f"{p} has different classes from {mans[0][0]}; parts of one "
                              f"dataset must be built from the same source")
    dst.mkdir(parents=True, exist_ok=True)
    if (dst / MANIFEST).exists() and not overwrite:
        raise PackerError(f"{dst} already holds a finished dataset; pass --overwrite to replace it")
    shards, skipped, labels, offsets = [], [], array("i"), array("Q")
    for p, m in mans:
        rel = os.path.relpath(p.resolve(), dst.resolve())
        for s in m["shards"]:
            shards.append(dict(s, path=os.path.normpath(os.path.join(rel, s["path"])).replace(os.sep, "/")))
        skipped.extend(m["skipped"])
        labels.extend(read_labels(p, m))
        part_offsets = read_offsets(p, m) if offsets is not None else None
        offsets = None if part_offsets is None else offsets + part_offsets  # per shard: they concatenate
    counts = [0] * len(classes)
    for lab in labels:
        counts[lab] += 1
    manifest = new_manifest(
        classes=classes, class_counts=counts, shards=shards, labels=write_table(dst, LABELS, labels),
        offsets=write_table(dst, OFFSETS, offsets) if offsets is not None else None, skipped=skipped, source=mans[0][1].get("source", ""),
        options=dict(mans[0][1]["options"], part=None, merged_from=[str(p) for p, _ in mans]))
    write_json_atomic(dst / MANIFEST, manifest)
    return manifest
