"""The measuring runs of ``packer bench`` (raw reads, one-core decode, the loader, the three
figures), each over the packed data and the ImageFolder-style baseline (``FolderDataset``)."""
from __future__ import annotations

import copy
import importlib.util
import io
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from PIL import Image

from .._util.system import usable_cores
from ..writing.builder import build
from ..writing.check import Transcode, check_image
from ..reading.dataset import PackedDataset
from ..transforms.decode import DecodeRandomResizedCrop, image_to_tensor
from ..loading.loader import make_loader
from ..reading.reader import ShardReader
from ..demo import FolderDataset
from . import build as build_bench
from .coldread import drop_page_cache, storage
from .efficiency import GOAL as EFFICIENCY_GOAL, core_rates, steady_loader_rate
from .epochs import VARIANTS as EPOCH_VARIANTS, loader_batch_time, one_run

DECODE_SAMPLE = 200      # images held in memory for the one-core decode runs
FIGURE_IMAGES = 1000     # the sample of the dataset's images the three figures use, at least
FIGURE_EPOCHS = 2        # epochs timed per epoch-boundary run (after a warm-up epoch)
EPOCH_SLACK = 1.15       # the stand-in step: this x the loader's time per batch (bench_epochs')
EPOCH_KEYS = {True: "make_loader", False: "plain_dataloader"}  # across_epochs -> JSON key


class DecodeFullRandomResizedCrop(DecodeRandomResizedCrop):
    """The same crop and flip as ``DecodeRandomResizedCrop``, but decoding every pixel first
    (what torchvision's RandomResizedCrop after ``Image.open().convert("RGB")`` costs)."""

    def __call__(self, data: bytes):
        im = Image.open(io.BytesIO(data)).convert("RGB")
        oh, ow = self.size
        im = im.resize((ow, oh), Image.BILINEAR, box=self.box(*im.size), reducing_gap=None)
        if self.flip():
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return image_to_tensor(im)


@dataclass
class BenchInput:
    """One thing a bench run reads: the packed dataset, its source folder, or a staged copy."""
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


class Runner:
    """The phases; each appends its results to the report."""

    def __init__(self, report, bar, seconds: float, max_images: Optional[int],
                 cold_cache: bool):
        self.report, self.bar, self.seconds, self.max_images = report, bar, seconds, max_images
        self.cold_cache = cold_cache

    def _evict(self, source: BenchInput, order: Sequence[int]) -> Optional[str]:
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

    def read_phase(self, sources: List[BenchInput], orders: Dict[str, List[int]], repeats: int) -> None:
        runs: Dict[str, List[dict]] = {s.name: [] for s in sources}
        cache: Dict[str, Optional[str]] = {}
        if not self.cold_cache:  # warm means warm: one untimed pass fills the page cache
            for s in sources:
                self.bar.set_postfix_str(f"read {s.name} (warm-up)")
                self._read(s, orders[s.name])
        for _ in range(repeats):
            for s in sources:
                self.bar.set_postfix_str(f"read {s.name}")
                cache[s.name] = self._evict(s, orders[s.name])
                runs[s.name].append(self._read(s, orders[s.name]))
                self.bar.update(1)
        for s in sources:
            how = cache[s.name] or "warm"
            label = "tmpfs" if how.startswith("RAM") else how.split(" (")[0]
            self._add(f"read {s.name} ({label})", "read", runs[s.name], source=s.name,
                      cache=how, storage=storage(s.root))

    def _read(self, s: BenchInput, order: List[int]) -> dict:
        """Records (or files) per second and MB/s, reading whole values in ``order``."""
        if s.name == "folder":
            paths, reader = s.files(order), None

            def read(k):
                return len(Path(paths[k]).read_bytes())
        else:
            reader = ShardReader(s.root)

            def read(k):
                return len(reader.read(order[k]))
        try:
            read(0)  # warm-up: opens the environment / directory, first seek
            n, nbytes, t0 = 0, 0, time.perf_counter()
            for n in range(1, len(order)):  # n: the reads timed (the bench needs 2 images)
                nbytes += read(n)
                if n % 8 == 0 and time.perf_counter() - t0 >= self.seconds:
                    break
            el = time.perf_counter() - t0
        finally:
            if reader is not None:
                reader.close()
        return {"images_per_s": n / el, "mb_per_s": nbytes / el / 1e6}

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
                self.bar.set_postfix_str(name)
                random.seed(r)
                runs[name].append(self._decode(fn, blobs))
                self.bar.update(1)
        for name, _, blobs in variants:
            res = self._add(name, "decode", runs[name], cores=cores,
                            mean_kb=sum(map(len, blobs)) / max(1, len(blobs)) / 1e3)
            if res:
                res["ceiling_images_per_s"] = res["images_per_s"] * cores

    def _decode(self, fn: Callable, blobs: List[bytes]) -> dict:
        """One core's rate: decode ``blobs`` in turn (after 5 untimed), per CPU-second of the thread
        (the wall-clock rate kept as ``wall_images_per_s``)."""
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

    def loader_phase(self, sources: List[BenchInput], orders: Dict[str, List[int]],
                     workers: List[int], batch_size: int, size: int, repeats: int) -> None:
        runs: Dict[Tuple[str, int], List[dict]] = {(s.name, w): [] for w in workers for s in sources}
        for r in range(repeats):
            for w in workers:
                for s in sources:
                    self.bar.set_postfix_str(f"loader {s.name}, {n_workers(w)}")
                    self._evict(s, orders[s.name])
                    ds = s.dataset(size)
                    loader = make_loader(ds, batch_size, sampler=orders[s.name], num_workers=w,
                                         pin_memory=False, persistent_workers=False, drop_last=True,
                                         worker_init_fn=SeedWorker(r))
                    runs[(s.name, w)].append(self._time_loader(loader, w))
                    del loader, ds
                    self.bar.update(1)
        for w in workers:
            for s in sources:
                self._add(f"loader {s.name}, {n_workers(w)}", "loader",
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

    def figures_phase(self, dst, images: int, workers: int, batch_size: int, size: int,
                      repeats: int) -> None:
        """Copy ``images`` of ``dst``'s images to a temporary folder, measure the build rate ratio,
        then loader efficiency and the epoch-boundary wait, into ``report.figures``."""
        cores = usable_cores()
        with tempfile.TemporaryDirectory(prefix="packer-bench-figures-") as tmp:
            tmp = Path(tmp)
            self.bar.set_postfix_str(f"build rate ratio ({images} images)")
            src = build_bench.sample_folder(dst, tmp / "src", images)
            self._build_figure(src, tmp, cores, repeats)
            build(src, tmp / "packed", workers=cores, progress=False)
            ds = PackedDataset(tmp / "packed", decode=DecodeRandomResizedCrop(size))
            self._efficiency_figure(ds, workers, batch_size, repeats)
            self._epoch_figure(ds, workers, batch_size, repeats)

    def _build_figure(self, src: Path, tmp: Path, cores: int, repeats: int) -> None:
        variants = build_bench.build_variants()[:1]  # bytes unchanged: what `packer build` does
        res = build_bench.time_builds(src, tmp, workers=cores, repeats=repeats, variants=variants,
                                      decode_sample=2 * DECODE_SAMPLE, log=lambda _: None)
        built, decoded = res["rows"][variants[0][0]], res["rows"][build_bench.DECODE]
        self.report.figures["build_ratio"] = dict(  # build images/s / (cores x one core's decode)
            summary(build_bench.build_ratios(res, variants[0][0], cores)), goal=build_bench.GOAL,
            build_images_per_s=statistics.median(built),
            decode_images_per_s=statistics.median(decoded),
            cores=cores, workers=cores, images=res["images"])
        self.bar.update(1)

    def _efficiency_figure(self, ds: PackedDataset, workers: int, batch_size: int,
                           repeats: int) -> None:
        """Per round: one core's ``ds[i]`` loop alone and ``workers`` at once, then the loader."""
        indices, rounds = list(range(len(ds))), []
        for _ in range(repeats):
            self.bar.set_postfix_str("loader efficiency")
            rounds.append((*core_rates(ds, indices, workers),
                           steady_loader_rate(ds, indices, batch_size, workers)))
            self.bar.update(1)
        core, busy, loader = zip(*rounds)
        self.report.figures["loader_efficiency"] = dict(
            summary([lo / (workers * c) for lo, c in zip(loader, core)]), goal=EFFICIENCY_GOAL,
            all_cores_busy=summary([lo / (workers * b) for lo, b in zip(loader, busy)]),
            loader_images_per_s=statistics.median(loader),
            core_images_per_s=statistics.median(core),
            core_busy_images_per_s=statistics.median(busy), workers=workers,
            batch_size=batch_size, images=len(ds))

    def _epoch_figure(self, ds: PackedDataset, workers: int, batch_size: int,
                      repeats: int) -> None:
        step = EPOCH_SLACK * loader_batch_time(ds, batch_size, workers)
        waits: Dict[str, List[float]] = {k: [] for k in EPOCH_KEYS.values()}
        kept: Dict[str, List[float]] = {k: [] for k in EPOCH_KEYS.values()}
        for _ in range(repeats):
            for name, across in EPOCH_VARIANTS.items():
                self.bar.set_postfix_str(f"epoch-boundary wait, {name}")
                run = one_run(ds, across, batch_size=batch_size, workers=workers,
                              epochs=FIGURE_EPOCHS, step=step)
                waits[EPOCH_KEYS[across]] += [w * 1e3 for w in run.first_waits]
                kept[EPOCH_KEYS[across]].append(run.kept)
                self.bar.update(1)
        fig = {k: summary(v) for k, v in waits.items()}
        fig.update(kept={k: statistics.median(v) for k, v in kept.items()}, step_ms=step * 1e3,
                   epochs=FIGURE_EPOCHS, workers=workers, batch_size=batch_size,
                   images=len(ds))
        self.report.figures["epoch_wait_ms"] = fig


def figure_plan(count: int, images: Optional[int], max_images: Optional[int],
                sweep: Sequence[int], batch_size: int, cores: int) -> Tuple[int, int, int]:
    """``(images, workers, batch_size)`` for ``figures_phase``: ``images`` or enough for two
    batches per worker (within ``max_images`` and ``count``), the sweep's largest worker count
    (within the cores, and the images: a worker with none would count as a rate of 0), and a
    batch small enough for two per worker."""
    workers = max(1, min(max(sweep), cores))
    if images is None:
        images = max(FIGURE_IMAGES, 2 * workers * batch_size)
        images = min(images, max_images) if max_images else images
    images = min(images, count)
    workers = max(1, min(workers, images))
    return images, workers, max(1, min(batch_size, images // (2 * workers)))


def summary(values: List[float]) -> dict:
    """``median``, ``spread`` [min, max] and the ``values`` themselves."""
    return {"median": statistics.median(values), "spread": [min(values), max(values)],
            "values": list(values)}


class SeedWorker:
    """Per-worker, per-repeat seed for the random crops (picklable for spawn)."""

    def __init__(self, r: int):
        self.r = r

    def __call__(self, worker_id: int) -> None:
        random.seed(self.r * 1009 + worker_id)


def n_workers(w: int) -> str:
    return f"{w} worker" if w == 1 else f"{w} workers"


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
