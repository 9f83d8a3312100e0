"""What ``bench_build.py``, ``bench_loader_efficiency.py`` and ``bench_epochs.py`` run: the
measurements of ``packer.bench`` (build rate ratio, loader efficiency, epoch-boundary wait)
over a whole folder or dataset, with their tables. Not part of the packer wheel.

Loader efficiency: one core's rate is the dataset's own ``ds[i]`` loop over the same samples
the loader reads, alone and with every worker's core busy (``allcores``). A baseline shows what
handing batches to whichever worker has room gains in the same run (``in_order=True``). Variants
alternate round by round, so drift in the machine's speed touches them alike.

Epoch boundary: the step is a stand-in wait (``StandInStep``, a little longer than the loader
needs per batch inside an epoch) or real (``CudaStep``: a ResNet-50 step on the GPU fed through
``CUDAPrefetcher``, its ideal the same step on a resident batch, timed each round).
"""
from __future__ import annotations

import contextlib
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import Subset

from packer._util.system import usable_cores
from packer.bench.build import DECODE, DECODE_LOADED, GOAL as BUILD_GOAL, build_variants, time_builds
from packer.bench.efficiency import core_rates, steady_rate
from packer.bench.epochs import VARIANTS, EpochRun, loader_batch_time, one_run
from packer.demo import make_image_folder
from packer.loading.loader import default_num_workers, make_loader
from packer.reading.dataset import PackedDataset
from packer.reading.sampler import PackedSampler
from packer.transforms.decode import DecodeRandomResizedCrop

MIN_BATCHES_PER_WORKER = 32  # long enough for a steady state (docs/benchmarks.md)


# -- build ----------------------------------------------------------------------------------

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
        return time_builds(src, tmp, workers=workers, repeats=repeats,
                           decode_sample=decode_sample, variants=build_variants(), log=log)


def build_table(result: dict) -> str:
    """``bench_build``'s result: a markdown table (median, spread, MB/s read, ratio to
    cores x one core's decode rate, alone and with all cores busy) and the goal line."""
    rows, n = result["rows"], result["images"]
    cores = max(1, result["workers"])  # workers=0 builds in this process: one core
    one = statistics.median(rows[DECODE])
    busy = statistics.median(rows.get(DECODE_LOADED) or rows[DECODE])
    lines = [f"| variant | images/s (median of {result['repeats']}) | spread | MB/s in | "
             f"vs cores x 1-core decode | vs cores x 1-core decode, all busy |",
             "|---|---|---|---|---|---|"]
    for name, vals in rows.items():
        med = statistics.median(vals)
        mbps = med * result["bytes"] / n / 1e6
        lines.append(f"| {name} | {med:.0f} | {min(vals):.0f}-{max(vals):.0f} | {mbps:.1f} | "
                     f"{med / (cores * one):.2f} | {med / (cores * busy):.2f} |")
    lines.append(f"\ngoal: build >= {BUILD_GOAL} x {cores} x {one:.0f} = {BUILD_GOAL * cores * one:.0f} "
                 f"images/s ({BUILD_GOAL * cores * busy:.0f} against one core's rate with all busy)")
    return "\n".join(lines)


# -- loader efficiency ------------------------------------------------------------------------

@contextlib.contextmanager
def packed_photos(data: Optional[Path], images: int) -> Iterator[Path]:
    """``data`` if given, else ``images`` photo JPEGs made and packed in a temporary folder
    (removed afterwards): the data the loader benchmarks read."""
    if data is not None:
        yield Path(data)
        return
    with tempfile.TemporaryDirectory() as tmp:
        from packer.writing.builder import build
        src = make_image_folder(Path(tmp) / "src", images=images, classes=10,
                                workers=usable_cores())
        build(src, Path(tmp) / "packed", progress=False)
        yield Path(tmp) / "packed"


def loader_rates(ds, indices: List[int], batch_size: int, workers: int,
                 **kwargs) -> Tuple[float, float]:
    """``(steady_loader_rate, main-process CPU in cores over the whole run)``: the CPU a
    training loop that also drives the GPU gives to the loader."""
    part = Subset(ds, indices)
    cpu, t0 = process_cpu(), time.perf_counter()
    rate = steady_rate(make_loader(part, batch_size, sampler=PackedSampler(part, shuffle=False),
                                   num_workers=workers, pin_memory=False,
                                   persistent_workers=False, **kwargs), workers)
    return rate, (process_cpu() - cpu) / (time.perf_counter() - t0)


def process_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def baselines() -> Dict[str, dict]:
    """``make_loader`` keywords undoing one of its choices each: ``in_order``, batches given
    to the workers in turn."""
    return {"in_order": {"in_order": True}}


def bench_efficiency(root, *, workers: Optional[int] = None, batch_size: int = 64,
                     samples: int = 1024, rounds: int = 5, size: int = 224,
                     log: Callable[[str], None] = print) -> Dict[str, List[float]]:
    """Per round: one core's rate alone (``core``) and with all W busy (``core_loaded``), the
    loader's rate, and ``efficiency`` = loader / (W x core), ``efficiency_loaded`` = loader /
    (W x core_loaded). The loader reads at least ``MIN_BATCHES_PER_WORKER`` batches per
    worker (the dataset over again when it is smaller: it is in the page cache either way)."""
    workers = workers or usable_cores()
    ds = PackedDataset(root, decode=DecodeRandomResizedCrop(size))
    n = max(samples, MIN_BATCHES_PER_WORKER * max(1, workers) * batch_size)
    indices = [i % len(ds) for i in range(n)]
    out: Dict[str, List[float]] = {k: [] for k in ("core", "core_loaded", "loader", "efficiency",
                                                    "efficiency_loaded", "loader_main_cores")}
    for r in range(rounds):
        core, loaded = core_rates(ds, indices, workers)
        loader, cores = loader_rates(ds, indices, batch_size, workers)
        for k, v in (("core", core), ("core_loaded", loaded), ("loader", loader),
                     ("efficiency", loader / (workers * core)),
                     ("efficiency_loaded", loader / (workers * loaded)),
                     ("loader_main_cores", cores)):
            out[k].append(v)
        for name, kwargs in baselines().items():
            rate, cores = loader_rates(ds, indices, batch_size, workers, **kwargs)
            out.setdefault(name, []).append(rate)
            out.setdefault(name + "_gain", []).append(loader / rate)
            out.setdefault(name + "_main_cores", []).append(cores)
        log(f"round {r + 1}/{rounds}: one core {core:,.0f}/s alone, {loaded:,.0f}/s with "
            f"{workers} busy; loader with {workers} workers {loader:,.0f}/s: efficiency "
            f"{out['efficiency'][-1]:.3f} (vs all cores busy: {out['efficiency_loaded'][-1]:.3f})"
            + "".join(f"; {name} {out[name][-1]:,.0f}/s" for name in baselines()))
    return out


def efficiency_table(res: Dict[str, List[float]], workers: int) -> str:
    med = {k: statistics.median(v) for k, v in res.items()}
    return "\n".join([
        "| measure | median | spread |", "|---|---:|---|",
        f"| one core, `ds[i]` loop (images/s) | {med['core']:,.0f} | "
        f"{min(res['core']):,.0f}-{max(res['core']):,.0f} |",
        f"| one core while {workers} run the loop at once (images/s) | "
        f"{med['core_loaded']:,.0f} | "
        f"{min(res['core_loaded']):,.0f}-{max(res['core_loaded']):,.0f} |",
        f"| `make_loader`, {workers} workers (images/s) | {med['loader']:,.0f} | "
        f"{min(res['loader']):,.0f}-{max(res['loader']):,.0f} |",
        f"| efficiency = loader / ({workers} x one core) | {med['efficiency']:.3f} | "
        f"{min(res['efficiency']):.3f}-{max(res['efficiency']):.3f} |",
        f"| efficiency vs all cores busy = loader / ({workers} x one core while {workers} run) "
        f"| {med['efficiency_loaded']:.3f} | {min(res['efficiency_loaded']):.3f}-"
        f"{max(res['efficiency_loaded']):.3f} |",
        f"| main-process CPU while `make_loader` runs (cores) | {med['loader_main_cores']:.2f} | "
        f"{min(res['loader_main_cores']):.2f}-{max(res['loader_main_cores']):.2f} |",
        *baseline_rows(res, med)])


BASELINE_NAMES = {"in_order": "batches to the workers in turn (`in_order=True`)"}


def baseline_rows(res: Dict[str, List[float]], med: Dict[str, float]) -> List[str]:
    rows = []
    for name, what in BASELINE_NAMES.items():
        if name in res:
            g = res[name + "_gain"]
            c = res[name + "_main_cores"]
            rows += [f"| `make_loader`, {what} (images/s) | {med[name]:,.0f} | "
                     f"{min(res[name]):,.0f}-{max(res[name]):,.0f} |",
                     f"| gain = loader / that | {med[name + '_gain']:.3f} | "
                     f"{min(g):.3f}-{max(g):.3f} |",
                     f"| its main-process CPU (cores) | {med[name + '_main_cores']:.2f} | "
                     f"{min(c):.2f}-{max(c):.2f} |"]
    return rows


# -- the epoch boundary -----------------------------------------------------------------------

class CudaStep:
    """A real training step on the GPU (``TrainStep``: bf16 autocast, channels_last, SGD) fed
    through ``CUDAPrefetcher``; ``calibrate()`` times it on a resident batch: the ideal."""

    pin_memory = True

    def __init__(self, model: str = "resnet50", batch_size: int = 256, size: int = 224,
                 device: str = "cuda"):
        import torch
        from packer.bench.models import TrainStep, make_model
        from packer.loading.prefetch import CUDAPrefetcher
        torch.backends.cudnn.benchmark = True
        self.dev, self.batch = torch.device(device), batch_size
        net = make_model(model, 1000).to(self.dev, memory_format=torch.channels_last)
        self.step, self.prefetcher = TrainStep(net, self.dev), CUDAPrefetcher
        self.x = torch.randn(batch_size, 3, size, size, device=self.dev).contiguous(
            memory_format=torch.channels_last)
        self.y = torch.randint(0, 1000, (batch_size,), device=self.dev)
        self.seconds = 0.0

    def calibrate(self, steps: int = 30) -> float:
        """Seconds per step on the resident batch (after a few untimed steps)."""
        for _ in range(5):
            self.step(self.x, self.y)
        self.finish()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(self.x, self.y)
        self.finish()
        self.seconds = (time.perf_counter() - t0) / steps
        return self.seconds

    def feed(self, loader):
        return self.prefetcher(loader, device=self.dev)

    def __call__(self, x, y) -> float:
        self.step(x, y)
        return self.seconds * len(x) / self.batch

    def finish(self) -> None:
        import torch
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)


def bench_epochs(root, *, batch_size: int = 64, workers: Optional[int] = None, epochs: int = 3,
                 rounds: int = 5, size: int = 224, slack: float = 1.15, cuda_model: str = "",
                 log: Callable[[str], None] = print) -> Dict[str, List[EpochRun]]:
    """Interleaved rounds of every variant. The step: ``cuda_model`` trained on the GPU
    (``CudaStep``, re-timed on a resident batch each round), else a stand-in wait of
    ``slack`` x the loader's batch time."""
    ds = PackedDataset(root, decode=DecodeRandomResizedCrop(size))
    if cuda_model:
        workers = workers or default_num_workers()
        step = CudaStep(cuda_model, batch_size, size)
        log(f"{len(ds)} images, batch {batch_size}, {workers} workers: a {cuda_model} step, "
            f"{step.calibrate() * 1e3:.1f} ms on a resident batch")
    else:
        workers = workers or usable_cores()
        step = slack * loader_batch_time(ds, batch_size, workers)
        log(f"{len(ds)} images, batch {batch_size}, {workers} workers: the stand-in step is "
            f"{step * 1e3:.1f} ms ({slack}x the loader's time per batch inside an epoch)")
    out: Dict[str, List[EpochRun]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        if cuda_model:
            log(f"round {r + 1}/{rounds}: resident-batch step {step.calibrate() * 1e3:.1f} ms")
        for name, across in VARIANTS.items():
            run = one_run(ds, across, batch_size=batch_size, workers=workers, epochs=epochs,
                          step=step)
            out[name].append(run)
            log(f"round {r + 1}/{rounds}: {name}: kept {run.kept:.3f} of the ideal, first-batch "
                f"waits {', '.join(f'{w * 1e3:.1f}' for w in run.first_waits)} ms, in-epoch "
                f"median {statistics.median(run.waits) * 1e3:.2f} ms")
    return out


def epochs_table(results: Dict[str, List[EpochRun]]) -> str:
    rows = ["| loader | kept of ideal (median) | spread | epoch-start wait, median ms | "
            "in-epoch wait, median / mean ms | start / in-epoch median |",
            "|---|---:|---|---:|---:|---:|"]
    for name, runs in results.items():
        kept = [r.kept for r in runs]
        first = statistics.median([w for r in runs for w in r.first_waits]) * 1e3
        inner = [w * 1e3 for r in runs for w in r.waits]
        med = statistics.median(inner)
        rows.append(f"| {name} | {statistics.median(kept):.3f} | {min(kept):.3f}-{max(kept):.3f} "
                    f"| {first:.1f} | {med:.2f} / {statistics.fmean(inner):.2f} "
                    f"| {first / med:.1f}x |")
    return "\n".join(rows)
