"""Build throughput against the cost of decoding every image once on all cores, on the same
files in the same run (``GOAL``); ``benchmarks/bench_build.py`` runs it on a whole folder."""
from __future__ import annotations

import io
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from PIL import Image

from .._util.system import pil_summary
from .allcores import rates_on_all_cores
from ..writing.builder import build
from ..writing.check import Transcode
from ..reading.dataset import PackedDataset
from ..sources.folder import IMG_EXTENSIONS, scan_folder

DECODE = "decode 1 core"
DECODE_LOADED = "decode 1 core, all cores busy"  # one core's rate while every worker decodes
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


def time_builds(src: os.PathLike, tmp: Path, *, workers: int, repeats: int, decode_sample: int,
                variants: Sequence[Tuple[str, Optional[Transcode]]],
                log: Callable[[str], None] = print) -> dict:
    """Time ``decode_rate`` on about ``decode_sample`` files of ``src``, then a build per variant,
    ``repeats`` times interleaved. Returns ``images``, ``bytes``, ``workers``, ``repeats``,
    ``pil`` and ``rows`` (variant name -> images/s per repeat)."""
    entries = scan_folder(src).entries
    if not entries:
        raise ValueError(f"{src} holds no images")
    total = sum(os.path.getsize(Path(src, rel)) for rel, _ in entries)
    step = max(1, len(entries) // max(1, decode_sample))
    sample = [Path(src, rel).read_bytes() for rel, _ in entries[::step]]
    rows: Dict[str, List[float]] = {k: [] for k in [DECODE, DECODE_LOADED, *dict(variants)]}
    result = {"images": len(entries), "bytes": total, "workers": workers,
              "repeats": repeats, "pil": pil_summary(), "rows": rows}
    log(f"{len(entries)} images, {total / len(entries) / 1e3:.0f} KB mean, "
        f"PIL: {result['pil']}, {workers} workers")
    for r in range(repeats):
        rows[DECODE].append(decode_rate(sample))
        rows[DECODE_LOADED].append(statistics.median(
            rates_on_all_cores(decode_rate, [sample] * max(1, workers))))
        for v, (name, transcode) in enumerate(variants):
            dst = Path(tmp) / f"dst-{r}-{v}"
            res = build(src, dst, workers=workers, transcode=transcode, progress=False)
            rows[name].append(len(entries) / res.seconds)
            shutil.rmtree(dst)
    return result


def sample_folder(root: os.PathLike, dest: os.PathLike, images: int) -> Path:
    """``images`` of dataset ``root``'s stored image files, evenly spaced, written unchanged as an
    image folder in ``dest`` (a folder per label): the build figure's input."""
    ds = PackedDataset(root)
    n = len(ds)
    labeled = ds.manifest.get("labels") is not None
    step = n / max(1, min(images, n))
    try:
        for k in range(min(images, n)):
            i = int(k * step)
            rec = ds.load(i)
            ext = os.path.splitext(str(rec.get("path", "")))[1].lower()
            folder = Path(dest, f"{ds.target(i):05d}" if labeled else "images")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i:09d}{ext if ext in IMG_EXTENSIONS else '.jpg'}").write_bytes(rec["image"])
    finally:
        ds.reader.close()
    return Path(dest)


def build_ratios(result: dict, variant: str, cores: int) -> List[float]:
    """Per repeat of ``time_builds``: ``variant``'s images/s ÷ (cores x one core's decode)."""
    rows = result["rows"]
    return [b / (max(1, cores) * d) for b, d in zip(rows[variant], rows[DECODE])]
