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

The report (table, verdict, JSON, plot) and the run are here; the phases are in
``packer.benchphases`` (reads, decode, loader) and ``packer.trainbench`` (training step),
dropping the page cache and naming the storage in ``packer.coldread``.
"""
from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from . import __version__
from .benchphases import FolderDataset, Source, has_module, n_workers
from .build import default_workers
from .coldread import storage
from .dataset import PackedDataset
from .errors import PackerError
from .imaging import pil_summary
from .trainbench import GPU_DECODE, TrainRunner, make_model

PLOT_HINT = "--plot needs matplotlib: pip install 'packer[plot]'"


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
        from . import gpu_decode  # noqa: F401  - before CUDA starts: its hardware-queue setting
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
    sources = [Source("packed", Path(dst), len(packed))]
    report = BenchReport(config={"dst": str(dst), "folder": str(folder) if folder else None,
                                 "staged": str(staged) if staged else None, "workers": workers,
                                 "batch_size": batch_size, "size": size, "cuda": cuda,
                                 "model": model if cuda else None, "repeats": repeats,
                                 "seconds_per_variant": seconds_per_variant,
                                 "max_images": max_images, "cold_cache": cold_cache, "seed": seed})
    if folder is not None:
        fds = FolderDataset(folder, decode=None)
        sources.append(Source("folder", Path(folder), len(fds), folder=fds))
    if staged is not None:
        _stage(dst, Path(staged), report, progress)
        sources.append(Source("staged", Path(staged), len(PackedDataset(staged))))
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
    bench = TrainRunner(report, bar, seconds_per_variant, max_images, cold_cache)
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
        text = (f"The best loader ({top['source']}, {n_workers(top['workers'])}) delivers "
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
                    out.append(f"The {src} loader still speeds up at {n_workers(b['workers'])}: "
                               f"try --workers up to {cores}.")
                elif b is not by_w[-1]:
                    out.append(f"More than {n_workers(b['workers'])} did not help the {src} loader "
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
                                   if has_module("packer.gpu_decode") else " (nvJPEG)."))
        else:
            text += (": the GPU starves though the cores could decode fast enough: use the best "
                     "feeding variant and more workers.")
        out.append(text)
    if env.get("busy"):
        out.append(f"Caution: {env['busy']}.")
    return " ".join(out) if out else "Not enough measurements for a verdict."

