"""Undoing ``stage``. Its marker (``.packer-stage.json``), written before staging changes
TARGET and kept, lists the only files staging may replace and ``unstage`` may delete."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import List, Optional

from .. import __version__
from .._util.fsio import LOCK_NAME, FolderLock, remove_own, write_json_atomic
from ..errors import PackerError
from ..format.manifest import MANIFEST, read_manifest
from .copy import TMP_SUFFIX, disk_full
from .results import UnstageResult

STAGE_MARKER = ".packer-stage.json"   # written first, kept: says "packer staged this folder"
STAGE_LOCK = LOCK_NAME                # flock'ed while staging or unstaging: one at a time
# All a stage killed before its marker, or an unstage killed after removing it, leaves.
KILLED_LEFTOVERS = {STAGE_LOCK, STAGE_MARKER + ".tmp"}


def unstage(target: os.PathLike) -> UnstageResult:
    """Remove what ``stage`` put in ``target``, then the folder and the parents ``stage`` made
    for it, each only if left empty. Refuses anything that is not a staged packer dataset; a
    missing ``target`` has nothing to remove (so a killed unstage's re-run succeeds)."""
    target = Path(target)
    with vanishing(target):
        if not os.path.lexists(target):
            return UnstageResult(target=target, removed=[], bytes_freed=0, removed_dir=False)
        if not target.is_dir():
            raise PackerError(f"{target} is not a folder; nothing to unstage")
        existing = manifest_or_none(target)  # missing or damaged: the marker decides
        if existing is not None and "staged" not in existing:
            raise PackerError(f"{target} holds a packer dataset that was not staged (a build "
                              f"output?); unstage removes staged copies only")
        if not (target / STAGE_MARKER).exists():
            if set(os.listdir(target)) <= KILLED_LEFTOVERS:  # a stage or unstage killed early/late
                with FolderLock(target, f"packer unstage {target}"):
                    removed = [n for n in sorted(KILLED_LEFTOVERS - {STAGE_LOCK}) if remove_own(target, n)]
                return UnstageResult(target=target, removed=removed, bytes_freed=0,
                                     removed_dir=remove_folders(target, 0))
            raise PackerError(f"{target} is not a staged packer dataset (no {STAGE_MARKER}, "
                              f"which lists what staging wrote); refusing to delete anything there")
        with FolderLock(target, f"packer unstage {target}"):
            parents = read_marker(target).get("parents", 0)
            removed, freed = remove_staged(target)
    removed_dir = remove_folders(target, parents)
    return UnstageResult(target=target, removed=removed, bytes_freed=freed, removed_dir=removed_dir)


def manifest_or_none(target: Path) -> Optional[dict]:
    """TARGET's manifest, or None when it is missing or damaged."""
    try:
        return read_manifest(target)
    except PackerError:
        return None


def remove_staged(target: Path):
    """(names removed, bytes freed): every file the marker lists, their temp files, then the
    marker. The manifest goes first, so a half-removed dataset is never taken for a whole
    one. The caller holds TARGET's lock."""
    names = previous_names(target)
    ordered = sorted(names, key=lambda n: (n != MANIFEST, n))  # the manifest first
    ordered += [f".{n}{TMP_SUFFIX}" for n in sorted(names)]
    ordered += [MANIFEST + ".tmp", STAGE_MARKER + ".tmp", STAGE_MARKER]
    removed: List[str] = []
    freed = 0
    for name in ordered:
        p = target / name
        if os.path.lexists(p) and not p.is_dir():
            freed += p.lstat().st_size
            remove_own(target, name)
            removed.append(name)
    return removed, freed


def remove_folders(target: Path, parents: int) -> bool:
    """Remove ``target`` and up to ``parents`` folders above it, while they are empty; whether
    ``target`` went."""
    for k, folder in enumerate([target] + list(target.absolute().parents)[:max(0, parents)]):
        try:
            folder.rmdir()
        except OSError:
            return k > 0
    return True


def write_marker(target: Path, src: Path, files: List[str], parents: int) -> None:
    """The list of what staging writes, before it writes it; ``parents``: the folders above
    TARGET that staging created (unstage removes them when empty)."""
    with disk_full(target / STAGE_MARKER):
        write_json_atomic(target / STAGE_MARKER, {
            "what": "packer staged dataset; `packer unstage` removes the files listed here",
            "from": str(src.resolve()), "files": files, "parents": parents,
            "packer_version": __version__})


def read_marker(target: Path) -> dict:
    try:
        marker = json.loads((target / STAGE_MARKER).read_text("utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return {}
    if not isinstance(marker, dict):
        return {}
    if not isinstance(marker.get("parents"), int) or isinstance(marker["parents"], bool):
        marker["parents"] = 0
    return marker


def previous_names(target: Path) -> set:
    """Names a previous staging run wrote in TARGET: what its marker lists, and nothing else
    (the only files staging will ever replace or delete)."""
    files = read_marker(target).get("files")
    plain = {n for n in (files if isinstance(files, list) else [])
             if isinstance(n, str) and n not in ("", ".", "..") and not set("/\\\0") & set(n)}
    return plain - {STAGE_MARKER, STAGE_LOCK}


@contextlib.contextmanager
def vanishing(target: Path):
    """A file or TARGET itself removed under us (a concurrent unstage before we held the lock,
    or someone else) is a PackerError saying so, not a raw FileNotFoundError."""
    try:
        yield
    except (FileNotFoundError, FileExistsError) as e:  # FileExistsError: mkdir racing rmdir
        raise PackerError(f"{e.filename or target} changed while packer worked in {target} "
                          f"(another process removing it?); re-run when it is done") from None
