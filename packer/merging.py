"""``merge``: join datasets built with ``--part K/N`` into one, without copying shard data."""
from __future__ import annotations

import json
import os
from array import array
from pathlib import Path
from typing import Sequence

from .builder import new_manifest
from .errors import PackerError
from ._fsio import write_json_atomic
from .format import LABELS, MANIFEST, OFFSETS, read_manifest
from .reader import read_labels, read_offsets
from .writer import write_table


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
        raise PackerError(f"{dst} already holds a finished dataset; replace it with overwrite=True "
                          f"(--overwrite)")
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
