"""``packer demo``: the whole job on generated data, timed step by step, with the packed loader
compared with the plain folder loader. ``detection.py`` runs the same job on COCO scenes."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple

import torch
from tqdm.auto import tqdm

from .._util.system import free_bytes, human_size, usable_cores
from ..writing.builder import build
from ..reading.dataset import PackedDataset
from ..transforms.decode import DecodeRandomResizedCrop
from ..errors import PackerError
from ..info import verify
from ..loading.loader import default_num_workers, make_loader
from ..loading.prefetch import CUDAPrefetcher
from ..reading.sampler import PackedSampler
from ..staging import stage, unstage
from .folder import FolderDataset
from .images import make_image_folder

DEMO_IMAGES = 640   # the least: ~45 MB of JPEGs (10 batches of 64), made in ~12 s on 2 idle cores
DEMO_BATCHES_PER_WORKER = 4  # enough images for every loader worker to make this many batches
DEMO_CLASSES = 10
DEMO_MARKER = ".packer-demo"  # says "packer demo made this folder": a re-run may replace it


@dataclass
class DemoStep:
    name: str
    seconds: float
    detail: str


@dataclass
class DemoResult:
    """What ``run_demo`` did and measured. ``report()`` is the text ``packer demo`` prints."""
    dir: Optional[Path]                 # the kept folder (None: a temporary one, removed)
    images: int
    classes: int
    workers: int
    batch_size: int
    size: int
    device: str                         # "cuda:0 (NAME)" or "cpu"
    steps: List[DemoStep] = field(default_factory=list)
    folder_images_per_s: float = 0.0
    packed_images_per_s: float = 0.0
    staged_to: Optional[Path] = None    # the RAM copy read by the packed loader (removed at the end)
    notes: List[str] = field(default_factory=list)

    image_bytes = 80_000                # a made JPEG, a little over the mean (about 70 KB)
    baseline = "folder loader"
    command = "packer demo"
    kept = "images/ (the source folder)"
    decode = "DecodeRandomResizedCrop(224)"
    why = ("Both decode the same JPEGs (DecodeRandomResizedCrop) through the same make_loader "
           "settings; here every byte is in RAM, so decoding bounds both and about 1x is "
           "expected. Packing pays where reading is the limit (cold or network disks, millions "
           "of files): measure yours with `packer bench DST --folder SRC` (docs/tuning.md).")

    @property
    def ratio(self) -> float:
        """Packed loader images/s over folder loader images/s."""
        return self.packed_images_per_s / self.folder_images_per_s if self.folder_images_per_s else float("nan")

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def title(self) -> str:
        return (f"packer demo: {self.images} images in {self.classes} classes; {self.workers} "
                f"loader worker{'' if self.workers == 1 else 's'}, batch {self.batch_size}, "
                f"crop {self.size}; {self.device}")

    def checks(self) -> List[str]:
        return []

    def report(self) -> str:
        w = max(len(s.name) for s in self.steps) if self.steps else 0
        lines = [self.title(), *(f"  {s.name:<{w}}  {s.seconds:6.1f} s  {s.detail}" for s in self.steps),
                 f"  {'total':<{w}}  {self.seconds:6.1f} s",
                 f"packed loader {self.packed_images_per_s:,.0f} images/s vs {self.baseline} "
                 f"{self.folder_images_per_s:,.0f} images/s: {self.ratio:.2f}x (after each "
                 f"worker's first batch)", *self.checks(), self.why]
        lines += [f"Note: {n}" for n in self.notes]
        if self.dir is None:
            lines.append(f"Nothing was kept (temporary folder and staged copy removed). Keep the "
                         f"data with `{self.command} DIR`.")
        else:
            d = self.dir
            lines += [f"Kept in {d}: {self.kept} and packed/ (the dataset); the staged RAM copy "
                      f"was removed.", f"Inspect it: packer info {d / 'packed'}",
                      f"Train from it: PackedDataset({str(d / 'packed')!r}, "
                      f"decode={self.decode}) and packer.make_loader"]
        return "\n".join(lines)


def demo_images(workers: int, batch_size: int = 64, least: int = DEMO_IMAGES) -> int:
    """The default image count: ``least``, or more on many cores, so that each loader worker
    makes several batches (a rate measured over one wave of batches is start-up)."""
    return max(least, DEMO_BATCHES_PER_WORKER * batch_size * max(1, workers))


def run_demo(dir: Optional[os.PathLike] = None, *, images: Optional[int] = None,
             classes: int = DEMO_CLASSES, workers: Optional[int] = None, batch_size: int = 64,
             size: int = 224, stage_dir: Optional[os.PathLike] = "/dev/shm", rounds: int = 2,
             seed: int = 0, progress: bool = True,
             on_step: Optional[Callable[[str], None]] = None) -> DemoResult:
    """The whole job on generated data, no downloads: make, build, verify, stage, then read
    epochs through the folder loader and the packed loader with the same decoder and settings.

    Args:
        images: default ``demo_images(workers, batch_size)``.
        dir: keep everything here (new, empty, or an earlier demo's); ``None``: a temp folder.
        stage_dir: where to stage (``None`` skips staging).
        workers: processes for making/building and DataLoader workers [default: usable cores].
        rounds: epochs per loader, interleaved; the best rate of each is reported.
        on_step: called with each step's name as it starts.

    Temporary files are removed however the run ends. ``PackerError`` for an unusable ``dir``
    or a dataset that fails to verify."""
    make_workers = workers if workers is not None else usable_cores()
    load_workers = workers if workers is not None else default_num_workers()
    images = images if images is not None else demo_images(load_workers, batch_size)
    if images < classes or classes < 1:
        raise PackerError(f"the demo needs at least one image per class, got {images} images "
                          f"for {classes} classes")
    if batch_size < 1 or size < 16 or rounds < 1:
        raise PackerError(f"batch size and rounds must be >= 1 and crop size >= 16, got "
                          f"{batch_size}, {rounds}, {size}")
    res = DemoResult(dir=Path(dir) if dir is not None else None, images=images, classes=classes,
                     workers=load_workers, batch_size=batch_size, size=size, device=device_name())

    def make(steps: Steps, work: Path) -> Path:
        t = steps.start("make images")
        with _one_thread_children():
            src = make_image_folder(work / "images", images=images, classes=classes, seed=seed,
                                    workers=make_workers, progress=progress)
        nbytes = sum(p.stat().st_size for p in src.glob("*/*.jpg"))
        steps.done("make images", t, f"{images} photo-like JPEGs, {human_size(nbytes)} "
                                     f"({human_size(nbytes / images)} each) in {src}")
        build_and_verify(steps, "build", src, work / "packed", make_workers, progress)
        return src

    def compare(steps: Steps, src: Path, read_from: Path) -> None:
        decode = DecodeRandomResizedCrop(size)
        compare_loaders(steps, FolderDataset(src, decode=decode),
                        PackedDataset(read_from, decode=decode), seed,
                        lambda ds, smp: make_loader(ds, batch_size, sampler=smp,
                                                    num_workers=load_workers,
                                                    persistent_workers=False),
                        read_from, rounds, progress, "ImageFolder-style, a file per image")

    return run_job(res, ("images", "packed"), on_step, stage_dir, progress, make, compare)


def device_name() -> str:
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    return "cpu (no CUDA)"


def run_job(res: DemoResult, outputs: Tuple[str, ...], on_step, stage_dir, progress: bool,
            make: Callable, compare: Callable) -> DemoResult:
    """The demo's frame: a work folder, ``make(steps, work)``, a staged copy when ``stage_dir`` is
    writable, ``compare(steps, source, read_from)``; temporary files removed however it ends.
    Refused before anything is made when the images and their build would not fit."""
    check_room(res, res.dir if res.dir is not None else Path(tempfile.gettempdir()))
    work = (demo_dir(res.dir, outputs) if res.dir is not None
            else Path(tempfile.mkdtemp(prefix="packer-demo-")))
    steps = Steps(res, on_step)
    try:
        src = make(steps, work)
        read_from = work / "packed"
        if stage_dir is not None and os.path.isdir(stage_dir) and os.access(stage_dir, os.W_OK):
            read_from = stage_copy(steps, read_from, stage_dir, progress)
        elif stage_dir is not None:
            res.notes.append(f"{stage_dir} is missing or not writable: not staged")
        compare(steps, src, read_from)
        return res
    finally:
        if res.staged_to is not None:
            with contextlib.suppress(PackerError):
                unstage(res.staged_to)
            shutil.rmtree(res.staged_to, ignore_errors=True)  # ours, whatever is left
        if res.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def check_room(res: DemoResult, where: Path) -> None:
    """``PackerError`` unless ``where`` (or its nearest existing parent) has room for the
    images and the dataset built from them: a count is otherwise bounded only by the disk."""
    while not where.exists():
        where = where.parent
    need, free = 2 * res.images * res.image_bytes, free_bytes(where)
    if free < need:
        raise PackerError(f"{res.images:,} images and their build need about {human_size(need)} "
                          f"free in {where}, which has {human_size(free)}: ask for fewer images "
                          f"or give the demo a folder with room")


class Steps:
    """Announces each step as it starts and records its time and outcome in the result."""

    def __init__(self, res: DemoResult, on_step: Optional[Callable[[str], None]]):
        self.res, self.on_step = res, on_step

    def start(self, name: str) -> float:
        if self.on_step is not None:
            self.on_step(name)
        return time.perf_counter()

    def done(self, name: str, t0: float, detail: str) -> None:
        self.res.steps.append(DemoStep(name, time.perf_counter() - t0, detail))


def build_and_verify(steps: Steps, name: str, source, dst: Path, workers: int,
                     progress: bool) -> dict:
    """Build ``source`` into ``dst`` and verify every record; the manifest."""
    t = steps.start(name)
    built = build(source, dst, workers=workers, progress=progress)
    steps.done(name, t, built.summary())
    t = steps.start("verify")
    rep = verify(dst, progress=progress)
    if not rep.ok:
        raise PackerError(f"the demo dataset failed to verify: {rep.problems[0]} "
                          f"({len(rep.problems)} problem(s))")
    steps.done("verify", t, f"OK: {rep.checked_shards} shard(s), {rep.checked_records} records")
    return built.manifest


def stage_copy(steps: Steps, packed: Path, stage_dir: os.PathLike, progress: bool) -> Path:
    """Stage into a new folder under ``stage_dir``; the disk copy if that fails (e.g. RAM)."""
    t = steps.start("stage")
    staged = Path(tempfile.mkdtemp(prefix="packer-demo-", dir=stage_dir))
    steps.res.staged_to = staged  # removed at the end, whatever happens now
    try:
        sres = stage(packed, staged, progress=progress)
    except PackerError as e:  # e.g. too little RAM: the demo goes on from the disk copy
        steps.res.notes.append(f"not staged: {e}")
        steps.res.staged_to = None
        shutil.rmtree(staged, ignore_errors=True)
        return packed
    steps.done("stage", t, f"{human_size(sres.bytes_total)} -> {staged} "
                           f"({sres.fstype or 'unknown filesystem'}, verified)")
    return staged


def compare_loaders(steps: Steps, folder, packed: PackedDataset, seed: int, loader: Callable,
                    read_from: Path, rounds: int, progress: bool, baseline: str,
                    record: Optional[Callable] = None) -> None:
    """Interleaved epochs of ``loader(ds, sampler)`` over the ``folder`` dataset and ``packed``
    (a seeded PackedSampler; its reader closed after), best of ``rounds`` each (the least
    disturbed is closest to the real rate)."""
    res, cuda = steps.res, torch.cuda.is_available()
    try:
        datasets = {"folder loader": (folder, None),
                    "packed loader": (packed, PackedSampler(packed, seed=seed))}
        took, best = dict.fromkeys(datasets, 0.0), dict.fromkeys(datasets, 0.0)
        for r in range(rounds):
            for name, (ds, sampler) in datasets.items():
                t = steps.start(name) if r == 0 else time.perf_counter()
                if sampler is not None:
                    sampler.set_epoch(r)
                batches = loader(ds, sampler)
                if r == 0 and record is not None:
                    batches = record(name, batches)
                if cuda:
                    batches = CUDAPrefetcher(batches)
                n, sec = loader_rate(batches, res.workers, cuda=cuda, total=len(ds),
                                     progress=progress, desc=f"{name} {r + 1}/{rounds}")
                best[name] = max(best[name], n / sec)
                took[name] += time.perf_counter() - t
    finally:
        packed.reader.close()
    res.folder_images_per_s, res.packed_images_per_s = best["folder loader"], best["packed loader"]
    to_gpu = " + CUDAPrefetcher" if cuda else ""
    where = "staged copy" if read_from == res.staged_to else "shards"
    runs = f"best of {rounds} epochs" if rounds > 1 else "one epoch"
    for name, what in (("folder loader", baseline),
                       ("packed loader", f"PackedDataset ({where}) + PackedSampler")):
        res.steps.append(DemoStep(name, took[name],
                                  f"{best[name]:,.0f} images/s ({runs}): {what}{to_gpu}"))


def loader_rate(batches: Iterable, workers: int, *, cuda: bool = False,
                total: Optional[int] = None, progress: bool = False,
                desc: str = "") -> Tuple[int, float]:
    """(images, seconds) of one pass over ``batches`` after the first wave (worker start-up);
    a pass too short for that is timed whole."""
    skip = max(1, workers)
    count = timed = 0
    t0 = t_start = time.perf_counter()
    with tqdm(total=total, unit="img", desc=desc, disable=not progress, leave=False) as bar:
        for seen, (_, targets) in enumerate(batches, 1):
            count += len(targets)
            if seen > skip:
                timed += len(targets)
            elif seen == skip:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            bar.update(len(targets))
        if cuda:
            torch.cuda.synchronize()
    end = time.perf_counter()
    return (timed, end - t0) if timed else (count, end - t_start)


@contextlib.contextmanager
def _one_thread_children():
    """Processes spawned inside start with one OpenMP thread (unless the user chose a number)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def demo_dir(d: Path, outputs: Tuple[str, ...]) -> Path:
    """``d`` ready for a demo: new, empty, or an earlier demo's (``outputs`` replaced)."""
    if d.exists() and not d.is_dir():
        raise PackerError(f"{d} is not a folder; give the demo a new or empty folder")
    made = "/ and ".join(outputs) + "/"
    if d.is_dir() and any(d.iterdir()):
        if not (d / DEMO_MARKER).is_file():
            raise PackerError(f"{d} is not empty and was not made by `packer demo`; give the demo "
                              f"a new or empty folder (it writes {made} there)")
        for sub in outputs:
            shutil.rmtree(d / sub, ignore_errors=True)
    d.mkdir(parents=True, exist_ok=True)
    (d / DEMO_MARKER).write_text(f"made by `packer demo`; a re-run replaces {made}\n")
    return d
