"""``packer bench``: where the input pipeline's time goes, on this data and machine. Each phase
isolates one stage; variants run interleaved, each figure the median of repeats after warm-up."""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from .. import __version__
from .._util.system import PILLOW_SIMD_HINT, busy_cores, free_bytes, human_size, pil_info, pil_summary, usable_cores
from ..reading.dataset import PackedDataset
from ..demo import FolderDataset
from ..errors import PackerError
from ..staging import stage
from .coldread import storage
from .models import make_model
from .phases import BenchInput, figure_plan, n_workers
from .train import TrainRunner
from .verdict import explain

PLOT_HINT = "--plot needs matplotlib: pip install matplotlib"


@dataclass
class BenchReport:
    """What ``run_bench`` measured: ``results`` (a dict per variant: ``name``, ``kind``,
    ``images_per_s`` median, ``repeats``, ``spread``, ``values``...) and ``figures``
    (``build_ratio``, ``loader_efficiency``, ``epoch_wait_ms``; docs/cli.md)."""
    results: List[dict] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def of(self, kind: str, source: Optional[str] = None) -> List[dict]:
        return [r for r in self.results if r["kind"] == kind
                and (source is None or r.get("source") == source)]

    def header(self) -> str:
        e, c = self.environment, self.config
        lines = [f"dataset: {e['dataset']}",
                 f"machine: {e['cores']} cores; torch {e['torch']}"
                 + (f"; GPU: {e['gpu']}" if e.get("gpu") else ""),
                 f"PIL: {e.get('pil_line') or e['pil']}",
                 f"runs: median of {c['repeats']} interleaved repeats, {c['seconds_per_variant']:g} s "
                 f"each after warm-up; batch {c['batch_size']}, crop {c['size']}; "
                 f"page cache: {e['cache']}"]
        if self.of("decode"):
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

    def figures_text(self) -> str:
        """The three figures, one line each ("" when they were not measured)."""
        f = self.figures
        if not f:
            return ""
        b, e, w = f["build_ratio"], f["loader_efficiency"], f["epoch_wait_ms"]
        return "\n".join([
            f"figures (a copy of {b['images']:,} of the dataset's images in a temporary folder, "
            f"warm page cache; medians of {self.config['repeats']}):",
            f"  build rate ratio     {b['median']:.2f}  build {b['build_images_per_s']:,.0f} "
            f"images/s with {b['workers']} workers, start-up included / ({b['cores']} cores x "
            f"{b['decode_images_per_s']:,.0f} images/s one core's full decode); goal >= {b['goal']}",
            f"  loader efficiency    {e['median']:.2f}  make_loader {e['loader_images_per_s']:,.0f} "
            f"images/s / ({n_workers(e['workers'])} x {e['core_images_per_s']:,.0f} images/s one "
            f"core's ds[i] loop), batch {e['batch_size']}; {e['all_cores_busy']['median']:.2f} "
            f"against {e['core_busy_images_per_s']:,.0f} images/s, one core's rate with "
            f"{e['workers']} such loops at once; goal >= {e['goal']}",
            f"  epoch-boundary wait  {w['make_loader']['median']:,.0f} ms for each epoch's first "
            f"batch with make_loader (its workers run on into the next epoch) vs "
            f"{w['plain_dataloader']['median']:,.0f} ms with a plain DataLoader epoch by epoch "
            f"({n_workers(w['workers'])}, batch {w['batch_size']})"])

    def verdict(self) -> str:
        """One paragraph: what bounds this pipeline, and what to change."""
        return explain(self)

    def to_json(self) -> dict:
        figures = {k: self.figures.get(k) for k in ("build_ratio", "loader_efficiency", "epoch_wait_ms")}
        return {"packer": __version__, "results": self.results, "config": self.config,
                "environment": self.environment, "notes": self.notes, "verdict": self.verdict(),
                **figures}

    def write_json(self, path: os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def plot(self, path: os.PathLike) -> None:
        """A bar chart of images/s per variant (one panel per kind, whiskers = spread)."""
        plt = check_plot()
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


def check_plot():
    """matplotlib's pyplot (Agg), else a PackerError (so the CLI asks before measuring)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PackerError(f"{PLOT_HINT} (matplotlib requires stock Pillow, which replaces "
                          f"Pillow-SIMD; to get it back: {PILLOW_SIMD_HINT})") from None
    return plt


def run_bench(dst: os.PathLike, *, folder: Optional[os.PathLike] = None,
              staged: Optional[os.PathLike] = None, workers: Optional[Sequence[int]] = None,
              batch_size: Optional[int] = None, size: int = 224, cuda: bool = False,
              model: str = "resnet50", repeats: int = 3, seconds_per_variant: float = 3.0,
              max_images: Optional[int] = None, cold_cache: bool = True, seed: int = 0,
              device: Optional[str] = None, progress: bool = True,
              figure_images: Optional[int] = None) -> BenchReport:
    """Measure read, decode, loader (and with ``cuda`` training-step feeding) rates of ``dst``,
    against its source ``folder`` and a ``staged`` copy (staged first if empty) when given.

    ``workers``: counts to sweep (default 1, cores/2, cores); ``batch_size``: default 256 with
    ``cuda``, else 64; ``size``: the ``DecodeRandomResizedCrop`` output; ``model``: a
    torchvision name, or ``resnet50`` / ``tiny``; ``repeats`` x ``seconds_per_variant`` per
    variant (median and spread), each at most ``max_images``; ``cold_cache``: drop the page
    cache before reads; ``device``: where the ``cuda`` phase trains; ``figure_images``:
    images for the three figures (0 skips them)."""
    cores = usable_cores()
    workers = sorted({1, max(1, cores // 2), cores}) if workers is None else sorted(set(workers))
    batch_size = batch_size or (256 if cuda else 64)
    _check_arguments(repeats, seconds_per_variant, max_images, workers, batch_size)
    train_device = _train_device(cuda, device, model)
    packed = PackedDataset(dst)
    sources = [BenchInput("packed", Path(dst), len(packed))]
    figures = _figure_setup(packed, figure_images, max_images, workers, batch_size, cores)
    report = BenchReport(config={"dst": str(dst), "folder": str(folder) if folder else None,
                                 "staged": str(staged) if staged else None, "workers": workers,
                                 "batch_size": batch_size, "size": size, "cuda": cuda,
                                 "model": model if cuda else None, "repeats": repeats,
                                 "seconds_per_variant": seconds_per_variant,
                                 "max_images": max_images, "cold_cache": cold_cache, "seed": seed,
                                 "figure_images": figures[0]})
    if folder is not None:
        fds = FolderDataset(folder, decode=None)
        sources.append(BenchInput("folder", Path(folder), len(fds), folder=fds))
    if staged is not None:
        _stage(dst, Path(staged), report, progress)
        sources.append(BenchInput("staged", Path(staged), len(PackedDataset(staged))))
    for s in sources:
        if s.count < 2:
            raise PackerError(f"{s.root} holds {s.count} image(s); the bench needs at least 2")

    report.environment = _environment(dst, packed, sources, cores, train_device, cold_cache)
    _note_busy(report, cores)
    rng = random.Random(seed)
    orders = {s.name: _order(rng, s.count, max_images) for s in sources}
    n_runs = repeats * (len(sources) * (1 + len(workers)) + 3) + (repeats * 6 if cuda else 0) \
        + (1 + 3 * repeats if figures[0] else 0)
    bar = tqdm(total=n_runs, unit="run", desc="bench", disable=not progress, dynamic_ncols=True)
    bench = TrainRunner(report, bar, seconds_per_variant, max_images, cold_cache)
    try:
        bench.read_phase(sources, orders, repeats)
        bench.decode_phase(packed, orders["packed"], size, cores, repeats)
        bench.loader_phase(sources, orders, workers, batch_size, size, repeats)
        if figures[0]:
            bench.figures_phase(dst, *figures, size, repeats)
        if cuda:
            bench.train_phase(sources[-1] if staged is not None else sources[0], orders,
                              batch_size, size, model, train_device, repeats)
    finally:
        bar.close()
    return report


def _note_busy(report: BenchReport, cores: int) -> None:
    busy = busy_cores()
    if busy is not None and busy > max(0.25 * cores, 0.3):
        report.environment["busy"] = (f"other processes kept {busy:.1f} of this machine's "
                                      f"cores busy as the bench started: CPU-bound rates are "
                                      f"understated and noisy")
        report.notes.append(report.environment["busy"])


def _check_arguments(repeats, seconds_per_variant, max_images, workers, batch_size) -> None:
    if repeats < 1:
        raise PackerError(f"repeats must be >= 1, got {repeats}")
    if not seconds_per_variant > 0:
        raise PackerError(f"seconds_per_variant must be > 0, got {seconds_per_variant}")
    if max_images is not None and max_images < 2:
        raise PackerError(f"max_images must be at least 2, got {max_images}")
    if not workers or min(workers) < 0:
        raise PackerError("workers must list worker counts >= 0, e.g. [0, 1, 2]")
    if batch_size < 1:
        raise PackerError(f"batch_size must be >= 1, got {batch_size}")


def _figure_setup(packed, images, max_images, workers, batch_size, cores) -> tuple:
    """``figure_plan``'s ``(images, workers, batch_size)``, ``(0, ...)`` to skip; checked
    now that the system's temporary folder has room for the copy and its build."""
    if images is not None and images < 0:
        raise PackerError(f"figure_images must be >= 0, got {images}")
    plan = figure_plan(len(packed), images, max_images, workers, batch_size, cores)
    tmp = tempfile.gettempdir()
    need = 3 * plan[0] * packed.manifest["bytes"] / max(1, len(packed)) + (64 << 20)
    if plan[0] and free_bytes(tmp) < need:
        raise PackerError(f"the build rate ratio, loader efficiency and epoch-boundary wait "
                          f"need about {human_size(need)} free in {tmp} (a copy of {plan[0]} "
                          f"images, built), which has {human_size(free_bytes(tmp))}: set TMPDIR "
                          f"to a folder with room, or fewer images (--figure-images N, 0 skips)")
    return plan


def _train_device(cuda: bool, device: Optional[str], model: str) -> Optional[torch.device]:
    if not cuda:
        return None
    train_device = torch.device(device or "cuda")
    if train_device.type == "cuda":
        if not torch.cuda.is_available():
            raise PackerError(f"cuda=True needs a CUDA GPU, but torch {torch.__version__} sees "
                              f"none (a CPU-only build, or no driver); measure reading, decoding "
                              f"and loading only (cuda=False)")
        from ..gpu import reserve_cuda_queues  # before CUDA starts (the GPU-decode row)
        reserve_cuda_queues()
    make_model(model, 10)  # an unknown model name fails now, not after the other phases
    return train_device


def _environment(dst, packed, sources, cores, train_device, cold_cache) -> dict:
    mean_kb = packed.manifest["bytes"] / max(1, len(packed)) / 1e3
    return {
        "dataset": f"{dst} ({len(packed):,} images, {len(packed.classes)} classes, "
                   f"{mean_kb:,.0f} KB/image stored)",
        "cores": cores, "pil": pil_summary(), **_pil_facts(),
        "torch": torch.__version__, "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(train_device) if train_device is not None
        and train_device.type == "cuda" else None,
        "cache": "cold" if cold_cache else "warm (not dropped)",
        "storage": {s.name: storage(s.root) for s in sources}}


def _pil_facts() -> dict:
    """Which PIL this process (and its loader workers) ran, for the header and the JSON."""
    i = pil_info()
    jpeg = f"libjpeg-turbo {i['jpeg_version']}" if i["libjpeg_turbo"] else f"libjpeg {i['jpeg_version']}"
    if i["simd"]:
        line = f"Pillow-SIMD {i['version']} (its SIMD resize kernel is in the PIL imported), {jpeg}"
    else:
        line = f"Pillow {i['version']} (stock, not Pillow-SIMD), {jpeg}"
        line += ("; pip lists pillow-simd, but a package that requires Pillow overwrote it"
                 if i["mismatch"] else "") + f"; for SIMD resizes: {PILLOW_SIMD_HINT}"
    return {"pil_flavour": i["flavour"], "pil_version": i["version"], "pil_simd": i["simd"],
            "pil_line": line}


def _order(rng: random.Random, n: int, max_images: Optional[int]) -> List[int]:
    """A random order (training reads randomly), at most ``max_images`` long."""
    order = list(range(n))
    rng.shuffle(order)
    return order[:max_images] if max_images else order


def _stage(dst: os.PathLike, target: Path, report: BenchReport, progress: bool) -> None:
    """Stage ``dst`` into ``target`` unless it already holds a complete copy; time the copy."""
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
