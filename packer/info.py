"""Looking inside a dataset: ``info``, ``verify``, ``ls``, ``cat`` (the CLI's read-only side)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from tqdm.auto import tqdm

from .errors import FormatError
from .format import TABLES, crc32, file_sha256, read_manifest, unpack_record
from ._system import human_size
from .check import BadImage, check_image
from .reader import ShardReader, read_labels, shard_entry_count


def info(root: os.PathLike) -> dict:
    """The ``info --json`` object: the manifest's facts, with shard paths as given there."""
    m = read_manifest(root)
    return {
        "path": str(Path(root)), "format_version": m["format_version"],
        "packer_version": m.get("packer_version"), "created": m.get("created"),
        "count": m["count"], "bytes": m["bytes"], "classes": m["classes"],
        "class_counts": m.get("class_counts"),
        "shards": [{"path": s["path"], "count": s["count"], "bytes": s["bytes"],
                    "sha256": s["sha256"]} for s in m["shards"]],
        "skipped": [{"path": s["path"], "reason": s["reason"]} for s in m["skipped"]],
        "options": m.get("options", {}), "source": m.get("source"), "pil": m.get("pil"),
    }


def format_info(i: dict, max_classes: int = 20) -> str:
    """A human summary of :func:`info`."""
    lines = [f"{i['path']}: {i['count']} images, {len(i['classes'])} classes, "
             f"{len(i['shards'])} shard(s), {human_size(i['bytes'])} (format {i['format_version']}, "
             f"packer {i['packer_version']}, {i['created']})"]
    opts = i.get("options") or {}
    t = opts.get("transcode")
    lines.append("build: " + ", ".join([
        f"source {i.get('source')}",
        "bytes stored unchanged" if not t else
        f"transcoded to JPEG q{t['quality']} (max side {t['max_side']}, short side {t['short_side']})",
        f"shuffled (seed {opts.get('seed')})" if opts.get("shuffle") else "source order",
    ] + ([f"part {opts['part']}"] if opts.get("part") else [])))
    lines.append("classes:")
    counts = i.get("class_counts") or [None] * len(i["classes"])
    for n, (c, k) in enumerate(zip(i["classes"], counts)):
        if n == max_classes:
            lines.append(f"  ... {len(i['classes']) - max_classes} more (see --json)")
            break
        lines.append(f"  {n:>5}  {c}  {k if k is not None else ''}")
    lines.append("shards:")
    for s in i["shards"]:
        lines.append(f"  {s['path']}  {s['count']} records  {human_size(s['bytes'])}")
    lines.append(f"skipped: {len(i['skipped'])}")
    for s in i["skipped"][:10]:
        lines.append(f"  {s['path']}: {s['reason']}")
    if len(i["skipped"]) > 10:
        lines.append(f"  ... {len(i['skipped']) - 10} more (see --json)")
    return "\n".join(lines)


@dataclass
class Report:
    checked_shards: int = 0
    checked_records: int = 0
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(root: os.PathLike, *, quick: bool = False, progress: bool = True) -> Report:
    """Check every shard's size, checksum and record count, then (unless ``quick``) every
    record: it unpacks, its image checksum matches, it decodes, and its label matches labels.i32.

    A shard whose checksum is wrong still has its records checked, so the report names the
    damaged records; a missing or wrong-sized one does not (it cannot be read safely).
    """
    root = Path(root)
    m = read_manifest(root)
    rep = Report()
    unreadable = False
    total = sum(s["bytes"] for s in m["shards"])
    with tqdm(total=total, unit="B", unit_scale=True, desc="checksums", disable=not progress) as bar:
        for s in m["shards"]:
            p = root / s["path"]
            if not p.is_file():
                rep.problems.append(f"{s['path']}: missing")
                unreadable = True
                continue
            if p.stat().st_size != s["bytes"]:
                rep.problems.append(f"{s['path']}: size {p.stat().st_size} != manifest {s['bytes']}")
                unreadable = True
                continue
            if file_sha256(p, bar.update) != s["sha256"]:
                rep.problems.append(f"{s['path']}: sha256 does not match the manifest")
            problem = _entries_problem(p, s["count"])
            if problem:
                rep.problems.append(f"{s['path']}: {problem}")
            rep.checked_shards += 1
    for kind, _ in TABLES:
        t = m.get(kind, {})
        if t and (root / t["path"]).is_file() and file_sha256(root / t["path"]) != t["sha256"]:
            rep.problems.append(f"{t['path']}: sha256 does not match the manifest")
    if sum(s["count"] for s in m["shards"]) != m["count"]:
        rep.problems.append("manifest count differs from the sum of its shards' counts")
    if quick or unreadable:
        return rep
    try:
        labels = read_labels(root, m)
    except FormatError as e:
        rep.problems.append(str(e))
        return rep
    reader = ShardReader(root, m)
    try:
        for i in tqdm(range(len(reader)), unit="rec", desc="records", disable=not progress):
            where = f"record {i} ({reader.paths[reader.locate(i)[0]].name})"
            rep.checked_records += 1
            try:
                rec = unpack_record(reader.read(i))
            except Exception as e:
                rep.problems.append(f"{where}: unreadable: {e}")
                continue
            if crc32(rec["image"]) != rec.get("crc32"):
                rep.problems.append(f"{where} {rec.get('path')}: image checksum mismatch")
            elif rec.get("label") != labels[i]:
                rep.problems.append(f"{where} {rec.get('path')}: label {rec.get('label')} != labels.i32 {labels[i]}")
            else:
                try:
                    check_image(rec["image"], max_pixels=1 << 62)
                except BadImage as e:
                    rep.problems.append(f"{where} {rec.get('path')}: does not decode: {e}")
    finally:
        reader.close()
    return rep


def _entries_problem(path: Path, count: int) -> Optional[str]:
    """None if the shard holds exactly ``count`` records, else what is wrong with it."""
    try:
        entries = shard_entry_count(path)
    except Exception as e:  # lmdb.Error: not an LMDB file, damaged header
        return f"cannot be opened as LMDB ({e})"
    if entries != count:
        return f"holds {entries} records, the manifest says {count}"
    return None


def ls(root: os.PathLike) -> Iterator[Tuple[int, int, str]]:
    """(index, label, source path) of every record, in record order."""
    reader = ShardReader(root)
    try:
        for i in range(len(reader)):
            rec = reader.record(i)
            yield i, rec["label"], rec["path"]
    finally:
        reader.close()


def cat(root: os.PathLike, index: int) -> bytes:
    """The stored image bytes of record ``index``."""
    reader = ShardReader(root)
    try:
        return reader.record(index)["image"]
    finally:
        reader.close()
