"""One pass of the writer over checked samples (``packer build``'s or ``packer.write``'s):
shards, skip lists, side tables, journal, and last the manifest."""
from __future__ import annotations

import datetime
import uuid
from array import array
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

from .. import __version__
from . import journal
from .._util.fsio import write_json_atomic
from .._util.system import pil_summary
from ..errors import PackerError
from ..format.fields import DTYPES, field_of
from ..format.manifest import (FORMAT_NAME, FORMAT_VERSION, LABELS, MANIFEST, OFFSETS,
                               PATHS_INDEX, PATHS_TEXT, SHARD_PATTERN, SIZE_COLUMNS, column_file)
from ..format.records import pack_fields, record_bytes, unpack_record
from ..format.lmdbfile import shard_records
from .._util.text import printable
from .shard import ShardWriter, disk_errors, write_table

MAX_DROPPED = 100_000  # object-level drops listed in a manifest (the count is always exact)


class Packing:
    """Appends checked samples to shards in ``dst``; ``finish`` writes tables and manifest."""

    def __init__(self, dst: Path, fingerprint: str, state: dict, *, schema: dict,
                 shard_size: int, strict: bool):
        self.dst, self.fingerprint, self.schema = dst, fingerprint, schema
        self.fields = [field_of(f) for f in schema["fields"]]
        self.shard_size, self.strict = shard_size, strict
        self.shards: List[dict] = state["shards"]
        self.skipped: List[dict] = state["skipped"]
        self.dropped: List[dict] = state.get("dropped", [])
        self.start = state["next_entry"]
        self.journaled = (len(self.skipped), len(self.dropped))  # those in the journal
        self.has_label = any(f.name == "label" for f in self.fields)
        self.labels = array("i")
        self.path_ends, self.path_text = array("Q"), bytearray()  # the paths table
        self.columns: Dict[str, array] = {n: array("i") for n in SIZE_COLUMNS}
        self.columns.update((f.name, array(DTYPES[f.column])) for f in self.fields
                            if f.column and f.name != "label")
        self.column_names = [n for n in self.columns if n not in SIZE_COLUMNS]
        self.column_names += ["label"] if self.has_label else []
        self.writer: Optional[ShardWriter] = None
        self.shard_note = None  # () -> dict: more facts for a finished shard's journal entry
        self._recover()

    def skip(self, entry: int, path: str, reason: str) -> None:
        if self.strict:
            raise PackerError(f"strict: {printable(path)}: {reason}; no dataset was written "
                              f"(fix or remove the file, then re-run)")
        self.skipped.append({"path": printable(path), "reason": reason, "entry": entry})

    def drop(self, entry: int, path: str, reasons: List[str]) -> None:
        """Objects of a kept image left out (a box outside the image...), with the reasons."""
        if reasons and self.strict:
            raise PackerError(f"strict: {printable(path)}: {reasons[0]}; no dataset was written "
                              f"(fix the annotation, then re-run)")
        self.dropped.extend({"path": printable(path), "reason": r, "entry": entry} for r in reasons)

    def add(self, entry: int, path: str, image: bytes, width: int, height: int, fmt: str,
            mode: str, stored: Dict[str, Any]) -> None:
        """Store one checked image with its ``stored`` field values (``fields.encode``)."""
        if self.writer is None:
            self.writer = ShardWriter(self.dst / SHARD_PATTERN.format(len(self.shards)),
                                      expected_bytes=self.shard_size)
        self.writer.append(record_bytes(image, path=path, width=width, height=height,
                                        format=fmt, mode=mode, fields=pack_fields(stored)))
        self.add_row(stored, path, width, height)
        if self.writer.bytes >= self.shard_size:
            self.end_shard(entry + 1)

    def add_row(self, stored: Dict[str, Any], path: str, width: int, height: int) -> None:
        self.path_text += path.encode("utf-8")
        self.path_ends.append(len(self.path_text))
        if self.has_label:
            self.labels.append(stored["label"])
        values = dict(stored, width=width, height=height)
        for name, col in self.columns.items():
            col.append(values[name])

    def add_shard(self, shard: Optional[dict], next_entry: int) -> None:
        """Journal a worker's shard (None: all skipped), in plan order, after its ``add_row``s."""
        if shard is not None:
            self.shards.append(shard)
        if self.shards:
            self.shards[-1]["next_entry"] = next_entry
        skipped, dropped = self.journaled
        journal.append(self.dst, shard, self.skipped[skipped:], self.dropped[dropped:], next_entry)
        self.journaled = (len(self.skipped), len(self.dropped))

    def end_shard(self, next_entry: int) -> None:
        """Finish the open shard (if any) and record it in the journal."""
        if self.writer is not None:
            shard, self.writer = self.writer.finish(), None
            if self.shard_note is not None:
                shard.update(self.shard_note())
            self.add_shard(shard, next_entry)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None

    def _recover(self) -> None:
        """Side tables of the finished shards of an interrupted run, from their records."""
        for s in self.shards:  # checked against the journal's hashes by journal.load
            table = shard_records(self.dst / s["path"])
            with open(self.dst / s["path"], "rb") as f:
                for k in range(0, len(table), 2):
                    f.seek(table[k])
                    rec = unpack_record(f.read(table[k + 1]))
                    self.add_row(rec, rec["path"], rec["width"], rec["height"])

    def finish(self, *, classes: List[str], source: str, options: dict,
               extra: Optional[dict] = None, fingerprint: Optional[str] = None) -> dict:
        """Side tables, then the manifest (last: it completes the dataset); leftovers removed."""
        rows = len(self.path_ends)
        if not rows:
            if self.skipped:
                first = self.skipped[0]
                raise PackerError(f"all {len(self.skipped)} images were skipped (e.g. "
                                  f"{first['path']}: {first['reason']}); no dataset was written")
            raise PackerError("no samples to pack; no dataset was written")
        assert sum(s["count"] for s in self.shards) == rows
        bad = next((x for x in self.labels if not 0 <= x < len(classes)), None)  # none unlabelled
        if bad is not None:
            raise PackerError(f"label {bad} is outside the {len(classes)} classes "
                              f"(0..{len(classes) - 1}); no dataset was written")
        offsets = array("Q")
        for s in self.shards:  # every record's byte range, read once: readers never walk LMDB
            offsets.extend(shard_records(self.dst / s["path"]))
        names = [OFFSETS, PATHS_INDEX, PATHS_TEXT] + ([LABELS] if self.has_label else [])
        journal.claim_more(self.dst, names + [column_file(n, column_dtype(c))  # before they exist
                                              for n, c in self.columns.items()])
        tables = write_tables(self.dst, len(classes), offsets,
                              self.labels if self.has_label else None,
                              (self.path_ends, self.path_text), self.columns)
        manifest = new_manifest(
            classes=classes, shards=[{k: s[k] for k in ("path", "count", "bytes", "sha256")}
                                     for s in self.shards],
            skipped=[{"path": s["path"], "reason": s["reason"]} for s in self.skipped],
            source=source, options=options, schema=self.schema, dropped=self.dropped,
            extra=extra, **tables)
        manifest["fingerprint"] = fingerprint or self.fingerprint  # a re-run knows its own dataset
        with disk_errors(self.dst / MANIFEST):
            write_json_atomic(self.dst / MANIFEST, manifest)
        journal.remove_leftovers(self.dst, manifest)
        return manifest


def write_tables(dst: Path, n_classes: int, offsets: array, labels: Optional[array],
                 paths: Optional[tuple], columns: Dict[str, array]) -> Dict[str, Any]:
    """Write side tables (``paths``: (ends, text) or None); the ``new_manifest`` arguments."""
    out: Dict[str, Any] = {"offsets": write_table(dst, OFFSETS, offsets)}
    if labels is not None:
        out["labels"] = write_table(dst, LABELS, labels)
        counts = Counter(labels)
        out["class_counts"] = [counts[c] for c in range(n_classes)]
    if paths is not None:
        out["paths"] = {"index": write_table(dst, PATHS_INDEX, paths[0]),
                        "text": write_table(dst, PATHS_TEXT, paths[1])}
    listed = {}
    for name, col in columns.items():
        dtype = column_dtype(col)
        listed[name] = dict(write_table(dst, column_file(name, dtype), col), dtype=dtype)
    out["columns"] = listed or None
    return out


def column_dtype(col: array) -> str:
    return next(k for k, v in DTYPES.items() if v == col.typecode)


def new_manifest(*, classes, shards, skipped, source, options, labels=None, offsets=None,
                 class_counts=None, schema=None, columns=None, paths=None, dropped=(),
                 dropped_count=None, extra=None) -> dict:
    """A manifest with every key readers expect, in a stable order."""
    man: Dict[str, Any] = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "packer_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "count": sum(s["count"] for s in shards), "bytes": sum(s["bytes"] for s in shards),
        "classes": list(classes), "class_to_idx": {c: i for i, c in enumerate(classes)},
    }
    for key, value in (("class_counts", class_counts), ("schema", schema), ("shards", shards),
                       ("labels", labels), ("offsets", offsets), ("columns", columns),
                       ("paths", paths), ("skipped", skipped)):
        if value is not None:  # the optional keys only where the dataset has them
            man[key] = value
    if dropped:
        man["dropped_count"] = len(dropped) if dropped_count is None else dropped_count
        man["dropped"] = [{"path": d["path"], "reason": d["reason"]} for d in dropped[:MAX_DROPPED]]
    man.update(extra or {})
    man.update({"source": source, "options": options, "pil": pil_summary(),
                "build_id": uuid.uuid4().hex})
    return man
