"""The side tables (labels, offsets, scalar columns, paths), each read whole into one compact
``array``, and only from a regular file of exactly the size the manifest lists."""
from __future__ import annotations

import os
import stat
from array import array
from itertools import islice
from pathlib import Path
from typing import Optional

from ..errors import FormatError
from .fields import DTYPES, little_endian
from .manifest import read_manifest

READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def read_labels(root: os.PathLike, manifest: Optional[dict] = None) -> array:
    """All labels in record order as one int32 array; empty for a dataset without class labels."""
    manifest = manifest if manifest is not None else read_manifest(root)
    if manifest.get("labels") is None:
        return array("i")
    return _read_table(Path(root), manifest["labels"], "labels", "i", manifest["count"])


def read_offsets(root: os.PathLike, manifest: Optional[dict] = None) -> Optional[array]:
    """Every record's (offset in its shard, length), flattened; None if the dataset has none."""
    manifest = manifest if manifest is not None else read_manifest(root)
    if manifest.get("offsets") is None:
        return None
    return _read_table(Path(root), manifest["offsets"], "offsets", "Q", manifest["count"], 2)


class PathTable:
    """Every record's source path from ``paths.u64`` + ``paths.utf8``: two buffers, not one
    Python string per record, so each DataLoader worker's copy stays small."""

    def __init__(self, ends: array, text: bytes):
        self.ends, self.text = ends, text

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index: int) -> str:
        start = self.ends[index - 1] if index > 0 else 0
        end = self.ends[index]
        if not start <= end <= len(self.text):
            raise FormatError(f"paths.u64 is damaged at record {index} (run `packer verify`)")
        return self.text[start:end].decode("utf-8", "replace")


def read_paths(root: os.PathLike, manifest: Optional[dict] = None) -> Optional[PathTable]:
    """The dataset's paths table, or None for datasets built before it (format < 1.2)."""
    manifest = manifest if manifest is not None else read_manifest(root)
    paths = manifest.get("paths")
    if not paths:
        return None
    ends = _read_table(Path(root), paths["index"], "paths", "Q", manifest["count"])
    text = _read_table(Path(root), paths["text"], "bytes of path text", "B", paths["text"]["bytes"])
    raw = text.tobytes()
    if (ends[-1] if len(ends) else 0) != len(raw) or any(
            a > b for a, b in zip(ends, islice(ends, 1, None))):
        raise FormatError(f"{Path(root) / paths['index']['path']} does not index "
                          f"{paths['text']['path']} (ends out of order or past its end); the "
                          f"dataset is damaged")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{Path(root) / paths['text']['path']} is not UTF-8; the dataset is "
                          f"damaged") from None
    return PathTable(ends, raw)


def read_column(root: os.PathLike, name: str, manifest: Optional[dict] = None) -> array:
    """A scalar field's side table (``label``, ``width``, ``height``, or any int, float or
    bool field) as one ``array.array`` in record order, read without touching a record."""
    manifest = manifest if manifest is not None else read_manifest(root)
    if name == "label" and manifest.get("labels") is not None:
        return read_labels(root, manifest)
    entry = (manifest.get("columns") or {}).get(name)
    if entry is None:
        have = sorted(manifest.get("columns") or {}) + (["label"] if manifest.get("labels") else [])
        raise KeyError(f"{root} has no column {name!r} (columns: {', '.join(have) or 'none'}; "
                       f"str, array and data fields have none: read them from the records)")
    return _read_table(Path(root), entry, f"column {name}", DTYPES[entry["dtype"]],
                       manifest["count"])


def _read_table(root: Path, entry: dict, name: str, typecode: str, count: int,
                per: int = 1) -> array:
    """A table of ``count`` x ``per`` values, read only from a regular file of exactly that size."""
    path = root / entry["path"]
    table = array(typecode)
    want = table.itemsize * count * per
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        f = open(os.open(path, READ_FLAGS | getattr(os, "O_NONBLOCK", 0)), "rb")
    except OSError as e:
        raise FormatError(f"{path}: cannot read {name} ({e.strerror}); re-stage or rebuild") \
            from None
    with f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != want:
            rec = table.itemsize * per  # bytes per record
            held = st.st_size // rec if stat.S_ISREG(st.st_mode) else "no"
            raise FormatError(f"{path} holds {held} {name} for {count} records; the "
                              f"dataset is damaged")
        table.frombytes(f.read(want))
    if len(table) * table.itemsize != want:
        raise FormatError(f"{path} changed while it was read; the dataset is damaged")
    return little_endian(table)
