"""What ``scripts/bench_build.py`` measures: build throughput against the cost of decoding
every image once on all cores, in the same run on the same files.

Goal (issue 2): build images/s >= 0.8 x cores x one core's full-decode rate. ``bench_build``
times one core decoding a sample of the files and ``build`` with and without transcoding,
interleaved repeat after repeat; ``build_table`` prints the result as a markdown table.
"""
from __future__ import annotations

import io
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from PIL import Image

from .._system import pil_summary
from ..builder import build
from ..check import Transcode
from ..demo import make_image_folder
from ..source import scan_folder

__all__ = ["DECODE", "GOAL", "bench_build", "build_table", "build_variants", "decode_rate"]

DECODE = "decode 1 core"
GOAL = 0.8  # build images/s >= GOAL x workers x one core's decode rate


def build_variants() -> List[Tuple[str, Optional[Transcode]]]:
    """The builds timed: bytes kept as they are, and re-encoded at 256 px short side."""
    return [("build (bytes unchanged)", None),
            ("build --short-side 256 --quality 90", Transcode(short_side=256, quality=90))]


def decode_rate(blobs: Sequence[bytes]) -> float:
    """Images/s decoding ``blobs`` to full-size RGB, one after the other, on this core."""
    t = time.perf_counter()
    for b in blobs:
        Image.open(io.BytesIO(b)).convert("RGB")
    return len(blobs) / (time.perf_counter() - t)


def bench_build(src: Optional[os.PathLike] = None, *, workers: int, images: int = 2000,
                repeats: int = 3, decode_sample: int = 400, progress: bool = True,
                log: Callable[[str], None] = print) -> dict:
    """Time ``decode_rate`` on about ``decode_sample`` of the files of ``src`` and each of
    ``build_variants`` with ``workers``, ``repeats`` times, interleaved (drift on a shared
    machine hits every variant alike). Without ``src`` it makes ``images`` photo JPEGs in
    a temporary folder first; builds go to a temporary folder, removed at the end.

    Returns ``images``, ``bytes`` (of the source files), ``workers``, ``repeats``, ``pil``
    and ``rows``: variant name -> images/s of each repeat (``DECODE`` first).
    """
    with tempfile.TemporaryDirectory(prefix="packer-bench-build-") as tmp:
        tmp = Path(tmp)
        if src is None:
            src = make_image_folder(tmp / "src", images=images, classes=10,
                                    workers=max(1, workers), progress=progress)
        entries = scan_folder(src).entries
        if not entries:
            raise ValueError(f"{src} holds no images")
        total = sum(os.path.getsize(Path(src, rel)) for rel, _ in entries)
        step = max(1, len(entries) // max(1, decode_sample))
        sample = [Path(src, rel).read_bytes() for rel, _ in entries[::step]]
        result = {"images": len(entries), "bytes": total, "workers": workers,
                  "repeats": repeats, "pil": pil_summary()}
        log(f"{len(entries)} images, {total / len(entries) / 1e3:.0f} KB mean, "
            f"PIL: {result['pil']}, {workers} workers")
        rows: Dict[str, List[float]] = {DECODE: []}
        rows.update((name, []) for name, _ in build_variants())
        for r in range(repeats):
            rows[DECODE].append(decode_rate(sample))
            for v, (name, transcode) in enumerate(build_variants()):
                dst = tmp / f"dst-{r}-{v}"
                res = build(src, dst, workers=workers, transcode=transcode, progress=False)
                rows[name].append(len(entries) / res.seconds)
                shutil.rmtree(dst)
    result["rows"] = rows
    return result


def build_table(result: dict) -> str:
    """``bench_build``'s result: a markdown table (median, spread, MB/s read, ratio to
    cores x one core's decode rate) and the goal line."""
    rows, n = result["rows"], result["images"]
    cores = max(1, result["workers"])  # workers=0 builds in this process: one core
    one = statistics.median(rows[DECODE])
    lines = [f"| variant | images/s (median of {result['repeats']}) | spread | MB/s in | "
             f"vs cores x 1-core decode |", "|---|---|---|---|---|"]
    for name, vals in rows.items():
        med = statistics.median(vals)
        mbps = med * result["bytes"] / n / 1e6
        lines.append(f"| {name} | {med:.0f} | {min(vals):.0f}-{max(vals):.0f} | {mbps:.1f} | "
                     f"{med / (cores * one):.2f} |")
    lines.append(f"\ngoal: build >= {GOAL} x {cores} x {one:.0f} = {GOAL * cores * one:.0f} images/s")
    return "\n".join(lines)
