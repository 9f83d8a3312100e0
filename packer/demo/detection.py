"""``packer demo --detection``: the whole job on a generated COCO set, the packed loader
compared with a CocoDetection-style folder loader for speed and for every image's targets."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .._util.system import human_size, usable_cores
from ..sources.coco import Coco
from ..reading.dataset import PackedDataset
from ..transforms.decode import DecodeLetterbox
from ..errors import PackerError
from ..loading.collate import collate_detection
from ..loading.loader import default_num_workers, make_loader
from .folder import CocoFolderDataset
from .run import (DemoResult, Steps, build_and_verify, compare_loaders, demo_images, device_name,
                  run_job)
from .scenes import make_detection_folder

DETECTION_IMAGES = 512      # the least: ~32 MB of scenes, made in ~13 s on one core
Targets = Dict[int, Tuple[torch.Tensor, torch.Tensor]]   # image id -> (boxes, labels)


@dataclass
class DetectionDemoResult(DemoResult):
    """What ``run_detection_demo`` did and measured (``report()``: what the CLI prints);
    ``mismatched``: image ids whose targets differ between the loaders."""
    objects: int = 0
    images_checked: int = 0
    mismatched: List[int] = field(default_factory=list)

    image_bytes = 70_000                # a scene: about 62 KB
    baseline = "COCO folder loader"
    command = "packer demo --detection"
    kept = "coco/ (images/, annotations.json, YOLO labels/)"
    why = ("Both decode the same JPEGs with DecodeLetterbox through the same DataLoader "
           "settings; here every byte is in RAM, so decoding bounds both and about 1x is "
           "expected. Packing pays where reading is the limit (a cold or slow disk: "
           "docs/benchmarks.md has the measurement).")

    @property
    def decode(self) -> str:
        return f"DecodeLetterbox({self.size})"

    @property
    def targets_equal(self) -> bool:
        return self.images_checked == self.images and not self.mismatched

    def title(self) -> str:
        return (f"packer demo --detection: {self.images} scenes, {self.objects} objects in "
                f"{self.classes} categories; {self.workers} loader worker"
                f"{'' if self.workers == 1 else 's'}, batch {self.batch_size}, letterbox "
                f"{self.size}; {self.device}")

    def checks(self) -> List[str]:
        if self.targets_equal:
            return [f"Targets: equal for all {self.images} images (boxes, labels, image_id "
                    f"after DecodeLetterbox({self.size}) moved the boxes)."]
        return [f"Targets: DIFFER for {len(self.mismatched)} image(s) (image ids "
                f"{self.mismatched[:5]}); {self.images_checked} of {self.images} compared."]


def detection_demo_images(workers: int, batch_size: int = 16) -> int:
    """The default scene count: ``demo_images`` with ``DETECTION_IMAGES`` at least."""
    return demo_images(workers, batch_size, DETECTION_IMAGES)


def run_detection_demo(dir: Optional[os.PathLike] = None, *, images: Optional[int] = None,
                       workers: Optional[int] = None, batch_size: int = 16, size: int = 640,
                       stage_dir: Optional[os.PathLike] = "/dev/shm", rounds: int = 2,
                       seed: int = 0, progress: bool = True,
                       on_step: Optional[Callable[[str], None]] = None) -> DetectionDemoResult:
    """Make COCO scenes, build, verify and stage them, then compare ``CocoFolderDataset`` and
    ``PackedDataset`` epochs (same ``DecodeLetterbox`` and loader settings) and every image's
    targets. Arguments as in ``run_demo``."""
    make_workers = workers if workers is not None else usable_cores()
    load_workers = workers if workers is not None else default_num_workers()
    images = images if images is not None else detection_demo_images(load_workers, batch_size)
    if images < 1 or batch_size < 1 or size < 16 or rounds < 1:
        raise PackerError(f"images, batch size and rounds must be >= 1 and the letterbox >= 16, "
                          f"got {images}, {batch_size}, {rounds}, {size}")
    res = DetectionDemoResult(dir=Path(dir) if dir is not None else None, images=images,
                              classes=0, workers=load_workers, batch_size=batch_size, size=size,
                              device=device_name())

    def make(steps: Steps, work: Path) -> Path:
        t = steps.start("make scenes")
        coco = make_detection_folder(work / "coco", images, seed=seed, workers=make_workers)
        nbytes = sum(p.stat().st_size for p in (coco / "images").glob("*.jpg"))
        steps.done("make scenes", t, f"{images} photo scenes with pasted objects, "
                                     f"{human_size(nbytes)}, COCO annotations.json in {coco}")
        manifest = build_and_verify(steps, "build --coco", Coco(coco / "images", coco / "annotations.json"),
                                    work / "packed", make_workers, progress)
        res.classes = len(manifest["classes"])
        return coco

    def compare(steps: Steps, coco: Path, read_from: Path) -> None:
        decode = DecodeLetterbox(size)
        folder = CocoFolderDataset(coco / "images", coco / "annotations.json", decode=decode)
        res.objects = sum(len(s[2]) for s in folder.samples)
        seen: Dict[str, Targets] = {"folder loader": {}, "packed loader": {}}
        compare_loaders(steps, folder, PackedDataset(read_from, decode=decode), seed,
                        lambda ds, smp: detection_loader(ds, batch_size, load_workers, sampler=smp),
                        read_from, rounds, progress, "CocoDetection-style, JSON + a file per image",
                        record=lambda name, batches: recording(batches, seen[name]))
        res.images_checked, res.mismatched = compare_targets(seen["folder loader"],
                                                             seen["packed loader"])

    return run_job(res, ("coco", "packed"), on_step, stage_dir, progress, make, compare)


def detection_loader(dataset, batch_size: int, workers: int, *, sampler=None, **kwargs):
    """``make_loader`` with the detection collate for any detection dataset (``make_loader``
    picks it by itself only for a ``PackedDataset``), one epoch's workers."""
    kwargs.setdefault("persistent_workers", False)
    return make_loader(dataset, batch_size, sampler=sampler, num_workers=workers,
                       collate_fn=functools.partial(collate_detection, channels_last=True),
                       **kwargs)


def recording(loader: Iterable, into: Targets):
    """``loader``'s batches, noting each image's (boxes, labels) by image id (on the CPU)."""
    for batch in loader:
        for t in batch[1]:
            into[int(t["image_id"])] = (t["boxes"].as_subclass(torch.Tensor), t["labels"])
        yield batch


def compare_targets(want: Targets, got: Targets) -> Tuple[int, List[int]]:
    """(images both have, sorted ids that differ or that only one has)."""
    both = set(want) & set(got)
    differ = {i for i in both if not all(map(torch.equal, want[i], got[i]))}  # boxes, labels
    return len(both), sorted(differ | (set(want) ^ set(got)))
