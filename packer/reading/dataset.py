"""``PackedDataset``: a drop-in for torchvision's ImageFolder (and wrapped CocoDetection) over
packed shards; per-sample data lives in compact arrays, so forked workers' memory stays flat."""
from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from typing import Any, Callable, Collection, List, Optional, Tuple, Union

import torch
from torch.utils.data import Dataset

from ..transforms.boxes import crop_boxes
from ..transforms.decode import exif_tag, open_image
from ..format.fields import PER_OBJECT
from ..format.manifest import dataset_schema
from .reader import ShardReader, record_index
from ..format.tables import read_column, read_labels, read_paths
from ..errors import PackerError
from ..sources.folder import find_classes
from ..storage import ShardCache, is_url, redact
from .targets import TargetMaker, oriented, wrap_boxes


class PackedDataset(Dataset):
    """Map-style dataset over all shards of a packed dataset (docs/loading.md, docs/torchvision.md).

    Args:
        root: the dataset folder or URL (``cache_dir`` / ``cache_limit`` / ``storage_options``
            then go to its ``packer.storage.ShardCache``).
        transform / target_transform / transforms: as in torchvision (``transforms`` is joint,
            applied after the other two).
        decode: stored bytes -> sample. Default: ImageFolder's PIL RGB image; a ``Decode*``
            class gives uint8 tensors at reduced size (the fast path for ``make_loader``).
        exif_orientation: rotate by the EXIF tag (ImageFolder does not); boxes and masks turn too;
            the default decode only (a ValueError with a decode hook).
        verify_crc: check each record's CRC-32 as it is read (a ``FormatError`` if damaged).
        target_keys: detection: the target dict's keys (default ``boxes``, ``labels``,
            ``image_id``; ``"all"``: every stored field), as ``wrap_dataset_for_transforms_v2``.
        target_fields: return these stored fields (one name: that value) instead of the target.
        masks: COCO builds: add ``masks`` made from the stored segmentations.
        min_visible: with a crop decoder, keep a box when this fraction of it is in the crop."""

    def __init__(self, root: os.PathLike, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None, *,
                 decode: Optional[Callable[[bytes], Any]] = None,
                 exif_orientation: bool = False, verify_crc: bool = False,
                 transforms: Optional[Callable] = None,
                 target_fields: Union[None, str, Sequence[str]] = None, masks: bool = False,
                 min_visible: float = 0.25, cache_dir: Optional[os.PathLike] = None,
                 cache_limit: Union[int, str, None] = None, storage_options: Optional[dict] = None,
                 target_keys: Union[None, str, Collection[str]] = None):
        cache = None
        if is_url(root):
            if cache_dir is None:
                raise PackerError(f"reading {redact(root)} needs cache_dir= (a node-local folder "
                                  f"for its shards), or stage it first: packer.stage(URL, TARGET)")
            cache = ShardCache(root, cache_dir, cache_limit, storage_options)
        self.root = os.fspath(root) if cache is None else os.fspath(cache.root)  # its side tables
        self.reader = ShardReader(root, verify_crc=verify_crc, cache=cache)
        self.manifest = self.reader.manifest
        self.transform, self.target_transform = transform, target_transform
        self.transforms, self.decode, self.exif_orientation = transforms, decode, exif_orientation
        self.schema = dataset_schema(self.manifest)
        self.make_target = TargetMaker(self.schema, target_fields=target_fields,
                                       target_keys=target_keys, masks=masks)
        if self.make_target.masks and decode is not None and hasattr(decode, "decode_crop"):
            raise ValueError("masks (masks=True, or in target_keys) with a crop decoder are not "
                             "supported: decode to PIL (decode=None) and crop with "
                             "torchvision.transforms.v2, which moves masks with the image")
        if exif_orientation and decode is not None:  # a decode hook reads the bytes its way
            raise ValueError("exif_orientation=True applies to the default decode (decode=None); "
                             "a decode hook gets the stored bytes as they are")
        self.min_visible = float(min_visible)
        self.classes: List[str] = list(self.manifest["classes"])
        self.class_to_idx = dict(self.manifest["class_to_idx"])
        self.categories = list(self.manifest.get("categories", []))
        self._labels = read_labels(self.root, self.manifest)  # array('i'): one buffer
        self._samples: Optional[Samples] = None
        self._sizes: Optional[Tuple[array, array]] = None

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def task(self) -> str:
        """``classification``, ``detection`` or ``generic`` (from the manifest's schema)."""
        return self.schema["task"]

    @property
    def targets(self) -> List[int]:
        """Labels in index order (a fresh list, like ImageFolder's; read without decoding)."""
        if self.manifest.get("labels") is None:
            raise AttributeError(f"{self.root} has no class labels (task {self.task!r}); its "
                                 f"fields: {', '.join(f['name'] for f in self.schema['fields'])}")
        return self._labels.tolist()

    def target(self, index: int) -> int:
        return self._labels[index]

    @property
    def samples(self) -> "Samples":
        """``(path, class_index)`` per record, as ImageFolder's ``samples`` (``-1``: no label)."""
        if self._samples is None:
            table = read_paths(self.root, self.manifest)
            if table is None:  # format < 1.2: no paths table
                table = [self.reader.record(i)["path"] for i in range(len(self))]
            self._samples = Samples(self.manifest.get("source") or "", table, self._labels)
        return self._samples

    imgs = samples  # ImageFolder's alias

    def find_classes(self, directory: Optional[os.PathLike] = None) -> Tuple[List[str], dict]:
        """``(classes, class_to_idx)``: this dataset's, or ImageFolder's for ``directory``."""
        if directory is None:
            return list(self.classes), dict(self.class_to_idx)
        found = find_classes(directory)
        return found, {c: i for i, c in enumerate(found)}

    @staticmethod
    def loader(data: bytes):
        """The default decode: ImageFolder's ``loader`` (a PIL RGB image), from stored bytes."""
        return open_image(data)

    def column(self, name: str) -> array:
        """A scalar (int, float, bool) field of every record, from its side table (no reads)."""
        return read_column(self.root, name, self.manifest)

    def aspect_ratios(self) -> torch.Tensor:
        """width / height of every image (float64), from the side tables."""
        w, h = self.sizes()
        return torch.tensor(w, dtype=torch.float64) / torch.tensor(h, dtype=torch.float64)

    def get_height_and_width(self, index: int) -> Tuple[int, int]:
        """``(height, width)`` of image ``index`` from the side tables (torchvision's API)."""
        w, h = self.sizes()
        return h[index], w[index]

    def sizes(self) -> Tuple[array, array]:
        """The width and height columns (read once: a dataset may be asked per index)."""
        if self._sizes is None:
            try:
                self._sizes = self.column("width"), self.column("height")
            except KeyError:
                raise ValueError(f"{self.root} has no width/height columns (built before "
                                 f"packer format 1.2); rebuild it to group batches by aspect "
                                 f"ratio") from None
        return self._sizes

    def load(self, index: int) -> dict:
        """The raw record: ``image`` bytes, ``path``, ``width``, ``height``, its fields..."""
        return self.reader.record(index)

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        return to_sample(self.load(index), self.decode, self.transform, self.target_transform,
                         self.exif_orientation, self.make_target, self.transforms,
                         self.min_visible)

    def __repr__(self) -> str:
        return (f"PackedDataset({self.root!r}, {len(self)} records, {len(self.classes)} classes, "
                f"{len(self.reader.paths)} shards)")


class Samples(Sequence):
    """A read-only sequence of ``(path, class_index)``, built on access from the paths table."""

    def __init__(self, source: str, paths, labels: array):
        self.source, self.paths, self.labels = source, paths, labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = record_index(index, len(self))
        label = self.labels[index] if len(self.labels) else -1
        return os.path.join(self.source, self.paths[index]), label

    def __eq__(self, other) -> bool:  # as a list: ImageFolder(...).samples == ds.samples
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to a list, which has no hash

    def __repr__(self) -> str:
        return f"<{len(self)} samples under {self.source!r}>"


def to_sample(rec: dict, decode: Optional[Callable] = None, transform: Optional[Callable] = None,
              target_transform: Optional[Callable] = None, exif_orientation: bool = False,
              make_target: Optional[Callable] = None, transforms: Optional[Callable] = None,
              min_visible: float = 0.25) -> Tuple[Any, Any]:
    """(sample, target) from a record: decode (ImageFolder's PIL RGB by default), transforms."""
    target = make_target(rec) if make_target is not None else rec["label"]
    detection = isinstance(target, dict) and getattr(make_target, "detection", False)
    if detection and "boxes" in target and decode is not None and hasattr(decode, "decode_crop"):
        sample, crop, flipped = decode.decode_crop(rec["image"])
        target = move_boxes(target, crop, decode.size, flipped, min_visible)
    elif decode is not None:
        sample = decode(rec["image"])
    else:
        sample = open_image(rec["image"], exif_orientation=exif_orientation)
        if exif_orientation and detection:  # boxes and masks (if in target_keys) turn too
            target = oriented(target, exif_tag(rec["image"]), rec["width"], rec["height"])
    if transform is not None:
        sample = transform(sample)
    if target_transform is not None:
        target = target_transform(target)
    if transforms is not None:
        sample, target = transforms(sample, target)
    return sample, target


def move_boxes(target: dict, crop, size, flipped: bool, min_visible: float) -> dict:
    """A detection target after a crop, resize and maybe flip: boxes moved and clipped,
    objects mostly cut away dropped."""
    boxes = target["boxes"].as_subclass(torch.Tensor)
    n = len(boxes)
    out, keep = crop_boxes(boxes, torch.tensor([n]), torch.tensor([crop], dtype=torch.float64),
                           size, torch.tensor([bool(flipped)]), min_visible=min_visible)
    kept = keep.nonzero().flatten().tolist()
    moved = {k: (v if k not in PER_OBJECT else v[keep] if isinstance(v, torch.Tensor) else
                 [v[i] for i in kept]) for k, v in target.items()}  # per-object values by name
    moved["boxes"] = wrap_boxes(out[keep], size)
    return moved
