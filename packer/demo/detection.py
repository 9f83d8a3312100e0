"""``packer demo --detection``: the whole job on a generated COCO detection set, with the
packed loader compared with a CocoDetection-style folder loader, for speed and for targets.

Detection adds what classification lacks: a target per image whose boxes must follow the
image through decoding. So besides the two rates, the demo checks that every image's boxes,
labels and image id come out of the packed loader exactly as out of the folder loader, both
decoding with the same ``DecodeLetterbox`` (which moves the boxes).
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from tqdm.auto import tqdm

from .._util.system import human_size, usable_cores
from ..sources.coco import Coco
from ..writing.builder import build
from ..reading.dataset import PackedDataset
from ..transforms.decode import DecodeLetterbox
from ..errors import PackerError
from ..info import verify
from ..loading.collate import collate_detection
from ..loading.loader import default_num_workers, make_loader
from ..loading.prefetch import CUDAPrefetcher
from ..reading.sampler import PackedSampler
from ..staging import unstage
from .folder import CocoFolderDataset
from .run import DemoResult, DemoStep, Steps, demo_dir, stage_copy
from .scenes import make_detection_folder

DETECTION_IMAGES = 512      # the least: ~32 MB of scenes, made in ~13 s on one core
DETECTION_BATCHES_PER_WORKER = 4
Targets = Dict[int, Tuple[torch.Tensor, torch.Tensor]]   # image id -> (boxes, labels)


@dataclass
class DetectionDemoResult(DemoResult):
    """What ``run_detection_demo`` did and measured; ``report()`` is what the CLI prints.
    ``classes`` counts the categories; ``images_checked`` the images whose targets both
    loaders gave, ``mismatched`` the image ids whose targets differ (or that one missed)."""
    objects: int = 0
    images_checked: int = 0
    mismatched: List[int] = field(default_factory=list)

    @property
    def targets_equal(self) -> bool:
        return self.images_checked == self.images and not self.mismatched

    def report(self) -> str:
        lines = [f"packer demo --detection: {self.images} scenes, {self.objects} objects in "
                 f"{self.classes} categories; {self.workers} loader worker"
                 f"{'' if self.workers == 1 else 's'}, batch {self.batch_size}, letterbox "
                 f"{self.size}; {self.device}"]
        w = max(len(s.name) for s in self.steps) if self.steps else 0
        lines += [f"  {s.name:<{w}}  {s.seconds:6.1f} s  {s.detail}" for s in self.steps]
        lines.append(f"  {'total':<{w}}  {self.seconds:6.1f} s")
        lines.append(f"packed loader {self.packed_images_per_s:,.0f} images/s vs COCO folder "
                     f"loader {self.folder_images_per_s:,.0f} images/s: {self.ratio:.2f}x "
                     f"(after each worker's first batch)")
        if self.targets_equal:
            lines.append(f"Targets: equal for all {self.images} images (boxes, labels, image_id "
                         f"after DecodeLetterbox({self.size}) moved the boxes).")
        else:
            lines.append(f"Targets: DIFFER for {len(self.mismatched)} image(s) (image ids "
                         f"{self.mismatched[:5]}); {self.images_checked} of {self.images} "
                         f"compared.")
        lines.append("Both decode the same JPEGs with DecodeLetterbox through the same "
                     "DataLoader settings; here every byte is in RAM, so decoding bounds both "
                     "and about 1x is expected. Packing pays where reading is the limit (a "
                     "cold or slow disk: docs/benchmarks.md has the measurement).")
        lines += [f"Note: {n}" for n in self.notes]
        if self.dir is None:
            lines.append("Nothing was kept (temporary folder and staged copy removed). Keep the "
                         "data with `packer demo --detection DIR`.")
        else:
            d = self.dir
            lines.append(f"Kept in {d}: coco/ (images/, annotations.json, YOLO labels/) and "
                         f"packed/ (the dataset); the staged RAM copy was removed.")
            lines.append(f"Inspect it: packer info {d / 'packed'}")
            lines.append(f"Train from it: PackedDataset({str(d / 'packed')!r}, "
                         f"decode=DecodeLetterbox({self.size})) and packer.make_loader")
        return "\n".join(lines)


def detection_demo_images(workers: int, batch_size: int = 16) -> int:
    """The default scene count: ``DETECTION_IMAGES``, or enough for each loader worker to
    make several batches on many cores."""
    return max(DETECTION_IMAGES, DETECTION_BATCHES_PER_WORKER * batch_size * max(1, workers))


def run_detection_demo(dir: Optional[os.PathLike] = None, *, images: Optional[int] = None,
                       workers: Optional[int] = None, batch_size: int = 16, size: int = 640,
                       stage_dir: Optional[os.PathLike] = "/dev/shm", rounds: int = 2,
                       seed: int = 0, progress: bool = True,
                       on_step: Optional[Callable[[str], None]] = None) -> DetectionDemoResult:
    """Make COCO scenes, build them (``Coco``), verify, stage, then read epochs through
    ``CocoFolderDataset`` and ``PackedDataset`` + ``PackedSampler`` in turn (both with
    ``DecodeLetterbox(size)``, the same ``make_loader`` settings, + ``CUDAPrefetcher`` when
    a GPU is present) and compare their rates and every image's targets.

    ``dir``, ``stage_dir``, ``rounds`` and ``on_step`` are as in ``run_demo``: with ``dir``
    the scenes (``dir/coco``) and the dataset (``dir/packed``) are kept; without, nothing
    is left behind, however the run ends.
    """
    make_workers = workers if workers is not None else usable_cores()
    load_workers = workers if workers is not None else default_num_workers()
    images = images if images is not None else detection_demo_images(load_workers, batch_size)
    if images < 1 or batch_size < 1 or size < 16 or rounds < 1:
        raise PackerError(f"images, batch size and rounds must be >= 1 and the letterbox >= 16, "
                          f"got {images}, {batch_size}, {rounds}, {size}")
    cuda = torch.cuda.is_available()
    device = (f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})" if cuda
              else "cpu (no CUDA)")
    res = DetectionDemoResult(dir=Path(dir) if dir is not None else None, images=images,
                              classes=0, workers=load_workers, batch_size=batch_size, size=size,
                              device=device)
    work = (demo_dir(res.dir, ("coco", "packed")) if res.dir is not None
            else Path(tempfile.mkdtemp(prefix="packer-demo-")))
    steps = Steps(res, on_step)
    try:
        coco = make_build_verify(steps, work, images, seed, make_workers, progress)
        read_from = work / "packed"
        if stage_dir is not None and os.path.isdir(stage_dir) and os.access(stage_dir, os.W_OK):
            read_from = stage_copy(steps, read_from, stage_dir, progress)
        elif stage_dir is not None:
            res.notes.append(f"{stage_dir} is missing or not writable: not staged")
        compare_loaders(steps, coco, read_from, rounds, seed, cuda, progress)
        return res
    finally:
        if res.staged_to is not None:
            try:
                unstage(res.staged_to)
            except PackerError:
                pass
            shutil.rmtree(res.staged_to, ignore_errors=True)
        if res.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def make_build_verify(steps: Steps, work: Path, images: int, seed: int, workers: int,
                      progress: bool) -> Path:
    """The scenes (``work/coco``) and the dataset built from them (``work/packed``)."""
    t = steps.start("make scenes")
    coco = make_detection_folder(work / "coco", images, seed=seed)
    nbytes = sum(p.stat().st_size for p in (coco / "images").glob("*.jpg"))
    steps.done("make scenes", t, f"{images} photo scenes with pasted objects, "
                                 f"{human_size(nbytes)}, COCO annotations.json in {coco}")
    t = steps.start("build --coco")
    built = build(Coco(coco / "images", coco / "annotations.json"), work / "packed",
                  workers=workers, progress=progress)
    steps.done("build --coco", t, built.summary())
    steps.res.classes = len(built.manifest["classes"])
    t = steps.start("verify")
    rep = verify(work / "packed", progress=progress)
    if not rep.ok:
        raise PackerError(f"the demo dataset failed to verify: {rep.problems[0]} "
                          f"({len(rep.problems)} problem(s))")
    steps.done("verify", t, f"OK: {rep.checked_shards} shard(s), {rep.checked_records} records")
    return coco


def compare_loaders(steps: Steps, coco: Path, read_from: Path, rounds: int, seed: int,
                    cuda: bool, progress: bool) -> None:
    """Interleaved epochs, best of ``rounds`` per loader; targets recorded in the first."""
    res = steps.res
    decode = DecodeLetterbox(res.size)
    folder = CocoFolderDataset(coco / "images", coco / "annotations.json", decode=decode)
    packed = PackedDataset(read_from, decode=decode)
    res.objects = sum(len(s[2]) for s in folder.samples)
    loaders = {"folder loader": (folder, None),
               "packed loader": (packed, PackedSampler(packed, seed=seed))}
    took = {name: 0.0 for name in loaders}
    best = {name: 0.0 for name in loaders}
    seen: Dict[str, Targets] = {name: {} for name in loaders}
    try:
        for r in range(rounds):
            for name, (ds, sampler) in loaders.items():
                t = steps.start(name) if r == 0 else time.perf_counter()
                if sampler is not None:
                    sampler.set_epoch(r)
                loader = detection_loader(ds, res.batch_size, res.workers, sampler=sampler)
                batches = recording(loader, seen[name]) if r == 0 else loader
                if cuda:
                    batches = CUDAPrefetcher(batches)
                n, sec = loader_rate(batches, res.workers, cuda=cuda, total=len(ds),
                                     progress=progress, desc=f"{name} {r + 1}/{rounds}")
                best[name] = max(best[name], n / sec)
                took[name] += time.perf_counter() - t
    finally:
        packed.reader.close()
    res.folder_images_per_s, res.packed_images_per_s = best["folder loader"], best["packed loader"]
    res.images_checked, res.mismatched = compare_targets(seen["folder loader"],
                                                         seen["packed loader"])
    to_gpu = " + CUDAPrefetcher" if cuda else ""
    where = "staged copy" if read_from == res.staged_to else "shards"
    runs = f"best of {rounds} epochs" if rounds > 1 else "one epoch"
    res.steps.append(DemoStep("folder loader", took["folder loader"],
                              f"{best['folder loader']:,.0f} images/s ({runs}): CocoDetection-"
                              f"style, JSON + a file per image{to_gpu}"))
    res.steps.append(DemoStep("packed loader", took["packed loader"],
                              f"{best['packed loader']:,.0f} images/s ({runs}): PackedDataset "
                              f"({where}) + PackedSampler{to_gpu}"))


def detection_loader(dataset, batch_size: int, workers: int, *, sampler=None, **kwargs):
    """``make_loader`` with the detection collate for any detection dataset (``make_loader``
    picks it by itself only for a ``PackedDataset``), one epoch's workers."""
    kwargs.setdefault("persistent_workers", False)
    return make_loader(dataset, batch_size, sampler=sampler, num_workers=workers,
                       collate_fn=functools.partial(collate_detection, channels_last=True),
                       **kwargs)


def recording(loader: Iterable, into: Targets):
    """``loader``'s batches, each image's (boxes, labels) noted by image id on the way (on
    the CPU, before any copy to the GPU)."""
    for batch in loader:
        for t in batch[1]:
            into[int(t["image_id"])] = (t["boxes"].as_subclass(torch.Tensor), t["labels"])
        yield batch


def compare_targets(want: Targets, got: Targets) -> Tuple[int, List[int]]:
    """(images both have, sorted ids that differ or that only one has)."""
    bad = sorted(set(want) ^ set(got))
    both = set(want) & set(got)
    for i in sorted(both):
        (wb, wl), (gb, gl) = want[i], got[i]
        if not (torch.equal(wb, gb) and torch.equal(wl, gl)):
            bad.append(i)
    return len(both), sorted(bad)


def loader_rate(batches: Iterable, workers: int, *, cuda: bool = False,
                total: Optional[int] = None, progress: bool = False,
                desc: str = "") -> Tuple[int, float]:
    """(images, seconds) of one pass over detection ``batches`` ((images, targets)), in the
    steady state: the first wave (one batch per worker) pays for starting the workers and
    is not timed; a pass too short for that is timed whole."""
    skip = max(1, workers)
    count = timed = seen = 0
    t0 = t_start = time.perf_counter()
    with tqdm(total=total, unit="img", desc=desc, disable=not progress, leave=False) as bar:
        for _, targets in batches:
            seen += 1
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
