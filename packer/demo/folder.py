"""The baselines the demo and benchmarks compare with: ImageFolder- and CocoDetection-style."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.data import Dataset

from ..reading.dataset import move_boxes
from ..transforms.decode import open_image
from ..sources.folder import scan_folder
from ..reading.targets import wrap_boxes


class FolderDataset(Dataset):
    """``torchvision.datasets.ImageFolder`` with packer's ``decode`` hook: the folder baseline."""

    def __init__(self, root: os.PathLike, decode: Callable[[bytes], object]):
        src = scan_folder(root)
        self.root, self.classes, self.decode = Path(root), src.classes, decode
        self.samples = [(os.path.join(root, rel), label) for rel, label in src.entries]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        return self.decode(Path(path).read_bytes()), label


class CocoFolderDataset(Dataset):
    """``CocoDetection`` wrapped by ``wrap_dataset_for_transforms_v2``, with packer's ``decode``
    hook and ``PackedDataset``'s target dict: the detection baseline, differing only in where
    the bytes come from. Boxes are not clipped (torchvision does not clip them either)."""

    def __init__(self, images: os.PathLike, annotations_json: os.PathLike,
                 decode: Optional[Callable[[bytes], object]] = None, *,
                 transforms: Optional[Callable] = None, min_visible: float = 0.25):
        coco = json.loads(Path(annotations_json).read_text(encoding="utf-8"))
        files = {im["id"]: im["file_name"] for im in coco["images"]}
        objects: Dict[int, List[dict]] = {i: [] for i in files}
        for a in coco["annotations"]:
            if a["image_id"] in objects:
                objects[a["image_id"]].append(a)
        self.root, self.decode, self.transforms = Path(images), decode, transforms
        self.min_visible = float(min_visible)
        self.ids = sorted(files)
        self.samples = [(os.path.join(images, files[i]), i, objects[i]) for i in self.ids]
        self.categories = [{"id": c["id"], "name": c["name"]} for c in coco["categories"]]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, image_id, objects = self.samples[index]
        data = Path(path).read_bytes()
        target = coco_target(image_id, objects)
        if self.decode is not None and hasattr(self.decode, "decode_crop"):
            sample, crop, flipped = self.decode.decode_crop(data)
            target = move_boxes(target, crop, self.decode.size, flipped, self.min_visible)
        else:
            sample = self.decode(data) if self.decode is not None else open_image(data)
            target["boxes"] = wrap_boxes(target["boxes"], canvas_size(sample))
        if self.transforms is not None:
            sample, target = self.transforms(sample, target)
        return sample, target


def coco_target(image_id: int, objects: List[dict]) -> Dict[str, object]:
    """One image's COCO annotations as a detection target: XYWH -> XYXY in float64, then float32,
    as packer's build does (equal to the bit)."""
    xywh = torch.tensor([a["bbox"] for a in objects], dtype=torch.float64).reshape(-1, 4)
    boxes = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1).to(torch.float32)
    return {"boxes": boxes,
            "labels": torch.tensor([a["category_id"] for a in objects], dtype=torch.int64),
            "image_id": image_id,
            "area": torch.tensor([float(a.get("area", a["bbox"][2] * a["bbox"][3]))
                                  for a in objects], dtype=torch.float32),
            "iscrowd": torch.tensor([int(a.get("iscrowd", 0)) for a in objects],
                                    dtype=torch.int64)}


def canvas_size(sample) -> Tuple[int, int]:
    """(height, width) of a decoded sample: a PIL image or a (..., H, W) tensor."""
    if isinstance(sample, torch.Tensor):
        return int(sample.shape[-2]), int(sample.shape[-1])
    return sample.size[::-1]
