"""What ``benchmarks/bench_loader_efficiency.py`` measures: loader efficiency, as issue 16 defines
it — images/s of ``make_loader`` with W workers ÷ (W × one core's images/s for the same
per-sample work).

One core's rate is the dataset's own ``ds[i]`` (read, unpack, decode + crop, target) in a
plain loop, over the same samples the loader reads, measured two ways: alone in this process
on an otherwise idle machine, and in W processes at once (``allcores``: the rate a core has
when every worker's core is busy, which is what a loader with no overhead would reach). The
loader reads the samples through ``make_loader`` as training does (a ``PackedSampler``, here
in a fixed order; its default collate; no pinning) after its first wave of batches. A
baseline shows what handing batches to whichever worker has room gains, in the same run:
batches handed to the workers in turn (``in_order=True``: ``packer.loading.epochs``). Both
alternate round by round, so drift in the machine's speed touches both; the median of the
rounds' ratios is reported.
"""
from __future__ import annotations

import contextlib
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from torch.utils.data import Subset

from .._util.system import usable_cores
from .allcores import median_rate_on_all_cores
from ..reading.dataset import PackedDataset
from ..transforms.decode import DecodeRandomResizedCrop
from ..loading.loader import make_loader
from ..reading.sampler import PackedSampler

GOAL = 0.9  # issue 16: loader images/s >= GOAL x workers x one core's rate
MIN_BATCHES_PER_WORKER = 32  # long enough for a steady state: with 8, 16 workers ran ~1.5 s and
# rounds spread 0.82-0.96 (docs/benchmarks.md, issue 16, fourth session)


@contextlib.contextmanager
def packed_photos(data: Optional[Path], images: int) -> Iterator[Path]:
    """``data`` if given, else ``images`` photo JPEGs made and packed in a temporary folder
    (removed afterwards): the data the loader benchmarks read."""
    if data is not None:
        yield Path(data)
        return
    with tempfile.TemporaryDirectory() as tmp:
        from ..writing.builder import build
        from ..demo import make_image_folder
        src = make_image_folder(Path(tmp) / "src", images=images, classes=10,
                                workers=usable_cores())
        build(src, Path(tmp) / "packed", progress=False)
        yield Path(tmp) / "packed"


def one_core_rate(ds, indices: List[int]) -> float:
    """images/s of a ``ds[i]`` loop on one torch thread, as a DataLoader worker runs it (a
    decoder that resizes with torch would otherwise spread each small resize over every
    core, which is neither one core's rate nor what the workers do)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        for i in indices:
            ds[i]
        return len(indices) / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def steady_rate(batches: Iterable, workers: int) -> float:
    """images/s of ``batches`` ((images, labels) pairs) in the steady state: from the end of
    the first wave of batches (one per worker, ``max(1, workers)``) to the start of the last.
    The first wave arrives all together after start-up (counting it overstated the rate: 16
    workers over 1,024 images, 4.7), and in the last one workers run out of work one by one
    while the last batches finish (counting it understates the rate); an epoch of a real
    dataset is hundreds of waves long. A run shorter than two waves and a batch is timed whole
    from its start, start-up included."""
    wave = max(1, workers)
    arrivals = [(time.perf_counter(), 0)]  # (time, images) of the start, then of each batch
    for x, _ in batches:
        arrivals.append((time.perf_counter(), len(x)))
    first, last = wave, len(arrivals) - 1 - wave
    if last <= first:  # too short for a steady state: the whole run
        first, last = 0, len(arrivals) - 1
    images = sum(n for _, n in arrivals[first + 1:last + 1])
    return images / (arrivals[last][0] - arrivals[first][0])


def steady_loader_rate(ds, indices: List[int], batch_size: int, workers: int,
                       **kwargs) -> float:
    """``steady_rate`` of ``make_loader`` over ``indices`` (a ``PackedSampler`` in a fixed
    order, no pinning; kwargs passed on). Give it many batches per worker
    (``bench_efficiency`` takes at least ``MIN_BATCHES_PER_WORKER``)."""
    return loader_rates(ds, indices, batch_size, workers, **kwargs)[0]


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


def efficiency_round(ds, indices: List[int], batch_size: int, workers: int):
    """One round's ``(core, core_loaded, loader)`` images/s: ``core_rates`` and
    ``make_loader`` over all of ``indices`` (``steady_loader_rate``)."""
    return (*core_rates(ds, indices, workers), steady_loader_rate(ds, indices, batch_size,
                                                                  workers))


def core_rates(ds, indices: List[int], workers: int) -> Tuple[float, float]:
    """A ``ds[i]`` loop over one worker's share of ``indices`` alone, and the same loop in
    ``workers`` processes at once (images/s of one of them)."""
    w = max(1, workers)
    core = one_core_rate(ds, indices[::w])
    return core, median_rate_on_all_cores(lambda share: one_core_rate(ds, share), indices, w)


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
