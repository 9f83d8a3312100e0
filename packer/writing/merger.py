"""``merge``: join datasets built with ``--part K/N`` into one without copying shard data: the
manifest names the parts' shards by relative path (``../part-0/shard-00000.lmdb``) and their
folders under ``parts``. Crash safety is the build's: old manifest removed first, new one last."""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tempfile
from array import array
from pathlib import Path, PurePath
from typing import List, Optional, Sequence, Tuple

from . import journal
from .._util.fsio import FolderLock, remove_own, write_json_atomic
from ..errors import FormatError, PackerError
from ..format.manifest import (FORMAT_VERSION, MANIFEST, OFFSETS, PATHS_INDEX, PATHS_TEXT,
                               dataset_schema, read_manifest, shard_file, side_tables)
from .packing import new_manifest, write_tables
from ..format.tables import read_column, read_offsets, read_paths
from ..format.lmdbfile import shard_records
from .shard import disk_errors
from ..sources.base import parse_part
from ..storage.urls import is_url


def merge(parts: Sequence[os.PathLike], dst: os.PathLike, *, overwrite: bool = False,
          storage_options: Optional[dict] = None) -> dict:
    """Join finished part datasets into one in ``dst`` (the parts stay where they are);
    returns its manifest. Refused: a part given twice (any spelling, or sharing a shard file),
    parts with different classes, labels outside them, ``dst`` a part, and an existing
    dataset in ``dst`` unless ``overwrite``.

    Parts and ``dst`` may be URLs (``storage_options`` as for ``packer.stage``), each fetched
    part checked against its SHA-256. A ``dst`` URL must lie in the bucket of its parts, all
    URLs: it gets only the merged manifest and tables; a local ``dst`` refers to copies of the
    URL parts fetched into ``DST.parts/``."""
    if any(is_url(p) for p in [*parts, dst]):
        return _merge_urls(list(parts), dst, storage_options, overwrite)
    journal.check_dst(dst)  # before anything is written: packer writes only where asked
    dst = Path(dst)
    if not parts:
        raise PackerError("merge needs at least one part")
    mans = [(Path(p), read_manifest(p)) for p in parts]
    _refuse_duplicates(mans, dst)
    classes = mans[0][1]["classes"]
    for p, m in mans[1:]:
        differs = ("classes" if m["classes"] != classes else
                   "fields" if dataset_schema(m) != dataset_schema(mans[0][1]) else None)
        if differs:
            raise PackerError(f"{p} has different {differs} from {mans[0][0]}; parts of one "
                              f"dataset must be built from the same source")
    _refuse_strangers(mans)
    dst.mkdir(parents=True, exist_ok=True)
    with FolderLock(dst, f"packer merge into {dst}"):
        return _write(mans, dst, classes, overwrite)


def _merge_urls(parts: list, dst, storage_options: Optional[dict], overwrite: bool) -> dict:
    from ..storage.destination import Destination
    from ..storage.local import fetch_dataset, shown
    urls = {p: p.split("://", 1) for p in parts + [dst] if is_url(p)}  # (scheme, key)
    base = posixpath.commonpath([key.rstrip("/") for _, key in urls.values()])

    def under(url: str) -> str:  # where a URL's dataset goes below a local folder
        return posixpath.relpath(urls[url][1].rstrip("/"), base)

    if not is_url(dst):
        home = Path(dst).parent / f"{Path(dst).name}.parts"
        local = [fetch_dataset(p, home / under(p), storage_options) if is_url(p) else p
                 for p in parts]
        return _named(merge(local, dst, overwrite=overwrite), Path(dst), parts)
    if not base or len({s for s, _ in urls.values()}) > 1 or not all(map(is_url, parts)):
        raise PackerError(f"merging into {shown(dst)} needs every part in its bucket (the merged "
                          f"dataset refers to their shards there); merge into a local folder, "
                          f"stage it, and upload that (packer.storage.upload_dataset)")
    if under(dst) in {under(p) for p in parts}:
        raise PackerError(f"{shown(dst)} is one of the parts; merge into another prefix")
    with tempfile.TemporaryDirectory(prefix="packer-merge-") as tmp:
        dest = Destination(dst, storage_options, Path(tmp) / under(dst))
        dest.begin(overwrite)  # refused before any part is fetched
        local = [fetch_dataset(p, Path(tmp) / under(p), storage_options) for p in parts]
        manifest = _named(merge(local, dest.work), dest.work, parts)
        dest.finish(manifest)
        return manifest


def _named(manifest: dict, folder: Path, parts: list) -> dict:
    """The merged manifest naming its parts as given (URLs as shown), not as fetched."""
    from ..storage.local import shown
    manifest["options"]["merged_from"] = [shown(p) for p in parts]
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def _refuse_strangers(mans: List[Tuple[Path, dict]]) -> None:
    """Parts cut with ``--part K/N`` are slices of one shuffled order: only the parts of one
    build command (one N, each K once, the same options and listing, a source of the same name)
    hold each record once. A dataset merged before merges recorded their parts is taken as is."""
    cuts = [(p, _held(p, m), _command(m)) for p, m in mans]
    if any(held is None for _, held, _ in cuts) or not any(held for _, held, _ in cuts):
        return  # parts unknown, or whole datasets (packer.write's, for example): as given
    p0, held0, how0 = next(c for c in cuts if c[1])
    cut_from = {p: (m.get("options") or {}).get("part_of") for p, m in mans}  # listing digests
    seen: dict = {}
    for p, held, how in cuts:
        if not held:
            raise PackerError(f"{p} was not built with --part K/N but {p0} was; merge the "
                              f"parts of one build")
        if cut_from[p] and cut_from[p0] and cut_from[p] != cut_from[p0]:
            raise PackerError(f"{p} (part {_shown(held)}) was cut from another listing than "
                              f"{p0} (part {_shown(held0)}): its copy of SRC holds other "
                              f"files, labels or annotations; build every part from one copy")
        if how != how0 or {n for _, n in held} != {held0[0][1]}:
            raise PackerError(f"{p} (part {_shown(held)}) was not built like {p0} (part "
                              f"{_shown(held0)}): another source, N or option (--seed, "
                              f"--shuffle, --transcode...); its records would repeat or miss "
                              f"some of the others'")
        for k in held:
            if k in seen:
                raise PackerError(f"{p} holds part {_shown([k])}, as {seen[k]} does; merging "
                                  f"would duplicate its records")
            seen[k] = p


PATH_OPTIONS = ("list", "coco", "yolo", "names", "meta")  # compared by name: a copy may move


def _command(m: dict) -> str:
    """What a part's build command was, but where its files were and how big its shards."""
    name = lambda v: PurePath(str(v)).name if v else v  # noqa: E731
    opts = {k: name(v) if k in PATH_OPTIONS else v for k, v in (m.get("options") or {}).items()
            if k not in ("part", "part_of", "merged_from", "merged_parts", "shard_size")}
    return json.dumps([name(m.get("source")), opts], sort_keys=True, default=str)


def _held(p: Path, m: dict) -> Optional[List[Tuple[int, int]]]:
    """The ``(K, N)`` parts a dataset holds: its own ``--part``, those merged into it, none
    (a whole dataset), or None: a dataset merged before merges recorded them."""
    opts = m.get("options") or {}
    raw = ([opts["part"]] if opts.get("part") else opts.get("merged_parts")
           if "merged_parts" in opts else None if opts.get("merged_from") else [])
    if raw is None:
        return None
    try:
        return [parse_part(str(k)) for k in raw]
    except (PackerError, TypeError):
        raise FormatError(f"{p}: its manifest's parts {str(raw)[:60]} are not K/N") from None


def _shown(held: List[Tuple[int, int]]) -> str:
    return ", ".join(f"{k}/{n}" for k, n in held)


def missing_parts(manifest: dict) -> List[str]:
    """The ``K/N`` parts of its build a merged dataset does not hold (they may be merged in
    later); empty when whole or unknown."""
    held = (manifest.get("options") or {}).get("merged_parts") or []
    cuts = {parse_part(str(k)) for k in held}
    return [f"{k}/{n}" for n in sorted({n for _, n in cuts}) for k in range(n)
            if (k, n) not in cuts]


def _refuse_duplicates(mans: List[Tuple[Path, dict]], dst: Path) -> None:
    """A record may be merged once: no part twice, no shard file shared by two parts."""
    seen: dict = {}
    for p, m in mans:  # the same folder twice, or the same part built twice
        opts = m.get("options") or {}
        same = json.dumps([m.get("source"), opts], sort_keys=True) if opts.get("part") else None
        for ident in (str(p.resolve()), same):
            if ident is not None and ident in seen:
                raise PackerError(f"{p} is the same part as {seen[ident]} (given more than once); "
                                  f"merging it twice would duplicate its records")
            seen[ident] = p
    files: dict = {}
    for p, m in mans:  # two datasets sharing a file: a merged dataset and its own part
        for s in m["shards"]:
            try:
                st = os.stat(shard_file(p, s["path"]))
            except OSError:
                raise FormatError(f"{p / s['path']}, a shard of {p}, is missing") from None
            ident = (st.st_dev, st.st_ino)
            if ident in files:
                raise PackerError(f"{p} and {files[ident]} share the shard file {s['path']} "
                                  f"(the same part given twice, or a merged dataset with its own "
                                  f"part); merging would duplicate its records")
            files[ident] = p
        if dst.exists() and dst.resolve() == p.resolve():
            raise PackerError(f"DST {dst} is one of the parts; merge into a new folder")


def _write(mans: List[Tuple[Path, dict]], dst: Path, classes: List[str], overwrite: bool) -> dict:
    rels = [os.path.relpath(p.resolve(), dst.resolve()).replace(os.sep, "/") for p, _ in mans]
    fp = hashlib.sha256(json.dumps([FORMAT_VERSION, rels, [m.get("build_id") for _, m in mans]])
                        .encode()).hexdigest()  # the same parts, as built: the same merge
    if (dst / MANIFEST).exists():
        done = None if overwrite else journal.finished(dst, fp)
        if done is not None:  # this very merge finished: a re-run changes nothing
            return done
        if not overwrite:
            raise PackerError(f"{dst} already holds a finished dataset; replace it with "
                              f"overwrite=True")
        journal.remove_dataset(dst, read_manifest(dst))  # its manifest first, durably
    else:  # an interrupted overwrite's journal claims what it was removing
        mine = journal.claimed(dst)
        journal.refuse_foreign_files(dst, [n for n in journal.packer_names(dst) if n not in mine])
        for name in sorted(mine & set(journal.packer_names(dst))):
            remove_own(dst, name)
    first, held = mans[0][1], [_held(p, m) for p, m in mans]
    merged_parts = None if None in held else [f"{k}/{n}" for h in held for k, n in h]
    # Tables every part has (older parts lack the width/height columns: then none has them).
    keys = [k for k, _, _ in side_tables(first) if k != "offsets" and not k.startswith("paths.")
            and all(k in {kk for kk, _, _ in side_tables(m)} for _, m in mans)]
    with_paths = all(m.get("paths") for _, m in mans)
    names = {k: name for k, _, name in side_tables(first)}
    journal.claim(dst, [OFFSETS, PATHS_INDEX, PATHS_TEXT, MANIFEST] + [names[k] for k in keys])
    offsets, path_ends, path_text, tables = array("Q"), array("Q"), bytearray(), {}
    for p, m in mans:
        for k in keys:
            name = "label" if k == "labels" else k.split(".", 1)[1]
            part = read_column(p, name, m)
            if k == "labels" and any(not 0 <= lab < len(classes) for lab in part):
                raise FormatError(f"{p}: labels.i32 holds labels outside 0..{len(classes) - 1}; "
                                  f"the part is damaged (run `packer verify {p}`)")
            tables[name] = tables[name] + part if name in tables else part
        if with_paths:  # each part's path ends shift by the text before it
            table = read_paths(p, m)
            path_ends.extend(e + len(path_text) for e in table.ends)
            path_text += table.text
        part_offsets = read_offsets(p, m)  # per shard: they concatenate
        if part_offsets is not None:
            offsets.extend(part_offsets)
        else:  # an older part: read its shards' trees
            for s in m["shards"]:
                offsets.extend(shard_records(shard_file(p, s["path"])))
    written = write_tables(dst, len(classes), offsets, tables.pop("label", None),
                           (path_ends, path_text) if with_paths else None, tables)
    dropped = [d for _, m in mans for d in m.get("dropped", [])]
    manifest = new_manifest(
        classes=classes, shards=[dict(s, path=posixpath.normpath(posixpath.join(rel, s["path"])))
                                 for rel, (_, m) in zip(rels, mans) for s in m["shards"]],
        schema=first.get("schema"), dropped=dropped,
        extra={k: first[k] for k in ("categories", "skipped_empty") if k in first},
        dropped_count=sum(m.get("dropped_count", len(m.get("dropped", []))) for _, m in mans),
        skipped=[s for _, m in mans for s in m["skipped"]], source=first.get("source", ""),
        options=dict(first.get("options") or {}, part=None, merged_from=[str(p) for p, _ in mans],
                     merged_parts=merged_parts), **written)
    manifest["parts"], manifest["fingerprint"] = rels, fp
    with disk_errors(dst / MANIFEST):
        write_json_atomic(dst / MANIFEST, manifest)
    remove_own(dst, journal.JOURNAL)  # the overwrite's claim, if any: done
    return manifest
