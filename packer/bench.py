"""``packer bench``: where the input pipeline's time goes, on this data and this machine.

Each measurement isolates one stage, so the slowest one names the bottleneck:

* raw read: record bytes off the storage (shards, the source folder, a staged copy), with a
  cold page cache when it can be dropped, in a random order as training reads;
* decode: one core decoding + cropping in memory, full size and reduced size (JPEG draft),
  and on images re-encoded as ``packer build --short-side`` would store them; times the
  cores, this is the CPU's ceiling for any loader;
* loader: ``make_loader`` over the packed data vs an ImageFolder-style dataset over the
  folder, with the same decode callable, so they differ only in where the bytes come from;
* with ``cuda``: a real training step fed by each feeding variant, against the same step on
  a batch already on the GPU.

Variants of one phase run interleaved, repeat after repeat, so drift (other tenants, clock
boost, page cache) hits them alike; each figure is the median of the repeats and the spread
is kept; warm-up (worker start, first batches, cudnn autotuning) is never timed.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from . import __version__
from .build import default_workers
from .dataset import PackedDataset
from .errors import PackerError
from .imaging import DecodeRandomResizedCrop, Transcode, check_image, pil_summary
from .reader import ShardReader
from .source import scan_folder

DECODE_SAMPLE = 200      # images held in memory for the one-core decode runs
PLOT_HINT = "--plot needs matplotlib: pip install 'packer[plot]'"
GPU_DECODE = "GPU decode (nvJPEG)"


# -- the folder baseline ---------------------------------------------------------------------

class FolderDataset(Dataset):
    """What ``torchvision.datasets.ImageFolder`` does (same scan rule, one file read per
    sample), with packer's ``decode`` hook, so the folder loader decodes exactly as the
    packed one does and only the source of the bytes differs."""

    def __init__(self, root: os.PathLike, decode: Callable[[bytes], object]):
        src = scan_folder(root)
        self.root, self.classes, self.decode = Path(root), src.classes, decode
        self.samples = [(os.path.join(root, rel), label) for rel, label in src.entries]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return self.decode(f.read()), label


class DecodeFullRandomResizedCrop(DecodeRandomResizedCrop):
    """The same crop and flip as ``DecodeRandomResizedCrop``, but decoding every pixel first
    (what torchvision's RandomResizedCrop after ``Image.open().convert("RGB")`` costs)."""

    def __call__(self, data: bytes):
        import io
        from PIL import Image
        from .imaging import _to_tensor
        im = Image.open(io.BytesIO(data)).convert("RGB")
        oh, ow = self.size
        im = im.resize((ow, oh), Image.BILINEAR, box=self.box(*im.size), reducing_gap=None)
        if self.flip():
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return _to_tensor(im)


# -- page cache ------------------------------------------------------------------------------

def drop_page_cache(paths: Sequence[os.PathLike]) -> str:
    """Evict ``paths`` from the page cache so the next read comes from the device.

    As root, ``sync; echo 3 > /proc/sys/vm/drop_caches`` (everything, all users); otherwise
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file, which works for any file one can open
    but leaves pages that another process has mapped. Returns how (for the report).
    """
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "cold (drop_caches)"
        except OSError:
            pass
    if hasattr(os, "posix_fadvise"):
        ok = False
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                ok = True
            except OSError:
                pass
            finally:
                os.close(fd)
        if ok:
            return "cold (fadvise DONTNEED)"
    return "warm cache (could not drop it)"


def storage(path: os.PathLike) -> str:
    """Filesystem type and, for block devices, sysfs's rotational flag (1 = HDD, or unknown
    to a virtual disk), e.g. ``"ext4 on vda, rotational"`` or ``"tmpfs (RAM)"``."""
    try:
        from .stage import fs_type
        fs = fs_type(path) or "?"
    except ImportError:  # pragma: no cover - stage.py not in this tree
        fs = "?"
    if fs in ("tmpfs", "ramfs"):
        return f"{fs} (RAM)"
    try:
        st = os.stat(path)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        for d in (dev, dev.parent):
            flag = d / "queue" / "rotational"
            if flag.exists():
                rot = flag.read_text().strip() == "1"
                return f"{fs} on {d.name}, {'rotational' if rot else 'non-rotational'}"
    except (OSError, ValueError):
        pass
    return fs


# -- the report ------------------------------------------------------------------------------

@dataclass
class BenchReport:
    """What ``run_bench`` measured. ``results`` holds one dict per variant: ``name``,
    ``kind`` (stage/read/decode/loader/train), ``images_per_s`` (median), ``repeats``,
    ``spread`` [min, max], ``values``, and per kind ``mb_per_s``, ``workers``, ``source``,
    ``ceiling_images_per_s``, ``data_wait_ms``, ``host_wait_ms``, ``starvation_pct``."""
    results: List[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def get(self, name: str) -> Optional[dict]:
        return next((r for r in self.results if r["name"] == name), None)

    def of(self, kind: str, source: Optional[str] = None) -> List[dict]:
        return [r for r in self.results if r["kind"] == kind
                and (source is None or r.get("source") == source)]

    # -- text --------------------------------------------------------------------------------

    def header(self) -> str:
        e, c = self.environment, self.config
        lines = [f"dataset: {e['dataset']}",
                 f"machine: {e['cores']} cores; PIL: {e['pil']}; torch {e['torch']}"
                 + (f"; GPU: {e['gpu']}" if e.get("gpu") else ""),
                 f"runs: median of {c['repeats']} interleaved repeats, {c['seconds_per_variant']:g} s "
                 f"each after warm-up; batch {c['batch_size']}, crop {c['size']}; "
                 f"page cache: {e['cache']}"]
        if any(r["kind"] == "decode" for r in self.results):
            lines.append("decode: images per CPU-second of one thread (time the scheduler gives "
                         "other processes excluded); x cores = the CPU ceiling for any loader")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def table(self) -> str:
        """A Markdown table, one row per variant."""
        cols = [("variant", lambda r: r["name"]),
                ("images/s", lambda r: f"{r['images_per_s']:,.0f}"),
                ("spread", lambda r: f"{r['spread'][0]:,.0f}-{r['spread'][1]:,.0f} (n={r['repeats']})")]
        optional = [("MB/s", "mb_per_s", "{:,.1f}"),
                    ("x cores", "ceiling_images_per_s", "{:,.0f}"),
                    ("data wait ms/step", "data_wait_ms", "{:.1f}"),
                    ("starved %", "starvation_pct", "{:.0f}")]
        for title, k, fmt in optional:
            if any(r.get(k) is not None for r in self.results):
                cols.append((title, lambda r, k=k, fmt=fmt: "" if r.get(k) is None else fmt.format(r[k])))
        if any(r.get("storage") for r in self.results):
            cols.append(("storage", lambda r: r.get("storage") or ""))
        rows = [[title for title, _ in cols], ["---"] * len(cols)]
        rows += [[fn(r) for _, fn in cols] for r in self.results]
        return "\n".join("| " + " | ".join(row) + " |" for row in rows)

    def verdict(self) -> str:
        """One paragraph: what bounds this pipeline, and what to change."""
        return _verdict(self)

    def to_json(self) -> dict:
        return {"packer": __version__, "results": self.results, "config": self.config,
                "environment": self.environment, "notes": self.notes, "verdict": self.verdict()}

    def write_json(self, path: os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def plot(self, path: os.PathLike) -> None:
        """A bar chart of images/s per variant (one panel per kind, whiskers = spread)."""
        plt = _pyplot()
        kinds = [k for k in ("stage", "read", "decode", "loader", "train") if self.of(k)]
        counts = [len(self.of(k)) for k in kinds]
        fig, axes = plt.subplots(len(kinds), 1, figsize=(9, 1.2 + 0.42 * sum(counts) + 0.5 * len(kinds)),
                                 gridspec_kw={"height_ratios": counts}, squeeze=False)
        unit = {"stage": "MB/s", "read": "records/s", "decode": "images/s (one core)",
                "loader": "images/s", "train": "images/s"}
        for ax, kind in zip(axes[:, 0], kinds):
            rows = self.of(kind)[::-1]
            key = "mb_per_s" if kind == "stage" else "images_per_s"
            vals = [r[key] for r in rows]
            lo = [r[key] - (r["spread"][0] if key == "images_per_s" else r[key]) for r in rows]
            hi = [(r["spread"][1] if key == "images_per_s" else r[key]) - r[key] for r in rows]
            bars = ax.barh([r["name"] for r in rows], vals, xerr=[lo, hi], capsize=3,
                           color=f"C{kinds.index(kind)}")
            ax.bar_label(bars, labels=[f"{v:,.0f}" for v in vals], padding=4, fontsize=8)
            ax.set_xlabel(unit[kind], fontsize=8)
            ax.tick_params(labelsize=8)
            ax.set_xlim(0, max(vals + [r["spread"][1] for r in rows if key == "images_per_s"]) * 1.18)
        axes[0, 0].set_title(f"packer bench: {self.environment.get('dataset', '')}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def check_plot() -> None:
    """Raise PackerError now (not after minutes of measuring) if matplotlib is missing."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PackerError(f"{PLOT_HINT} (then re-run scripts/install_pillow_simd.sh: matplotlib "
                          f"requires stock Pillow, which replaces Pillow-SIMD)") from None
    return plt


# -- the run ---------------------------------------------------------------------------------

@dataclass
class _Source:
    name: str       # packed / folder / staged
    root: Path
    count: int
    folder: Optional[FolderDataset] = None  # scanned once: a big tree takes seconds to walk

    @property
    def in_ram(self) -> bool:
        """RAM filesystems: their pages are the data, there is no cache to drop."""
        return storage(self.root).endswith("(RAM)")

    def files(self, order: Sequence[int]) -> List[str]:
        """The files a run over ``order`` reads (what to evict before it)."""
        if self.folder is not None:
            return [self.folder.samples[i][0] for i in order]
        return [str(p) for p in ShardReader(self.root).paths]

    def dataset(self, size: int):
        decode = DecodeRandomResizedCrop(size)
        if self.folder is not None:
            view = copy.copy(self.folder)  # shares the scanned sample list
            view.decode = decode
            return view
        return PackedDataset(self.root, decode=decode)


def run_bench(dst: os.PathLike, *, folder: Optional[os.PathLike] = None,
              staged: Optional[os.PathLike] = None, workers: Optional[Sequence[int]] = None,
              batch_size: Optional[int] = None, size: int = 224, cuda: bool = False,
              model: str = "resnet50", repeats: int = 3, seconds_per_variant: float = 3.0,
              max_images: Optional[int] = None, cold_cache: bool = True, seed: int = 0,
              device: Optional[str] = None, progress: bool = True) -> BenchReport:
    """Measure read, decode, loader (and with ``cuda`` training-step feeding) rates.

    Args:
        dst: a packed dataset (``packer build``).
        folder: its source image folder, to compare the same reads and loader against.
        staged: a staged copy of ``dst`` (``packer stage``) to compare too; if it holds none,
            ``dst`` is staged into it first (and the copy timed).
        workers: loader worker counts to sweep (default 1, cores/2, cores).
        batch_size: default 256 with ``cuda`` (a ResNet-50 step's usual size), else 64.
        size: output crop of ``DecodeRandomResizedCrop`` (the transform every loader uses).
        cuda: also time a training step of ``model`` fed by each feeding variant (plain,
            pin_memory + non_blocking, thread prefetcher, CUDAPrefetcher, thread + CUDA).
        model: a torchvision model name when torchvision is installed; otherwise the built-in
            ``resnet50`` (same shape as torchvision's) or ``tiny`` (for tests).
        repeats / seconds_per_variant: every variant runs ``repeats`` times for about this
            long after its warm-up; the median is reported with the spread.
        max_images: stop each run after this many images even if time is left.
        cold_cache: drop the page cache before each read and loader run (see
            ``drop_page_cache``); False measures whatever is cached.
        device: where the ``cuda`` phase trains (default ``cuda``; ``cpu`` runs the same
            harness on the CPU, useful only to test it).
    """
    if repeats < 1:
        raise PackerError(f"--repeats must be >= 1, got {repeats}")
    if not seconds_per_variant > 0:
        raise PackerError(f"--seconds must be > 0, got {seconds_per_variant}")
    if max_images is not None and max_images < 2:
        raise PackerError(f"--max-images must be at least 2, got {max_images}")
    train_device = None
    if cuda:
        train_device = torch.device(device or "cuda")
        if train_device.type == "cuda" and not torch.cuda.is_available():
            raise PackerError(f"--cuda needs a CUDA GPU, but torch {torch.__version__} sees none "
                              f"(a CPU-only build, or no driver); run without --cuda to measure "
                              f"reading, decoding and loading only")
        make_model(model, 10)  # an unknown model name fails now, not after the other phases
    cores = default_workers()
    workers = sorted({1, max(1, cores // 2), cores}) if workers is None else sorted(set(workers))
    if not workers or min(workers) < 0:
        raise PackerError("--workers must list worker counts >= 0, e.g. 0,1,2")
    batch_size = batch_size or (256 if cuda else 64)
    if batch_size < 1:
        raise PackerError(f"--batch-size must be >= 1, got {batch_size}")

    packed = PackedDataset(dst)
    sources = [_Source("packed", Path(dst), len(packed))]
    report = BenchReport(config={"dst": str(dst), "folder": str(folder) if folder else None,
                                 "staged": str(staged) if staged else None, "workers": workers,
                                 "batch_size": batch_size, "size": size, "cuda": cuda,
                                 "model": model if cuda else None, "repeats": repeats,
                                 "seconds_per_variant": seconds_per_variant,
                                 "max_images": max_images, "cold_cache": cold_cache, "seed": seed})
    if folder is not None:
        fds = FolderDataset(folder, decode=None)
        sources.append(_Source("folder", Path(folder), len(fds), folder=fds))
    if staged is not None:
        _stage(dst, Path(staged), report, progress)
        sources.append(_Source("staged", Path(staged), len(PackedDataset(staged))))
    for s in sources:
        if s.count < 2:
            raise PackerError(f"{s.root} holds {s.count} image(s); the bench needs at least 2")

    mean_kb = packed.manifest["bytes"] / max(1, len(packed)) / 1e3
    report.environment = {
        "dataset": f"{dst} ({len(packed):,} images, {len(packed.classes)} classes, "
                   f"{mean_kb:,.0f} KB/image stored)",
        "cores": cores, "pil": pil_summary(), "torch": torch.__version__, "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(train_device) if train_device is not None
        and train_device.type == "cuda" else None,
        "cache": "cold" if cold_cache else "warm (not dropped: --warm)", "storage": {s.name: storage(s.root) for s in sources}}

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * cores:
        report.environment["busy"] = (f"the machine was busy before the bench started (load "
                                      f"{load:.1f} on {cores} cores): CPU-bound rates are "
                                      f"understated and noisy")
        report.notes.append(report.environment["busy"])
    rng = random.Random(seed)
    orders = {s.name: _order(rng, s.count, max_images) for s in sources}
    n_runs = repeats * (len(sources) * (1 + len(workers)) + 3) + (repeats * 6 if cuda else 0)
    bar = tqdm(total=n_runs, unit="run", desc="bench", disable=not progress, dynamic_ncols=True)
    bench = _Runner(report, bar, seconds_per_variant, max_images, cold_cache)
    try:
        bench.read_phase(sources, orders, repeats)
        bench.decode_phase(packed, orders["packed"], size, cores, repeats)
        bench.loader_phase(sources, orders, workers, batch_size, size, repeats)
        if cuda:
            bench.train_phase(sources[-1] if staged is not None else sources[0], orders,
                              batch_size, size, model, train_device, repeats)
    finally:
        bar.close()
    return report


def _order(rng: random.Random, n: int, max_images: Optional[int]) -> List[int]:
    """A random order (training reads randomly), at most ``max_images`` long."""
    order = list(range(n))
    rng.shuffle(order)
    return order[:max_images] if max_images else order


def _stage(dst: os.PathLike, target: Path, report: BenchReport, progress: bool) -> None:
    """Stage ``dst`` into ``target`` unless it already holds a complete copy; time the copy."""
    try:
        from .stage import stage
    except ImportError:  # pragma: no cover - stage.py not in this tree
        if not (target / "manifest.json").is_file():
            raise PackerError(f"--staged {target} holds no dataset; stage it first "
                              f"(packer stage {dst} {target})") from None
        return
    res = stage(dst, target, progress=progress, verify=False)
    if res.bytes_copied:
        sec = max(res.seconds, 1e-9)
        rate = len(PackedDataset(target)) / sec
        report.results.append({"name": f"stage copy to {target}", "kind": "stage", "source": "staged",
                               "images_per_s": rate, "mb_per_s": res.bytes_copied / 1e6 / sec,
                               "repeats": 1, "spread": [rate, rate], "values": [rate],
                               "seconds": res.seconds, "storage": storage(target)})
    else:
        report.notes.append(f"{target} already held a complete staged copy (not re-copied)")


class _Runner:
    """The phases; each appends its results to the report."""

    def __init__(self, report: BenchReport, bar, seconds: float, max_images: Optional[int],
                 cold_cache: bool):
        self.report, self.bar, self.seconds, self.max_images = report, bar, seconds, max_images
        self.cold_cache = cold_cache

    def _begin(self, name: str) -> None:
        self.bar.set_postfix_str(name)

    def _tick(self) -> None:
        self.bar.update(1)

    def _evict(self, source: _Source, order: Sequence[int]) -> Optional[str]:
        if not self.cold_cache:
            return None
        if source.in_ram:
            return "RAM filesystem: always in memory"
        how = drop_page_cache(source.files(order))
        self.report.environment["cache"] = how
        return how

    def _add(self, name: str, kind: str, runs: List[dict], **extra) -> dict:
        vals = [r["images_per_s"] for r in runs if r.get("images_per_s")]
        if not vals:
            self.report.notes.append(f"{name}: no complete measurement (too few images for "
                                     f"a batch after warm-up?)")
            return {}
        res = {"name": name, "kind": kind, "images_per_s": statistics.median(vals),
               "repeats": len(vals), "spread": [min(vals), max(vals)], "values": vals}
        for k in ("mb_per_s", "data_wait_ms", "host_wait_ms", "wall_images_per_s"):
            got = [r[k] for r in runs if r.get(k) is not None]
            if got:
                res[k] = statistics.median(got)
        res.update(extra)
        self.report.results.append(res)
        return res

    # -- raw read ----------------------------------------------------------------------------

    def read_phase(self, sources: List[_Source], orders: Dict[str, List[int]], repeats: int) -> None:
        runs: Dict[str, List[dict]] = {s.name: [] for s in sources}
        cache: Dict[str, Optional[str]] = {}
        if not self.cold_cache:  # warm means warm: one untimed pass fills the page cache
            for s in sources:
                self._begin(f"read {s.name} (warm-up)")
                self._read(s, orders[s.name])
        for _ in range(repeats):
            for s in sources:
                self._begin(f"read {s.name}")
                cache[s.name] = self._evict(s, orders[s.name])
                runs[s.name].append(self._read(s, orders[s.name]))
                self._tick()
        for s in sources:
            how = cache[s.name] or "warm"
            label = "tmpfs" if how.startswith("RAM") else how.split(" (")[0]
            self._add(f"read {s.name} ({label})", "read", runs[s.name], source=s.name,
                      cache=how, storage=storage(s.root))

    def _read(self, s: _Source, order: List[int]) -> dict:
        """Records (or files) per second and MB/s, reading whole values in ``order``."""
        if s.name == "folder":
            paths = [p for p in s.files(order)]

            def read(k):
                with open(paths[k], "rb") as f:
                    return len(f.read())
            close = None
        else:
            reader = ShardReader(s.root)

            def read(k):
                return len(reader.read(order[k]))
            close = reader.close
        try:
            read(0)  # warm-up: opens the environment / directory, first seek
            n = nbytes = 0
            t0 = time.perf_counter()
            for k in range(1, len(order)):
                nbytes += read(k)
                n += 1
                if n % 8 == 0 and time.perf_counter() - t0 >= self.seconds:
                    break
            el = time.perf_counter() - t0
        finally:
            if close is not None:
                close()
        return {"images_per_s": n / el, "mb_per_s": nbytes / el / 1e6}

    # -- decode ------------------------------------------------------------------------------

    def decode_phase(self, packed: PackedDataset, order: List[int], size: int, cores: int,
                     repeats: int) -> None:
        sample = [packed.load(i)["image"] for i in order[:DECODE_SAMPLE]]
        packed.reader.close()  # no shard stays mapped here: later runs must be able to evict it
        short = max(16, math.ceil(size * 8 / 7))  # 256 for 224: Resize(256) + crop(224)'s rule
        small = []
        for data in sample:
            try:
                small.append(check_image(data, transcode=Transcode(short_side=short)).data)
            except Exception:  # not decodable here: the dataset's verify reports it, not us
                pass
        variants = [("decode full-size + crop (1 core)", DecodeFullRandomResizedCrop(size), sample),
                    ("decode reduced-size + crop (1 core)", DecodeRandomResizedCrop(size), sample),
                    (f"decode reduced, packed --short-side {short} (1 core)",
                     DecodeRandomResizedCrop(size), small)]
        runs: Dict[str, List[dict]] = {v[0]: [] for v in variants}
        for r in range(repeats):
            for name, fn, blobs in variants:
                self._begin(name)
                random.seed(r)
                runs[name].append(self._decode(fn, blobs))
                self._tick()
        for name, _, blobs in variants:
            res = self._add(name, "decode", runs[name], cores=cores,
                            mean_kb=sum(map(len, blobs)) / max(1, len(blobs)) / 1e3)
            if res:
                res["ceiling_images_per_s"] = res["images_per_s"] * cores

    def _decode(self, fn: Callable, blobs: List[bytes]) -> dict:
        """One core's rate: decode ``blobs`` in turn (after 5 untimed) for the time allowed.

        The rate is per CPU-second of this thread (decoding is single-threaded and CPU-bound),
        so time the scheduler gives to other processes does not count: it is what one core
        of one's own does. The wall-clock rate is kept as ``wall_images_per_s``."""
        if not blobs:
            return {}
        for data in blobs[:5]:
            fn(data)
        n, t0, c0 = 0, time.perf_counter(), time.thread_time()
        limit = self.max_images or float("inf")
        while n < limit:
            fn(blobs[n % len(blobs)])
            n += 1
            if n % 8 == 0 and time.perf_counter() - t0 >= self.seconds:
                break
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        return {"images_per_s": n / max(cpu, 1e-9), "wall_images_per_s": n / wall}

    # -- loader ------------------------------------------------------------------------------

    def loader_phase(self, sources: List[_Source], orders: Dict[str, List[int]],
                     workers: List[int], batch_size: int, size: int, repeats: int) -> None:
        from .loader import make_loader
        runs: Dict[Tuple[str, int], List[dict]] = {(s.name, w): [] for w in workers for s in sources}
        for r in range(repeats):
            for w in workers:
                for s in sources:
                    self._begin(f"loader {s.name}, {_n_workers(w)}")
                    self._evict(s, orders[s.name])
                    ds = s.dataset(size)
                    loader = make_loader(ds, batch_size, sampler=orders[s.name], num_workers=w,
                                         pin_memory=False, persistent_workers=False, drop_last=True,
                                         worker_init_fn=_SeedWorker(r))
                    runs[(s.name, w)].append(self._time_loader(loader, w))
                    del loader, ds
                    self._tick()
        for w in workers:
            for s in sources:
                self._add(f"loader {s.name}, {_n_workers(w)}", "loader",
                          runs[(s.name, w)], source=s.name, workers=w, storage=storage(s.root))

    def _time_loader(self, loader, w: int) -> dict:
        """images/s in steady state: the first ``w`` batches (one per worker, which all arrive
        together after start-up) are warm-up; timing then stops on whole rounds of ``w``."""
        group = max(1, w)
        it = iter(loader)
        try:
            for _ in range(group):
                next(it)
            t0 = time.perf_counter()
            n = k = n_end = 0
            t_end = t0
            limit = self.max_images or float("inf")
            for x, _ in it:
                n += len(x)
                k += 1
                if k % group == 0:
                    t_end, n_end = time.perf_counter(), n
                    if t_end - t0 >= self.seconds or n >= limit:
                        break
        except StopIteration:
            return {}
        finally:
            del it
        if n_end == 0:  # the data ran out before one whole round: use what there is
            t_end, n_end = time.perf_counter(), n
        return {"images_per_s": n_end / (t_end - t0)} if n_end else {}

    # -- training step -----------------------------------------------------------------------

    def train_phase(self, source: _Source, orders: Dict[str, List[int]], batch_size: int,
                    size: int, model: str, device: torch.device, repeats: int) -> None:
        """A real step (bf16 autocast, channels_last, SGD) fed by each variant, against the
        same step on one batch kept on the device. See ``_train_run`` for the timing."""
        loaders = self.report.of("loader", source.name)
        w = max(loaders, key=lambda r: r["images_per_s"])["workers"] if loaders else default_workers()
        classes = len(PackedDataset(source.root).classes)
        net = make_model(model, max(1000, classes) if model != "tiny" else max(10, classes))
        net = net.to(device, memory_format=torch.channels_last)
        step = _Step(net, device)
        benchmark_before = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True  # fixed shapes: let cudnn pick its fastest kernels
        try:
            self._train_variants(source, orders, batch_size, size, model, device, repeats, w,
                                 classes, step)
        finally:
            torch.backends.cudnn.benchmark = benchmark_before

    def _train_variants(self, source, orders, batch_size, size, model, device, repeats, w,
                        classes, step) -> None:
        x_syn = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, device=device)
        x_syn = step.normalize(x_syn)
        y_syn = torch.randint(0, classes, (batch_size,), device=device)
        for _ in range(5):  # autotune and allocate once, outside every timed run
            step(x_syn, y_syn)
        _sync(device)
        names = ["synthetic (batch on device)", "plain", "pin_memory + non_blocking",
                 "thread prefetcher", "CUDAPrefetcher", "thread + CUDAPrefetcher"]
        if device.type == "cuda" and _has_module("torchvision") and _has_module("packer.gpu_decode"):
            names.append(GPU_DECODE)  # packer's nvJPEG path: workers only read bytes
            self.bar.total += repeats
        runs: Dict[str, List[dict]] = {n: [] for n in names}
        for r in range(repeats):
            for name in names:
                self._begin(f"train {name}")
                if name.startswith("synthetic"):
                    runs[name].append(self._train_run(step, _repeat((x_syn, y_syn)), 1, device))
                else:
                    self._evict(source, orders[source.name])
                    feed, closers = _feed(name, source.dataset(size), orders[source.name],
                                          batch_size, size, w, step, device, r)
                    try:
                        runs[name].append(self._train_run(step, feed, max(1, w) + 1, device))
                    finally:
                        for c in closers:
                            c()
                        del feed
                self._tick()
        syn = self._add(f"train {model}: synthetic (batch on {device.type})", "train", runs[names[0]],
                        workers=None, feed="synthetic")
        for name in names[1:]:
            res = self._add(f"train {model}: {name}, {_n_workers(w)}", "train", runs[name],
                            source=source.name, workers=w, feed=name)
            if res and syn:
                res["starvation_pct"] = max(0.0, 100 * (1 - res["images_per_s"] / syn["images_per_s"]))
        if syn:
            syn["starvation_pct"] = 0.0
        self.report.environment["data_wait_method"] = (
            "CUDA events on the training stream: end of one step's optimizer update to the "
            "start of the next forward (includes the copy and normalize when they run on the "
            "training stream); no per-step synchronize" if device.type == "cuda"
            else "host clock between steps (CPU run)")

    def _train_run(self, step: "_Step", feed, warmup: int, device: torch.device) -> dict:
        """Throughput from the wall clock between two synchronizes; data wait from marks
        recorded on the device stream around each step (events on CUDA), so the loop keeps
        its natural overlap: the host is never made to wait inside the timed steps."""
        it = iter(feed)
        try:
            for _ in range(warmup):
                step(*next(it))
            _sync(device)
            marks = _Marks(device)
            host_wait = 0.0
            n, t0 = 0, time.perf_counter()
            limit = self.max_images or float("inf")
            while time.perf_counter() - t0 < self.seconds and n < limit:
                th = time.perf_counter()
                try:
                    x, y = next(it)
                except StopIteration:
                    break
                host_wait += time.perf_counter() - th
                marks.mark()
                step(x, y)
                marks.mark()
                n += len(x)
            _sync(device)
            el = time.perf_counter() - t0
        except StopIteration:
            return {}
        steps = len(marks.marks) // 2
        if steps == 0:
            return {}
        return {"images_per_s": n / el, "data_wait_ms": marks.mean_gap_ms(),
                "host_wait_ms": 1e3 * host_wait / steps}


class _SeedWorker:
    """Per-worker, per-repeat seed for the random crops (picklable for spawn)."""

    def __init__(self, r: int):
        self.r = r

    def __call__(self, worker_id: int) -> None:
        random.seed(self.r * 1009 + worker_id)


def _repeat(batch):
    while True:
        yield batch


# -- training harness ------------------------------------------------------------------------

class _Step:
    """One training step: bf16 autocast forward, loss, backward, SGD update."""

    def __init__(self, net: nn.Module, device: torch.device):
        from .prefetch import IMAGENET_MEAN, IMAGENET_STD
        self.net, self.device = net, device
        self.opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        self.loss = nn.CrossEntropyLoss()
        mean = torch.tensor(IMAGENET_MEAN).view(1, -1, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(1, -1, 1, 1)
        self.scale, self.shift = (1 / (255 * std)).to(device), (-mean / std).to(device)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 normalized, channels_last: what CUDAPrefetcher does, done in-loop."""
        from .prefetch import normalize_uint8
        return normalize_uint8(x, self.scale, self.shift, channels_last=True)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss(self.net(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _feed(name: str, ds, order, batch_size: int, size: int, w: int, step: _Step,
          device: torch.device, r: int):
    """An iterator of (normalized images, labels) on ``device`` for one feeding variant, and
    the callables that shut it down. Loader workers are forked after CUDA is initialised, as
    in any training script; they never touch CUDA."""
    from .loader import background, make_loader
    from .prefetch import CUDAPrefetcher
    if name == GPU_DECODE:
        from .gpu_decode import GPUDecoder, make_gpu_loader
        loader = make_gpu_loader(ds, batch_size, sampler=order, num_workers=w, drop_last=True,
                                 persistent_workers=False)
        g = iter(GPUDecoder(loader, size=size, dtype=torch.float32, channels_last=True,
                            device=device, seed=r))
        return g, [g.close]
    gpu = device.type == "cuda"
    pin = gpu and name != "plain"
    loader = make_loader(ds, batch_size, sampler=order, num_workers=w, pin_memory=pin,
                         persistent_workers=False, drop_last=True, worker_init_fn=_SeedWorker(r))
    closers: List[Callable] = []
    if name in ("plain", "pin_memory + non_blocking", "thread prefetcher"):
        src = loader
        if name == "thread prefetcher":
            src = background(loader, depth=2)
            closers.append(src.close)

        def gen():
            for x, y in src:  # the copy and normalize are queued on the training stream
                yield (step.normalize(x.to(device, non_blocking=pin)), y.to(device, non_blocking=pin))
        g = gen()
        closers.insert(0, g.close)
        return g, closers
    src = loader
    if name == "thread + CUDAPrefetcher":
        src = background(loader, depth=2)  # batch hand-over from workers off the training thread
        closers.append(src.close)
    g = iter(CUDAPrefetcher(src, device=device, channels_last=True))
    closers.insert(0, g.close)
    return g, closers


class _Marks:
    """Timestamps alternating step start / step end: CUDA events on the current stream (read
    after the final synchronize), or host clock readings on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def mean_gap_ms(self) -> float:
        """Mean time from one step's end to the next step's start (0 for a single step)."""
        gaps = []
        for k in range(2, len(self.marks) - 1, 2):
            end, start = self.marks[k - 1], self.marks[k]
            gaps.append(end.elapsed_time(start) if self.cuda else 1e3 * (start - end))
        return statistics.fmean(gaps) if gaps else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(name: str, num_classes: int) -> nn.Module:
    """``torchvision.models.<name>`` when torchvision is installed; else the built-in
    ``resnet50`` (torchvision's layout: bottleneck blocks [3, 4, 6, 3], 25.6 M parameters
    with 1000 classes) or ``tiny``, so ``--cuda`` works without torchvision."""
    if name == "tiny":
        return nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
    try:
        import torchvision
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ImportError:
        pass
    except ValueError as e:
        raise PackerError(f"--model {name}: {e}") from None
    if name != "resnet50":
        raise PackerError(f"--model {name} needs torchvision (pip install torchvision, then "
                          f"re-run scripts/install_pillow_simd.sh); built in: resnet50, tiny")
    return resnet50(num_classes)


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.skip(x))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (v1.5: stride in the 3x3 conv, as torchvision), randomly initialised."""
    layers: List[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if b == 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


# -- verdict ---------------------------------------------------------------------------------

def _verdict(rep: BenchReport) -> str:
    """Rules, in order: what bounds the loader (decode ceiling vs reads vs loader overhead),
    worker count, reduced-size decoding, pack-time resize, packing and staging gains, GPU
    starvation. Each sentence quotes the numbers it rests on."""
    out: List[str] = []
    env = rep.environment
    cores = env.get("cores", 1)
    dec = rep.of("decode")
    full = next((r for r in dec if r["name"].startswith("decode full")), None)
    red = next((r for r in dec if r["name"].startswith("decode reduced-size")), None)
    small = next((r for r in dec if "--short-side" in r["name"]), None)
    ceiling = red["ceiling_images_per_s"] if red else None
    reads = {r["source"]: r for r in rep.of("read")}
    best_of = {src: max(rep.of("loader", src), key=lambda r: r["images_per_s"])
               for src in ("packed", "folder", "staged") if rep.of("loader", src)}
    top = max((best_of[s] for s in ("packed", "staged") if s in best_of),
              key=lambda r: r["images_per_s"], default=None)

    if top and ceiling:
        eff = top["images_per_s"] / ceiling
        text = (f"The best loader ({top['source']}, {_n_workers(top['workers'])}) delivers "
                f"{top['images_per_s']:,.0f} images/s, {eff:.0%} of the CPU decode ceiling ({cores} "
                f"cores x {red['images_per_s']:,.0f} images/s reduced-size decode = {ceiling:,.0f})")
        if eff >= 0.7:
            text += ": it is decode-bound; only less decoding per image or more cores raise it."
        else:
            rp = reads.get(top["source"])
            causes = (["waiting on reads"] if rp and rp["images_per_s"] < 1.5 * ceiling else []) + [
                "loader overhead (collating, handing batches to the main process, whose work "
                "shares the cores)"] + (["the other processes on this machine"] if env.get("busy") else [])
            text += "; the rest is lost to " + ", ".join(causes[:-1]) + (" and " if len(causes) > 1 else "") + causes[-1] + "."
        out.append(text)
        rp = reads.get("packed")
        if rp and rp["images_per_s"] < 1.5 * ceiling and not rp.get("cache", "").startswith("RAM"):
            text = (f"Reads from {env['storage'].get('packed', 'the shards')} ({rp['cache']}) deliver "
                    f"{rp['images_per_s']:,.0f} records/s ({rp['mb_per_s']:,.0f} MB/s), "
                    f"{'below' if rp['images_per_s'] < ceiling else 'not much above'} "
                    f"what the cores decode: when the data is not in the page cache, I/O bounds the "
                    f"loader; stage the shards to RAM (`packer stage DST /dev/shm/NAME`)")
            text += ", or pack smaller images"
            if "staged" in best_of and "packed" in best_of:
                bp, bs = best_of["packed"]["images_per_s"], best_of["staged"]["images_per_s"]
                text += (f"; staging here took the best loader from {bp:,.0f} to {bs:,.0f} images/s"
                         if bs > 1.15 * bp else
                         f"; staging moved the best loader only from {bp:,.0f} to {bs:,.0f} "
                         f"images/s in this run, so reads are not what limits it now")
            out.append(text + ".")
        for src in ("staged", "packed"):
            by_w = sorted(rep.of("loader", src), key=lambda r: r["workers"])
            if len(by_w) > 1:
                b = best_of[src]
                if b is by_w[-1] and b["workers"] < cores:
                    out.append(f"The {src} loader still speeds up at {_n_workers(b['workers'])}: "
                               f"try --workers up to {cores}.")
                elif b is not by_w[-1]:
                    out.append(f"More than {_n_workers(b['workers'])} did not help the {src} loader "
                               f"(workers compete with the main process for {cores} cores).")
                break
    if full and red and red["images_per_s"] > 1.15 * full["images_per_s"]:
        out.append(f"Reduced-size decoding (DecodeRandomResizedCrop) is "
                   f"{red['images_per_s'] / full['images_per_s']:.1f}x a full decode per core: keep it.")
    if small and red and small["images_per_s"] > 1.15 * red["images_per_s"]:
        side = small["name"].split("--short-side ")[1].split()[0]
        out.append(f"Packing with `packer build --short-side {side}` would decode "
                   f"{small['images_per_s'] / red['images_per_s']:.1f}x faster per core (ceiling "
                   f"{small['ceiling_images_per_s']:,.0f} images/s) for one re-encode at build time.")
    if "folder" in reads and "packed" in reads:
        rp, rf = reads["packed"], reads["folder"]
        text = (f"Packed vs folder: raw reads {rp['images_per_s'] / rf['images_per_s']:.2f}x "
                f"({rp['images_per_s']:,.0f} vs {rf['images_per_s']:,.0f} records/s, {rp['cache']})")
        if "packed" in best_of and "folder" in best_of:
            bp, bf = best_of["packed"], best_of["folder"]
            text += (f", best loader {bp['images_per_s'] / bf['images_per_s']:.2f}x "
                     f"({bp['images_per_s']:,.0f} vs {bf['images_per_s']:,.0f} images/s)")
        out.append(text + ".")
    if "staged" in reads and "packed" in reads:
        rs, rp = reads["staged"], reads["packed"]
        out.append(f"Staged vs packed: raw reads {rs['images_per_s'] / rp['images_per_s']:.1f}x.")
    train = rep.of("train")
    syn = next((r for r in train if r.get("feed") == "synthetic"), None)
    fed = [r for r in train if r.get("feed") != "synthetic"]
    if syn and fed:
        best = max(fed, key=lambda r: r["images_per_s"])
        text = (f"Training: the model steps at {syn['images_per_s']:,.0f} images/s on a resident batch; "
                f"the best feeding ({best['feed']}) reaches {best['images_per_s']:,.0f} "
                f"({best['starvation_pct']:.0f}% starved, {best['data_wait_ms']:.1f} ms data wait per step)")
        if best["starvation_pct"] <= 10:
            text += ": the model bounds this pipeline, not the input."
        elif ceiling and ceiling < syn["images_per_s"]:
            text += (f": the GPU starves, and even {cores} cores decoding flat out ({ceiling:,.0f} "
                     f"images/s) could not keep up; pack smaller images (--short-side) or decode on "
                     f"the GPU" + (f" (packer.gpu_decode; the '{GPU_DECODE}' row above)."
                                   if _has_module("packer.gpu_decode") else " (nvJPEG)."))
        else:
            text += (": the GPU starves though the cores could decode fast enough: use the best "
                     "feeding variant and more workers.")
        out.append(text)
    if env.get("busy"):
        out.append(f"Caution: {env['busy']}.")
    return " ".join(out) if out else "Not enough measurements for a verdict."


def _n_workers(w: int) -> str:
    return f"{w} worker" if w == 1 else f"{w} workers"


def _has_module(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
