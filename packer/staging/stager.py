"""Staging: copy a finished dataset to fast storage (a tmpfs, ``/dev/shm``) and undo it.

The copy is crash safe by the same rule as the build: each file is copied whole under a
temporary name (``.NAME.staging``), hashed while it is copied and verified against the
manifest, then renamed into place; the manifest — the one file readers require — goes
last. TARGET is therefore either a complete dataset or one that nothing accepts as
complete, and re-running the same command checks what is there (size and checksum) and
recopies only what differs or is missing.

Shard paths in a manifest may point outside the dataset folder (``packer merge`` refers to
its parts' files); staging copies every referenced file into TARGET under a flat name and
writes a manifest with rewritten paths, so TARGET is self-contained and
``PackedDataset(TARGET)`` works with no other change.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import stat
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Tuple

from tqdm.auto import tqdm

from .. import __version__
from .._util.system import fs_type, human_size, meminfo
from ..errors import FormatError, PackerError
from .._util.fsio import LOCK_NAME, FolderLock, fsync_dir, remove_own, write_json_atomic
from ..format.manifest import LABELS, MANIFEST, OFFSETS, PATHS_INDEX, PATHS_TEXT, file_sha256, read_manifest, set_table, shard_file, side_tables
from ..storage import RemoteDataset, is_url
from .copy import TMP_SUFFIX, StagedFile, check_and_rename, copy_file, disk_full, tmpfs_advice
from .results import RAM_FS, StageResult, UnstageResult

STAGE_MARKER = ".packer-stage.json"   # written first, kept: says "packer staged this folder"
STAGE_LOCK = LOCK_NAME                # flock'ed while staging or unstaging: one at a time


def space_margin(need: int) -> int:
    """Headroom kept free on TARGET beyond the bytes to copy: 1% + 1 MiB."""
    return need // 100 + (1 << 20)


def ram_margin(mem_total: int) -> int:
    """RAM left for everything else when staging into a RAM filesystem: 5%, at least 256 MiB."""
    return max(256 << 20, mem_total // 20)


# -- stage -----------------------------------------------------------------------------------

def stage(src: os.PathLike, target: os.PathLike, *, progress: bool = True,
          verify: bool = True, storage_options: Optional[dict] = None) -> StageResult:
    """Copy the dataset ``src`` (shards, tables, manifest) into ``target`` and verify it.

    Args:
        src: a finished dataset (built or merged): a folder, or a URL (``s3://``, ``gs://``...).
        target: where to put the copy, typically ``/dev/shm/NAME`` or a tmpfs mount; created
            if missing. It may hold other files, but not a dataset that was not staged.
        progress: show a bytes progress bar (tqdm).
        verify: hash files already in ``target`` before keeping them, and re-read each copied
            file from ``target`` to check it against the manifest. With ``verify=False``
            files already there are checked by size only, and copies are checked by the hash
            computed while copying (which still catches a source that changed or rotted).
        storage_options: for a URL: fsspec's options (endpoint, credentials) and packer's.

    Returns a ``StageResult``; ``print(result.message())`` tells the user where the data is.
    Raises ``PackerError`` for an incomplete source, a target that is not safe to write, or
    not enough free space (checked before anything is written).
    """
    t0 = time.perf_counter()
    src, target = (RemoteDataset(src, storage_options) if is_url(src) else Path(src)), Path(target)
    man = read_manifest(src) if isinstance(src, Path) else src.read_manifest()
    plan = staging_plan(src, man)
    if target.exists() and not target.is_dir():
        raise PackerError(f"{target} exists and is not a folder; pick a folder to stage into")
    created = not target.exists()
    try:
        with _vanishing(target):
            _refuse_unsafe_target(src, target, plan)
            target.mkdir(parents=True, exist_ok=True)
            with FolderLock(target, f"packer stage {src} into {target}"):
                return _stage_locked(src, target, man, plan, progress, verify, t0)
    except BaseException:
        if not (target / STAGE_MARKER).exists():  # refused before writing anything: tidy up
            if created:
                try:
                    target.rmdir()
                except OSError:
                    pass
        raise


def _stage_locked(src: Path, target: Path, man: dict, plan: List["StagedFile"], progress: bool,
                  verify: bool, t0: float) -> StageResult:
    _refuse_unsafe_target(src, target, plan)  # again, under the lock
    result = StageResult(source=src, target=target, fstype=fs_type(target),
                         swap=meminfo().get("SwapTotal", 0) > 0)
    staged_manifest = _staged_manifest(src, man, plan)
    previous = _previous_names(target)
    wanted = {f.name for f in plan} | {MANIFEST}

    _refuse_foreign(target, wanted - previous)
    # What is already there and right, what must be (re)copied, what must go.
    stale = sorted(n for n in previous - wanted if (target / n).exists())
    temps = sorted(f".{n}{TMP_SUFFIX}" for n in previous if os.path.lexists(target / f".{n}{TMP_SUFFIX}"))
    todo: List[StagedFile] = []
    doomed: List[str] = []
    sizes = {f.name: _size(target / f.name) for f in plan}
    to_hash = [f for f in plan if sizes[f.name] == f.bytes and verify and f.sha256 is not None]
    check_bar = _bar(progress, sum(f.bytes for f in to_hash), f"checking {target.name or target}")
    try:  # hashing releases the GIL: check several files at once
        with ThreadPoolExecutor(_threads(len(to_hash))) as pool:
            digests = dict(zip((f.name for f in to_hash),
                               pool.map(lambda f: file_sha256(target / f.name, check_bar.update), to_hash)))
    finally:
        check_bar.close()
    for f in plan:
        if sizes[f.name] is None:
            todo.append(f)
        elif sizes[f.name] == f.bytes and digests.get(f.name, f.sha256) == f.sha256:
            result.kept.append(f.name)
        else:
            todo.append(f)
            doomed.append(f.name)
    manifest_ok = not todo and not stale and _same_manifest(target, staged_manifest)
    result.bytes_total = sum(f.bytes for f in plan)
    if manifest_ok and not temps:
        result.seconds = time.perf_counter() - t0
        return result

    need = sum(f.bytes for f in todo) + _json_size(staged_manifest)
    freeable = sum(_size(target / n) or 0 for n in doomed + stale + temps)
    check_space(target, need, freeable, result.fstype)

    # From here on TARGET changes: first make sure nothing accepts it as complete.
    _write_marker(target, src, sorted(wanted | previous))
    if (target / MANIFEST).exists():
        (target / MANIFEST).unlink()
        fsync_dir(target)
    for name in temps + doomed + stale:
        (target / name).unlink(missing_ok=True)
    result.removed = sorted(set(doomed + stale))

    bar = _bar(progress, sum(f.bytes for f in todo) * (2 if verify else 1),
               f"staging to {target.name or target}")
    # Copy file k+1 while a second thread re-reads and checks file k. If a copy fails (or
    # Ctrl-C), the checks already queued still finish, so a re-run keeps those files.
    checks: List[Tuple[StagedFile, Future]] = []
    try:
        with ThreadPoolExecutor(1) as checker:
            for f in todo:
                tmp = copy_file(f, target, bar.update)
                checks.append((f, checker.submit(check_and_rename, f, tmp, target,
                                                 bar.update if verify else None)))
            for f, fut in checks:
                fut.result()
                result.copied.append(f.name)
                result.bytes_copied += f.bytes
    except BaseException:
        for p in target.glob("." + "*" + TMP_SUFFIX):
            p.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    fsync_dir(target)
    with disk_full(target / MANIFEST):
        write_json_atomic(target / MANIFEST, staged_manifest)
    _write_marker(target, src, sorted(wanted))
    result.wrote_manifest = True
    result.seconds = time.perf_counter() - t0
    return result


def staging_plan(src: Path, man: dict) -> List[StagedFile]:
    """Every file the dataset needs, with the flat name it gets in TARGET. The manifest is
    validated (``read_manifest``); here each file is also checked to be a regular file of
    the size the manifest says, so space is planned from real sizes and a lying manifest is
    refused before anything is copied."""
    shards = man["shards"]
    bases = [s["path"].rsplit("/", 1)[-1] for s in shards]
    reserved = {MANIFEST, LABELS, OFFSETS, PATHS_INDEX, PATHS_TEXT, STAGE_MARKER, STAGE_LOCK}
    flat = (len(set(bases)) == len(bases) and not reserved & set(bases)
            and not any(b.startswith("column-") for b in bases))
    width = max(5, len(str(len(shards) - 1)))
    files = []
    for i, (s, base) in enumerate(zip(shards, bases)):
        name = base if flat else f"shard-{i:0{width}d}.lmdb"
        where = shard_file(src, s["path"]) if isinstance(src, Path) else src.shard(s["path"])
        files.append(StagedFile(name, where, s["bytes"], s["sha256"], "shard"))
    for kind, entry, name in side_tables(man):  # offsets and columns are optional in older datasets
        files.append(StagedFile(name, src / entry["path"], entry["bytes"], entry["sha256"], kind))
    for f in files:
        size = _size(f.src) if isinstance(f.src, Path) else f.src.size
        if size is None:
            hint = "keep the parts of a merged dataset where they are, or " if f.kind == "shard" else ""
            raise FormatError(f"{f.src}, listed in {src / MANIFEST}, is missing or not a regular "
                              f"file; {hint}rebuild the dataset")
        if size != f.bytes:
            raise FormatError(f"{f.src} is {size} bytes, {src / MANIFEST} says {f.bytes}: the "
                              f"dataset is damaged; run `packer verify {src}` and rebuild it")
    return files


def _staged_manifest(src: Path, man: dict, plan: List[StagedFile]) -> dict:
    out = copy.deepcopy(man)
    names = iter(f.name for f in plan if f.kind == "shard")
    out["shards"] = [dict(s, path=next(names)) for s in man["shards"]]
    for kind, entry, name in side_tables(man):
        set_table(out, kind, dict(entry, path=name))
    out["staged"] = {"from": str(src.resolve()), "packer_version": __version__}
    return out


def _refuse_unsafe_target(src: Path, target: Path, plan: List[StagedFile]) -> None:
    if not target.exists():
        return
    if target.resolve() == src.resolve():
        raise PackerError(f"TARGET {target} is the dataset itself; stage to another folder "
                          f"(e.g. /dev/shm/{src.resolve().name})")
    for f in plan:
        there = target / f.name
        if there.exists() and isinstance(f.src, Path) and os.path.samefile(there, f.src):
            raise PackerError(f"staging to {target} would overwrite the source file {f.src}; "
                              f"pick an empty folder")
    if (target / ".packer-build.json").exists():
        raise PackerError(f"{target} holds an unfinished `packer build`; pick another folder")
    if (target / MANIFEST).exists():
        try:
            existing = read_manifest(target)
        except PackerError:
            existing = None
        if existing is not None and "staged" not in existing:
            raise PackerError(f"{target} holds a packer dataset that was not staged (a build "
                              f"output?); staging would overwrite it. Pick an empty folder")
        if existing is None and not (target / STAGE_MARKER).exists():
            raise PackerError(f"{target} holds a {MANIFEST} that is not a staged packer dataset; "
                              f"pick an empty folder")


@contextlib.contextmanager
def _vanishing(target: Path):
    """A file or TARGET itself removed under us (a concurrent unstage before we held the lock,
    or someone else) is a PackerError saying so, not a raw FileNotFoundError."""
    try:
        yield
    except (FileNotFoundError, FileExistsError) as e:  # FileExistsError: mkdir racing rmdir
        raise PackerError(f"{e.filename or target} changed while packer worked in {target} "
                          f"(another process removing it?); re-run when it is done") from None


def _refuse_foreign(target: Path, names: set) -> None:
    """Staging writes these names but no earlier staging wrote them: if TARGET has any (or
    their temp names), they are someone else's, and are never replaced."""
    foreign = sorted(n for n in names
                     if os.path.lexists(target / n) or os.path.lexists(target / f".{n}{TMP_SUFFIX}"))
    if foreign:
        raise PackerError(f"{target} holds files that staging did not write but would replace "
                          f"({', '.join(foreign[:5])}); packer never replaces or deletes files it "
                          f"did not write. Move them away or stage into an empty folder")


def _previous_names(target: Path) -> set:
    """Names a previous staging run wrote in TARGET: what its marker lists, and nothing else
    (the only files staging will ever replace or delete)."""
    marker = _read_json(target / STAGE_MARKER)
    names = set()
    if isinstance(marker, dict) and isinstance(marker.get("files"), list):
        names.update(n for n in marker["files"] if _plain_name(n))
    names.discard(STAGE_MARKER)
    names.discard(STAGE_LOCK)
    return names


def check_space(target: Path, need: int, freeable: int, fstype: str) -> None:
    usage = shutil.disk_usage(target)
    free = usage.free + freeable
    margin = space_margin(need)
    if need + margin > free:
        raise PackerError(
            f"{target} has {human_size(free)} free, the dataset needs {human_size(need)} "
            f"(+{human_size(margin)} margin); free some space or mount a bigger tmpfs: "
            f"{tmpfs_advice(need + margin)}")
    if fstype in RAM_FS:
        info = meminfo()
        if "MemAvailable" in info:
            avail = info["MemAvailable"]
            keep = ram_margin(info.get("MemTotal", 0))
            if need - freeable + keep > avail:  # files replaced in a tmpfs free their RAM
                raise PackerError(
                    f"{target} is in RAM ({fstype}) and the dataset needs {human_size(need)}, but "
                    f"only {human_size(avail)} of RAM is available (keeping {human_size(keep)} for "
                    f"everything else); staging would push the machine into swap or the OOM "
                    f"killer. Free memory, or train from the disk copy")


# -- unstage ---------------------------------------------------------------------------------

def unstage(target: os.PathLike) -> UnstageResult:
    """Remove what ``stage`` put in ``target`` (then the folder, if that leaves it empty).

    Refuses a folder that is not a staged packer dataset: a build output, or anything else,
    is never deleted by this function.
    """
    target = Path(target)
    with _vanishing(target):
        return _unstage(target)


def _unstage(target: Path) -> UnstageResult:
    if not target.is_dir():
        raise PackerError(f"{target} is not a folder; nothing to unstage")
    marker = target / STAGE_MARKER
    staged_manifest = False
    if (target / MANIFEST).exists():
        try:
            staged_manifest = "staged" in read_manifest(target)
        except PackerError:
            staged_manifest = False
        else:
            if not staged_manifest:
                raise PackerError(f"{target} holds a packer dataset that was not staged (a build "
                                  f"output?); unstage removes staged copies only")
    if not marker.exists():
        raise PackerError(f"{target} is not a staged packer dataset (no {STAGE_MARKER}, which "
                          f"lists what staging wrote); refusing to delete anything there")
    with FolderLock(target, f"packer unstage {target}"):
        names = _previous_names(target)
        removed, freed = [], 0
        # The manifest goes first, so a half-removed dataset is never taken for a whole one.
        ordered = [MANIFEST] if MANIFEST in names else []
        ordered += sorted(names - {MANIFEST})
        ordered += [f".{n}{TMP_SUFFIX}" for n in sorted(names)]
        ordered += [MANIFEST + ".tmp", STAGE_MARKER + ".tmp", STAGE_MARKER]
        for name in ordered:
            p = target / name
            if os.path.lexists(p) and not p.is_dir():
                freed += p.lstat().st_size
                remove_own(target, name)
                removed.append(name)
    removed_dir = False
    try:
        target.rmdir()
        removed_dir = True
    except OSError:
        pass
    return UnstageResult(target=target, removed=removed, bytes_freed=freed, removed_dir=removed_dir)


# -- helpers ---------------------------------------------------------------------------------

def _write_marker(target: Path, src: Path, files: List[str]) -> None:
    with disk_full(target / STAGE_MARKER):
        write_json_atomic(target / STAGE_MARKER, {
            "what": "packer staged dataset; `packer unstage` removes the files listed here",
            "from": str(src.resolve()), "files": files, "packer_version": __version__})


def _same_manifest(target: Path, staged: dict) -> bool:
    try:
        return read_manifest(target) == staged
    except PackerError:
        return False


def _read_json(path: Path):
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _json_size(obj) -> int:
    return len(json.dumps(obj, indent=1, ensure_ascii=False).encode("utf-8")) + 1


def _plain_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def _size(path: Path) -> Optional[int]:
    """The size of a regular file (following links), None for anything else or nothing."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _threads(jobs: int) -> int:
    return max(1, min(jobs, 8, os.cpu_count() or 1))


def _bar(progress: bool, total: int, desc: str):
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=not progress or total == 0, dynamic_ncols=True, leave=False)
