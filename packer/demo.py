"""Realistic sample data (no downloads) and the end-to-end demo run.

Benchmarks must use photo-like JPEGs: noise or flat colour decode at unrealistic speeds.
``make_image_folder`` crops, scales, flips and colour-shifts a few public-domain photos
shipped with packer into ImageNet-like files (shorter side 300-500 px, quality 75-95).
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from PIL import Image, ImageChops, ImageEnhance, ImageFilter

PHOTOS = Path(__file__).with_name("photos")


def _photos() -> List[Image.Image]:
    return [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg"))]


def make_image(rng: random.Random, photos: List[Image.Image]) -> bytes:
    """One JPEG: a random crop of a random photo, resized to ImageNet-like size."""
    base = rng.choice(photos)
    short = rng.randint(300, 500)
    aspect = rng.choice([4 / 3, 3 / 2, 1.0, 16 / 9, 3 / 4])
    w, h = (round(short * aspect), short) if aspect >= 1 else (short, round(short / aspect))
    # Crop a region of the photo between 45% and 100% of its size with the target aspect.
    bw, bh = base.size
    r, frac = w / h, rng.uniform(0.45, 1.0)
    cw, ch = (bh * r, bh) if bw / bh > r else (bw, bw / r)
    cw, ch = max(1, min(bw, round(cw * frac))), max(1, min(bh, round(ch * frac)))
    x, y = rng.randint(0, bw - cw), rng.randint(0, bh - ch)
    im = base.crop((x, y, x + cw, y + ch)).resize((w, h), Image.BICUBIC)
    if rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    im = ImageEnhance.Color(im).enhance(rng.uniform(0.6, 1.4))
    im = ImageEnhance.Brightness(im).enhance(rng.uniform(0.75, 1.25))
    # Upscaled crops are softer than camera photos; restore some detail so files and decode
    # cost land where real photos do (~50-110 KB for 500x375 at quality ~90).
    im = im.filter(ImageFilter.UnsharpMask(radius=2, percent=rng.randint(100, 200), threshold=1))
    grain = _noise(w, h, rng.uniform(3, 6), rng.getrandbits(63))  # sensor noise, centred on 128
    im = ImageChops.add(im, Image.merge("RGB", [grain] * 3), offset=-128)
    out = io.BytesIO()
    im.save(out, "JPEG", quality=rng.randint(75, 95))
    return out.getvalue()


def _noise(w: int, h: int, sigma: float, seed: int) -> Image.Image:
    # Not Image.effect_noise: it draws from C rand(), which no seed of ours controls.
    import torch
    g = torch.Generator().manual_seed(seed)
    n = (torch.randn(h, w, generator=g) * sigma + 128).clamp_(0, 255).to(torch.uint8)
    return Image.frombytes("L", (w, h), ctypes.string_at(n.data_ptr(), n.numel()))  # no numpy needed


def make_image_folder(root: os.PathLike, *, images: int = 200, classes: int = 10,
                      seed: int = 0, workers: int = 1, progress: bool = False) -> Path:
    """Write an ImageFolder-layout tree ``root/class_XX/img_XXXXX.jpg`` of realistic JPEGs.

    The same (images, classes, seed) give the same files whatever ``workers`` is.
    """
    from tqdm.auto import tqdm
    root = Path(root)
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    jobs = [(str(root / f"class_{i % classes:02d}" / f"img_{i:05d}.jpg"), seed, i)
            for i in range(images)]
    bar = tqdm(total=images, disable=not progress, unit="img", desc="making images")
    if workers > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(workers) as pool:
            for _ in pool.imap_unordered(_make_one, jobs, chunksize=16):
                bar.update(1)
    else:
        for job in jobs:
            _make_one(job)
            bar.update(1)
    bar.close()
    return root


_PHOTOS: List[Image.Image] = []


def _make_one(job) -> None:
    path, seed, i = job
    if not _PHOTOS:
        import torch
        torch.set_num_threads(1)  # one pool process per core: torch's own threads only contend
        _PHOTOS.extend(_photos())
    Path(path).write_bytes(make_image(random.Random(seed * 1_000_003 + i), _PHOTOS))


# -- the demo run --------------------------------------------------------------------------------

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

    @property
    def ratio(self) -> float:
        """Packed loader images/s over folder loader images/s."""
        return self.packed_images_per_s / self.folder_images_per_s if self.folder_images_per_s else float("nan")

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def report(self) -> str:
        lines = [f"packer demo: {self.images} images in {self.classes} classes; {self.workers} "
                 f"loader worker{'' if self.workers == 1 else 's'}, batch {self.batch_size}, "
                 f"crop {self.size}; {self.device}"]
        w = max(len(s.name) for s in self.steps) if self.steps else 0
        lines += [f"  {s.name:<{w}}  {s.seconds:6.1f} s  {s.detail}" for s in self.steps]
        lines.append(f"  {'total':<{w}}  {self.seconds:6.1f} s")
        lines.append(f"packed loader {self.packed_images_per_s:,.0f} images/s vs folder loader "
                     f"{self.folder_images_per_s:,.0f} images/s: {self.ratio:.2f}x (after each "
                     f"worker's first batch)")
        lines.append("Both decode the same JPEGs (DecodeRandomResizedCrop) through the same "
                     "make_loader settings; here every byte is in RAM, so decoding bounds both "
                     "and about 1x is expected. Packing pays where reading is the limit (cold "
                     "or network disks, millions of files): measure yours with "
                     "`packer bench DST --folder SRC` (docs/tuning.md).")
        lines += [f"Note: {n}" for n in self.notes]
        if self.dir is None:
            lines.append("Nothing was kept (temporary folder and staged copy removed). Keep the data "
                         "with `packer demo DIR`.")
        else:
            d = self.dir
            lines.append(f"Kept in {d}: images/ (the source folder) and packed/ (the dataset); "
                         f"the staged RAM copy was removed.")
            lines.append(f"Inspect it: packer info {d / 'packed'}")
            lines.append(f"Train from it (scripts/ in packer's repository): python "
                         f"scripts/train_example.py --data {d / 'packed'} --epochs 2"
                         + ("" if self.device.startswith("cuda") else " --cpu --model tiny --image-size 128 --batch-size 32"))
        return "\n".join(lines)


def demo_images(workers: int, batch_size: int = 64) -> int:
    """The default image count: ``DEMO_IMAGES``, or more on many cores, so that each loader
    worker makes several batches (a rate measured over one wave of batches is start-up)."""
    return max(DEMO_IMAGES, DEMO_BATCHES_PER_WORKER * batch_size * max(1, workers))


def run_demo(dir: Optional[os.PathLike] = None, *, images: Optional[int] = None,
             classes: int = DEMO_CLASSES, workers: Optional[int] = None, batch_size: int = 64,
             size: int = 224, stage_dir: Optional[os.PathLike] = "/dev/shm", rounds: int = 2,
             seed: int = 0, progress: bool = True,
             on_step: Optional[Callable[[str], None]] = None) -> DemoResult:
    """The whole job on generated data, no downloads: make, build, verify, stage, read.

    Makes ``images`` photo-like JPEGs, packs them, verifies every record, stages the dataset
    to ``stage_dir`` (``/dev/shm`` when it exists; ``None`` skips staging), then reads
    epochs through the plain folder loader and the packed loader in turn (``PackedDataset``
    + ``PackedSampler`` + ``make_loader``, + ``CUDAPrefetcher`` for both when a GPU is
    present) and returns their rates with each step's time. Both loaders decode the same
    files with the same decoder and DataLoader settings: only the source of the bytes
    differs.

    Args:
        images: default ``demo_images(workers, batch_size)``: 640 on a few cores, more on many.
        dir: keep everything here (``images/``, ``packed/``); it must be new, empty, or an
            earlier demo's folder. ``None``: a temporary folder, removed at the end.
        workers: processes for making/building and DataLoader workers [default: usable cores].
        rounds: epochs per loader, interleaved; the best rate of each is reported.
        on_step: called with each step's name as it starts (the CLI echoes it).

    The temporary folder and the staged copy are removed however the run ends (error,
    Ctrl-C). Raises ``PackerError`` for an unusable ``dir`` or a dataset that fails to verify.
    """
    import shutil
    import tempfile
    import time

    import torch

    from .benchphases import FolderDataset
    from .build import build, default_workers
    from .dataset import PackedDataset
    from .errors import PackerError
    from .imaging import DecodeRandomResizedCrop
    from .inspect import verify
    from .loader import default_num_workers
    from .sampler import PackedSampler
    from .stage import stage, unstage

    make_workers = workers if workers is not None else default_workers()
    load_workers = workers if workers is not None else default_num_workers()
    if images is None:
        images = demo_images(load_workers, batch_size)
    if images < classes or classes < 1:
        raise PackerError(f"the demo needs at least one image per class, got {images} images "
                          f"for {classes} classes")
    if batch_size < 1 or size < 16 or rounds < 1:
        raise PackerError(f"batch size and rounds must be >= 1 and crop size >= 16, got "
                          f"{batch_size}, {rounds}, {size}")
    cuda = torch.cuda.is_available()
    res = DemoResult(dir=Path(dir) if dir is not None else None, images=images, classes=classes,
                     workers=load_workers, batch_size=batch_size, size=size,
                     device=f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
                     if cuda else "cpu (no CUDA)")
    work = _demo_dir(res.dir) if res.dir is not None else Path(tempfile.mkdtemp(prefix="packer-demo-"))
    staged: Optional[Path] = None

    def step(name: str):
        if on_step is not None:
            on_step(name)
        return time.perf_counter()

    try:
        t = step("make images")
        with _one_thread_children():
            src = make_image_folder(work / "images", images=images, classes=classes, seed=seed,
                                    workers=make_workers, progress=progress)
        nbytes = sum(p.stat().st_size for p in src.glob("*/*.jpg"))
        res.steps.append(DemoStep("make images", time.perf_counter() - t,
                                  f"{images} photo-like JPEGs, {nbytes / 1e6:.1f} MB "
                                  f"({nbytes / images / 1e3:.0f} KB each) in {src}"))

        t = step("build")
        built = build(src, work / "packed", workers=make_workers, progress=progress)
        res.steps.append(DemoStep("build", time.perf_counter() - t, f"{built.summary()}"))

        t = step("verify")
        rep = verify(work / "packed", progress=progress)
        if not rep.ok:
            raise PackerError(f"the demo dataset failed to verify: {rep.problems[0]} "
                              f"({len(rep.problems)} problem(s))")
        res.steps.append(DemoStep("verify", time.perf_counter() - t,
                                  f"OK: {rep.checked_shards} shard(s), {rep.checked_records} records"))

        read_from = work / "packed"
        if stage_dir is not None and os.path.isdir(stage_dir) and os.access(stage_dir, os.W_OK):
            t = step("stage")
            staged = Path(tempfile.mkdtemp(prefix="packer-demo-", dir=stage_dir))
            try:
                sres = stage(work / "packed", staged, progress=progress)
            except PackerError as e:  # e.g. too little RAM: the demo goes on from the disk copy
                res.notes.append(f"not staged: {e}")
            else:
                read_from = staged
                res.staged_to = staged
                res.steps.append(DemoStep("stage", time.perf_counter() - t,
                                          f"{sres.bytes_total / 1e6:.1f} MB -> {staged} "
                                          f"({sres.fstype or 'unknown filesystem'}, verified)"))
        elif stage_dir is not None:
            res.notes.append(f"{stage_dir} is missing or not writable: not staged")

        # Interleaved epochs, best of ``rounds`` per loader: other work on the machine slows
        # one epoch or another, and the least disturbed one is closest to the real rate.
        decode = DecodeRandomResizedCrop(size)
        folder = FolderDataset(src, decode=decode)
        packed = PackedDataset(read_from, decode=decode)
        sampler = PackedSampler(packed, seed=seed)
        took = {"folder loader": 0.0, "packed loader": 0.0}
        best = {"folder loader": 0.0, "packed loader": 0.0}
        try:
            for r in range(rounds):
                for name, ds, smp in (("folder loader", folder, None),
                                      ("packed loader", packed, sampler)):
                    t = step(name) if r == 0 else time.perf_counter()
                    if smp is not None:
                        smp.set_epoch(r)
                    n, sec = _epoch(ds, smp, batch_size, load_workers, cuda, progress,
                                    f"{name} {r + 1}/{rounds}")
                    best[name] = max(best[name], n / sec)
                    took[name] += time.perf_counter() - t
        finally:
            packed.reader.close()
        res.folder_images_per_s = best["folder loader"]
        res.packed_images_per_s = best["packed loader"]
        prefetch = " + CUDAPrefetcher" if cuda else ""
        where = "staged copy" if read_from == staged else "shards"
        runs = f"best of {rounds} epochs" if rounds > 1 else "one epoch"
        res.steps.append(DemoStep("folder loader", took["folder loader"],
                                  f"{best['folder loader']:,.0f} images/s ({runs}): ImageFolder-"
                                  f"style, a file per image{prefetch}"))
        res.steps.append(DemoStep("packed loader", took["packed loader"],
                                  f"{best['packed loader']:,.0f} images/s ({runs}): PackedDataset "
                                  f"({where}) + PackedSampler{prefetch}"))
        return res
    finally:
        if staged is not None:
            try:
                unstage(staged)
            except PackerError:
                pass
            shutil.rmtree(staged, ignore_errors=True)  # stage failed early: whatever is there is ours
        if res.dir is None:
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _one_thread_children():
    """Processes spawned inside start with one OpenMP thread (unless the user chose a number).

    Image makers run torch ops on small arrays; with a thread per core in each of N
    processes, OpenMP's spinning threads burn about as much CPU as the work itself."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def _demo_dir(d: Path) -> Path:
    """``d`` ready for a demo: new, empty, or an earlier demo's (whose outputs are replaced)."""
    import shutil
    from .errors import PackerError
    if d.exists() and not d.is_dir():
        raise PackerError(f"{d} is not a folder; give the demo a new or empty folder")
    if d.is_dir() and any(d.iterdir()):
        if not (d / DEMO_MARKER).is_file():
            raise PackerError(f"{d} is not empty and was not made by `packer demo`; give the demo "
                              f"a new or empty folder (it writes images/ and packed/ there)")
        for sub in ("images", "packed"):
            shutil.rmtree(d / sub, ignore_errors=True)
    d.mkdir(parents=True, exist_ok=True)
    (d / DEMO_MARKER).write_text("made by `packer demo`; a re-run replaces images/ and packed/\n")
    return d


def _epoch(dataset, sampler, batch_size: int, workers: int, cuda: bool, progress: bool,
           desc: str) -> Tuple[int, float]:
    """(images, seconds) of one epoch of ``make_loader`` over ``dataset`` (through
    ``CUDAPrefetcher`` onto the GPU when there is one), in the steady state.

    The first wave of batches (one per worker) is read but not timed: it pays for starting
    the workers, which would otherwise dominate a short epoch on a many-core machine. An
    epoch too short for that is timed whole."""
    import time

    import torch
    from tqdm.auto import tqdm

    from .loader import make_loader
    loader = make_loader(dataset, batch_size, sampler=sampler, num_workers=workers,
                         persistent_workers=False)
    batches = loader
    if cuda:
        from .prefetch import CUDAPrefetcher
        batches = CUDAPrefetcher(loader)
    skip = max(1, workers) if len(loader) > max(1, workers) else 0
    total = timed = seen = 0
    t0 = t_start = time.perf_counter()
    with tqdm(total=len(dataset), unit="img", desc=desc, disable=not progress, leave=False) as bar:
        for images, _ in batches:
            seen += 1
            total += images.shape[0]
            if seen > skip:
                timed += images.shape[0]
            elif seen == skip:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            bar.update(images.shape[0])
        if cuda:
            torch.cuda.synchronize()
    end = time.perf_counter()
    return (timed, end - t0) if skip else (total, end - t_start)
