"""``FolderDataset``: the ImageFolder-style baseline that the demo and benchmarks compare with."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from torch.utils.data import Dataset

from ..source import scan_folder


class FolderDataset(Dataset):
    """What ``torchvision.datasets.ImageFolder`` does (same scan rule, one file read per
    sample), with packer's ``decode`` hook, so the folder loader decodes exactly as the
    packed one does and only the source of the bytes differs."""

    def __init__(self, root: os.PathLike, decode: Callable[[bytes], object]):
        src = scan_folder(root)
        self.root, self.classes, self.decode = Path(root), src.classes, decode
        self.samples = [(os.path.join(root, rel), label) for rel, label in src.entries]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return self.decode(f.read()), label
