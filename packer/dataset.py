"""``PackedDataset``: a drop-in for ``torchvision.datasets.ImageFolder`` over packed shards.

Same ``classes``, ``class_to_idx``, ``targets`` and pixels (``Image.open(f).convert("RGB")``),
so a training script changes one line. Nothing per-sample lives in Python objects: labels
are one int32 array, shard offsets a short list, so forked workers' memory stays flat.
"""
from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Tuple

from torch.utils.data import Dataset

from .decode import open_image
from .reader import ShardReader, read_labels


class PackedDataset(Dataset):
    """Map-style dataset over every shard of a packed dataset.

    Args:
        root: the dataset folder (built by ``packer build``, or staged by ``packer stage``).
        transform / target_transform: applied to the sample / target, as in torchvision.
        decode: turns stored image bytes into the sample. Default: a PIL RGB image exactly
            as ImageFolder's loader gives. Pass ``DecodeRandomResizedCrop(224)`` or
            ``DecodeCenterCrop(224)`` for uint8 tensors decoded at reduced size (the fast
            path for ``make_loader``), or any ``bytes -> sample`` callable.
        exif_orientation: rotate by the EXIF tag (ImageFolder does not, hence off).
        verify_crc: check each record's CRC-32 as it is read (a ``FormatError`` names a
            damaged record), for storage one does not trust; off by default (``packer
            verify`` checks every record once).
    """

    def __init__(self, root: os.PathLike, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None, *,
                 decode: Optional[Callable[[bytes], Any]] = None,
                 exif_orientation: bool = False, verify_crc: bool = False):
        self.root = os.fspath(root)
        self.reader = ShardReader(root, verify_crc=verify_crc)
        self.manifest = self.reader.manifest
        self.transform = transform
        self.target_transform = target_transform
        self.decode = decode
        self.exif_orientation = exif_orientation
        self.classes: List[str] = list(self.manifest["classes"])
        self.class_to_idx = dict(self.manifest["class_to_idx"])
        self._labels = read_labels(root, self.manifest)  # array('i'): one buffer, not N objects

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def targets(self) -> List[int]:
        """Labels in index order (a fresh list, like ImageFolder's; read without decoding)."""
        return self._labels.tolist()

    def target(self, index: int) -> int:
        return self._labels[index]

    def load(self, index: int) -> dict:
        """The raw record: ``image`` bytes, ``label``, ``path``, ``width``, ``height``..."""
        return self.reader.record(index)

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        return to_sample(self.load(index), self.decode, self.transform, self.target_transform,
                         self.exif_orientation)

    def __repr__(self) -> str:
        return (f"PackedDataset({self.root!r}, {len(self)} records, {len(self.classes)} classes, "
                f"{len(self.reader.paths)} shards)")


def to_sample(rec: dict, decode: Optional[Callable] = None, transform: Optional[Callable] = None,
              target_transform: Optional[Callable] = None,
              exif_orientation: bool = False) -> Tuple[Any, Any]:
    """(sample, target) from a record: decode (ImageFolder's PIL RGB by default), then the
    transforms. Shared by the map-style and the streaming datasets."""
    if decode is not None:
        sample = decode(rec["image"])
    else:
        sample = open_image(rec["image"], exif_orientation=exif_orientation)
    target = rec["label"]
    if transform is not None:
        sample = transform(sample)
    if target_transform is not None:
        target = target_transform(target)
    return sample, target
