"""Annotation rows handed to a build's workers after they started.

Workers forked before the annotations were read (``sources.cocooutline``) cannot inherit
the rows; the main process writes them, once read, to one file in the build's own folder
(``ROWS_NAME``: msgpack per entry behind a table of offsets) and sets an event. A worker
checks images meanwhile and takes its entries' rows from the file (mapped, read-only) when
it needs them. The file lives only as long as the build: it is removed when the build ends,
and with the build's other leftovers after a crash.
"""
from __future__ import annotations

import mmap
from array import array
from pathlib import Path
from typing import Any, Dict, List, Optional

import msgpack

from .._util.fsio import open_new

ROWS_NAME = ".packer-rows"
WAIT_STEP = 0.05  # seconds between looks at the stop event while waiting for the rows


def write_rows(path: Path, rows: List[Dict[str, Any]]) -> None:
    """Rows of plain data (msgpack, no ext types) as one file: entry count, offsets, rows."""
    blobs = [msgpack.packb(r) for r in rows]
    offsets = array("Q", [0])
    for b in blobs:
        offsets.append(offsets[-1] + len(b))
    with open_new(path) as f:
        f.write(array("Q", [len(blobs)]).tobytes())
        f.write(offsets.tobytes())
        f.write(b"".join(blobs))


class LateRows:
    """``rows[i]`` in a worker, once the main process has written them (``ready``)."""

    def __init__(self, path: Path, written, stop):
        self.path, self.written, self.stop = path, written, stop  # events, made before the fork
        self.data: Optional[memoryview] = None
        self.offsets: Optional[memoryview] = None

    def ready(self, wait: bool) -> bool:
        """Whether the rows can be read; with ``wait``, waits for them unless the build
        stops first (then False)."""
        if self.data is not None:
            return True
        while not self.written.is_set():
            if not wait or self.stop.is_set():
                return False
            self.written.wait(WAIT_STEP)
        with open(self.path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = array("Q", m[:8])[0]
        self.offsets = memoryview(m)[8:8 * (count + 2)].cast("Q")
        self.data = memoryview(m)[8 * (count + 2):]
        return True

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return msgpack.unpackb(self.data[self.offsets[i]:self.offsets[i + 1]])
