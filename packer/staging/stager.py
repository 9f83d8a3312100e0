"""Staging: copy a finished dataset to fast storage, each file checked and renamed into place
(``copy.py``), the manifest last; files outside the folder (a merge's parts) get flat names in
a rewritten manifest, so TARGET is self-contained. ``unstager.py`` undoes it."""
from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import stat
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Tuple

from tqdm.auto import tqdm

from .. import __version__
from .._util.system import fs_type, human_size, meminfo
from ..errors import FormatError, PackerError
from .._util.fsio import FolderLock, check_folder, fsync_dir, remove_own, write_json_atomic
from ..format.manifest import LABELS, MANIFEST, OFFSETS, PATHS_INDEX, PATHS_TEXT, file_sha256, read_manifest, set_table, shard_file, side_tables
from ..storage import RemoteDataset, is_url, redact
from ..storage.remote import dataset_files
from .copy import TMP_SUFFIX, StagedFile, copy_file, disk_full, tmpfs_advice
from .results import RAM_FS, StageResult
from .unstager import (STAGE_LOCK, STAGE_MARKER, manifest_or_none, previous_names, read_marker,
                       remove_folders, remove_staged, vanishing, write_marker)

__all__ = ["check_space", "local_rank_from_env", "stage", "stage_once_per_node", "staging_plan"]


def stage(src: os.PathLike, target: os.PathLike, *, progress: bool = True,
          verify: bool = True, storage_options: Optional[dict] = None) -> StageResult:
    """Copy the dataset ``src`` (a folder or a URL) into ``target`` (e.g. ``/dev/shm/NAME``;
    made with its parents if missing, ``unstage`` removes them) and verify it.

    An existing ``target`` must be empty or a staged copy: staging never writes into a folder
    holding other things. Each copy is hashed as it is copied and checked against the
    manifest; ``verify`` also hashes files already there before keeping them (``False``: a
    re-run trusts the sizes of those the staged manifest there lists with the same checksum).
    ``storage_options``: for a URL, fsspec's and packer's options. Returns a ``StageResult``
    (``message()`` says where the data is). An incomplete source, an unsafe target or too
    little space is a ``PackerError`` before anything is written; a later failure removes what
    staging wrote, while Ctrl-C keeps it for the same call to resume.
    """
    t0 = time.perf_counter()
    src, target = (RemoteDataset(src, storage_options) if is_url(src) else Path(src)), Path(target)
    man = read_manifest(src) if isinstance(src, Path) else src.read_manifest()
    plan = staging_plan(src, man)
    name = os.path.basename(str(src.resolve()).rstrip("/")) or "data"  # a folder's or a URL's
    check_folder(target, marks=(STAGE_MARKER, MANIFEST), leftovers=(STAGE_LOCK, STAGE_MARKER + ".tmp"),
                 fix=f"stage into a folder of its own, e.g. {target / name}")
    made = [p for p in [target] + list(target.absolute().parents) if not p.exists()]
    try:
        with vanishing(target):
            _refuse_unsafe_target(src, target, plan)
            target.mkdir(parents=True, exist_ok=True)
            with FolderLock(target, f"packer stage {src} into {target}"):
                return _stage_locked(src, target, man, plan, progress, verify, t0, len(made) - 1)
    except BaseException:
        if made and not (target / STAGE_MARKER).exists():  # nothing staged is left: tidy up
            remove_folders(target, len(made) - 1)
        raise


def _stage_locked(src: Path, target: Path, man: dict, plan: List["StagedFile"], progress: bool,
                  verify: bool, t0: float, parents: int) -> StageResult:
    _refuse_unsafe_target(src, target, plan)  # again, under the lock
    result = StageResult(source=src, target=target, fstype=fs_type(target),
                         swap=meminfo().get("SwapTotal", 0) > 0)
    staged_manifest = _staged_manifest(src, man, plan)
    previous = previous_names(target)
    wanted = {f.name for f in plan} | {MANIFEST}
    for name in [STAGE_MARKER + ".tmp"] + ([MANIFEST + ".tmp"] if previous else []):
        remove_own(target, name)  # a killed run's temp files (the marker says they are ours)

    _refuse_foreign(target, wanted - previous)
    # What is already there and right, what must be (re)copied, what must go.
    stale = sorted(n for n in previous - wanted if (target / n).exists())
    temps = sorted(f".{n}{TMP_SUFFIX}" for n in previous if os.path.lexists(target / f".{n}{TMP_SUFFIX}"))
    todo, doomed = _sort_out(target, plan, verify, _vouched(target), progress, result)
    result.bytes_total = sum(f.bytes for f in plan)
    if not (todo or stale or temps) and manifest_or_none(target) == staged_manifest:
        result.seconds = time.perf_counter() - t0
        return result

    body = json.dumps(staged_manifest, indent=1, ensure_ascii=False).encode("utf-8")
    need = sum(f.bytes for f in todo) + len(body) + 1
    freeable = sum(_size(target / n) or 0 for n in doomed + stale + temps)
    check_space(target, need, freeable, result.fstype)

    # From here on TARGET changes: first make sure nothing accepts it as complete.
    parents = max(parents, read_marker(target)["parents"] if previous else 0)
    write_marker(target, src, sorted(wanted | previous), parents)
    try:
        if (target / MANIFEST).exists():
            (target / MANIFEST).unlink()
            fsync_dir(target)
        for name in temps + doomed + stale:
            (target / name).unlink(missing_ok=True)
        result.removed = sorted(set(doomed + stale))
        _copy(todo, target, progress, result)
        with disk_full(target / MANIFEST):
            write_json_atomic(target / MANIFEST, staged_manifest)
        write_marker(target, src, sorted(wanted), parents)
    except Exception as e:  # not Ctrl-C: an interrupted copy is kept for the re-run
        remove_staged(target)
        if isinstance(e, PackerError):
            raise type(e)(f"{e} (what staging had written in {target} was removed)") from e
        raise
    result.wrote_manifest = True
    result.seconds = time.perf_counter() - t0
    return result


def _vouched(target: Path) -> dict:
    """{name: sha256} of the files TARGET's staged manifest lists: each was checked against that
    checksum when it was copied (the manifest is written last and removed first)."""
    man = manifest_or_none(target)
    if man is None or "staged" not in man:
        return {}
    return {e["path"]: e.get("sha256") for e in dataset_files(man)}


def _sort_out(target: Path, plan: List[StagedFile], verify: bool, vouched: dict, progress: bool,
              result: StageResult) -> Tuple[List[StagedFile], List[str]]:
    """(files to copy, names to delete first): a file already in TARGET is kept when its size
    and checksum match the manifest. Without ``verify`` the checksum is not computed where
    ``vouched`` (the staged manifest there) lists the same one: a size alone cannot tell a
    rebuilt source (its labels and offsets keep their sizes) from the one staged before."""
    sizes = {f.name: _size(target / f.name) for f in plan}
    to_hash = [f for f in plan if sizes[f.name] == f.bytes and f.sha256 is not None
               and (verify or vouched.get(f.name) != f.sha256)]
    check_bar = _bar(progress, sum(f.bytes for f in to_hash), f"checking {target.name or target}")
    try:  # hashing releases the GIL: check several files at once
        with ThreadPoolExecutor(max(1, min(len(to_hash), 8, os.cpu_count() or 1))) as pool:
            digests = dict(zip((f.name for f in to_hash),
                               pool.map(lambda f: file_sha256(target / f.name, check_bar.update), to_hash)))
    finally:
        check_bar.close()
    keep = [sizes[f.name] == f.bytes and digests.get(f.name, f.sha256) == f.sha256 for f in plan]
    result.kept += [f.name for f, k in zip(plan, keep) if k]
    todo = [f for f, k in zip(plan, keep) if not k]
    return todo, [f.name for f in todo if sizes[f.name] is not None]


def _copy(todo: List[StagedFile], target: Path, progress: bool, result: StageResult) -> None:
    """Copy ``files_at_once`` files at a time, each renamed into place once checked (so a
    re-run keeps it); on a failure the copies under way finish or fail, and temp files go."""
    bar = _bar(progress, sum(f.bytes for f in todo), f"staging to {target.name or target}")
    copier = ThreadPoolExecutor(files_at_once(todo))
    try:
        copies = [copier.submit(copy_file, f, target, bar.update) for f in todo]
        for f, fut in zip(todo, copies):
            fut.result()
            result.copied.append(f.name)
            result.bytes_copied += f.bytes
    except BaseException:
        copier.shutdown(wait=True, cancel_futures=True)
        for f in todo:  # this run's temp files only: TARGET may hold others' of that form
            with contextlib.suppress(OSError):  # never in place of the error being raised
                (target / f".{f.name}{TMP_SUFFIX}").unlink(missing_ok=True)
        raise
    finally:
        copier.shutdown()
        bar.close()
    fsync_dir(target)


def files_at_once(todo: List[StagedFile]) -> int:
    """1 for local files (one sequential read is the disk's best); from object storage, 2 to 8:
    one more than keeps ``packer_parallel`` ranged GETs busy, so the next file's parts wait in
    the shared pool (``Store.pool``) and start as soon as threads free up."""
    remote = [f.src for f in todo if not isinstance(f.src, Path)]
    if not remote:
        return 1
    t = remote[0].dataset.store.transfer
    parts = max(1, -(-max(f.bytes for f in todo) // t.part_size))
    return max(2, min(8, t.parallel // parts + 1))


def staging_plan(src: Path, man: dict) -> List[StagedFile]:
    """Every file the dataset needs, with its flat name in TARGET; each must be a regular file
    of its manifest size, so a lying manifest is refused before anything is copied."""
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
        existing = manifest_or_none(target)
        if existing is not None and "staged" not in existing:
            raise PackerError(f"{target} holds a packer dataset that was not staged (a build "
                              f"output?); staging would overwrite it. Pick an empty folder")
        if existing is None and not (target / STAGE_MARKER).exists():
            raise PackerError(f"{target} holds a {MANIFEST} that is not a staged packer dataset; "
                              f"pick an empty folder")


def _refuse_foreign(target: Path, names: set) -> None:
    """Staging writes these names but no earlier staging wrote them: if TARGET has any (or
    their temp names), they are someone else's, and are never replaced."""
    foreign = sorted(n for n in names
                     if os.path.lexists(target / n) or os.path.lexists(target / f".{n}{TMP_SUFFIX}"))
    if foreign:
        raise PackerError(f"{target} holds files that staging did not write but would replace "
                          f"({', '.join(foreign[:5])}); packer never replaces or deletes files it "
                          f"did not write. Move them away or stage into an empty folder")


def check_space(target: Path, need: int, freeable: int, fstype: str) -> None:
    """Refuse before writing: TARGET must have room for ``need`` bytes + 1 % + 1 MiB, and a RAM
    filesystem must leave 5 % of the RAM (at least 256 MiB) to everything else."""
    free = shutil.disk_usage(target).free + freeable
    margin = need // 100 + (1 << 20)
    if need + margin > free:
        raise PackerError(
            f"{target} has {human_size(free)} free, the dataset needs {human_size(need)} "
            f"(+{human_size(margin)} margin); free some space or mount a bigger tmpfs: "
            f"{tmpfs_advice(need + margin)}")
    info = meminfo() if fstype in RAM_FS else {}
    if "MemAvailable" in info:
        avail, keep = info["MemAvailable"], max(256 << 20, info.get("MemTotal", 0) // 20)
        if need - freeable + keep > avail:  # files replaced in a tmpfs free their RAM
            raise PackerError(
                f"{target} is in RAM ({fstype}) and the dataset needs {human_size(need)}, but "
                f"only {human_size(avail)} of RAM is available (keeping {human_size(keep)} for "
                f"everything else); staging would push the machine into swap or the OOM "
                f"killer. Free memory, or train from the disk copy")


def _size(path: Path) -> Optional[int]:
    """The size of a regular file (following links), None for anything else or nothing."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _bar(progress: bool, total: int, desc: str):
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=not progress or total == 0, dynamic_ncols=True, leave=False)


def local_rank_from_env() -> Optional[int]:
    """This process's rank within its node, from torchrun, SLURM or Open MPI variables."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        value = os.environ.get(var)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise PackerError(f"{var}={value!r} is not an integer") from None
    return None


def stage_once_per_node(src: os.PathLike, target: os.PathLike, *, local_rank: Optional[int] = None,
                        timeout: float = 4 * 3600, **kwargs) -> StageResult:
    """Stage once per node under ``torch.distributed``: local rank 0 copies, the others wait.

    Call it on every rank (a collective once torch.distributed is initialised) with a
    node-local ``target`` such as ``/dev/shm/train``, then ``PackedDataset(res.target)``. The
    wait is an all-reduce over a gloo group with ``timeout`` seconds (4 h: a big copy outlasts
    the default); it carries failure, so every rank raises instead of hanging. Without
    torch.distributed (or with one process) it simply stages. ``local_rank`` defaults to
    ``local_rank_from_env()``; other keyword arguments go to ``stage``; non-zero local ranks
    get ``waited=True``.
    """
    try:
        import torch
        import torch.distributed as dist
        active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:  # pragma: no cover - torch is a dependency
        active = False
    if not active:
        return stage(src, target, **kwargs)
    local_rank = local_rank_from_env() if local_rank is None else local_rank
    if local_rank is None:
        raise PackerError("stage_once_per_node needs this process's rank within its node: "
                          "launch with torchrun (sets LOCAL_RANK) or pass local_rank=")
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    try:
        result, error = None, None
        if local_rank == 0:
            try:
                result = stage(src, target, **kwargs)
            except Exception as e:  # reported to every rank below, re-raised here
                error = e
        flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    finally:
        dist.destroy_process_group(group)
    if error is not None:
        raise error
    if int(flag.item()) == 0:
        raise PackerError(f"staging {src} to {target} failed on local rank 0 of this or another "
                          f"node (see that rank's error); fix it and restart the job")
    if result is not None:
        return result
    files = dataset_files(read_manifest(target))  # cheap: local rank 0 just verified every byte
    return StageResult(source=redact(src) if is_url(src) else Path(src),  # never credentials
                       target=Path(target), waited=True, fstype=fs_type(target),
                       swap=meminfo().get("SwapTotal", 0) > 0, kept=[f["path"] for f in files],
                       bytes_total=sum(int(f.get("bytes", 0)) for f in files))
