"""The uint8 collates ``make_loader`` batches with: images stay uint8 (4x fewer bytes than
float32) from decode to the GPU, where ``CUDAPrefetcher`` converts them."""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Callable

import torch
from torch.utils.data import default_collate, get_worker_info

from ..reading.mixture import Mixture
from .sharedbatch import SharedBatch
from .torchapi import shared_empty

__all__ = ["collate_detection", "collate_uint8", "default_collate_for"]


def collate_uint8(batch, *, channels_last: bool = True):
    """Collate samples whose images are uint8 ``(C, H, W)`` tensors into one uint8 batch
    (channels_last when asked; in a worker, straight into shared memory); the rest as
    ``default_collate`` does. PIL images are refused with a pointer to ``decode=``."""
    elem = batch[0]
    if isinstance(elem, torch.Tensor) and elem.dtype == torch.uint8 and elem.dim() == 3 \
            and not elem.is_cuda:
        return stack_images(batch, channels_last)
    again = functools.partial(collate_uint8, channels_last=channels_last)
    if isinstance(elem, Mapping):
        out = {k: again([d[k] for d in batch]) for k in elem}
        try:
            return type(elem)(out)
        except TypeError:
            return out
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return type(elem)(*(again(list(s)) for s in zip(*batch)))
    if isinstance(elem, Sequence) and not isinstance(elem, (str, bytes)):
        if any(len(s) != len(elem) for s in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        return [again(list(s)) for s in zip(*batch)]
    if type(elem).__module__.startswith("PIL."):
        raise TypeError("make_loader batches uint8 tensors, but the dataset returns PIL images: "
                        "build it with a tensor decoder, e.g. PackedDataset(root, decode="
                        "DecodeRandomResizedCrop(224)) for training or decode=DecodeCenterCrop("
                        "224) for evaluation, or end its transform with torchvision.transforms."
                        "PILToTensor() (uint8, not ToTensor)")
    return default_collate(batch)


def stack_images(images, channels_last: bool) -> torch.Tensor:
    """uint8 ``(C, H, W)`` tensors of one size as one ``(N, C, H, W)`` batch (shm in a worker)."""
    shape = images[0].shape
    for t in images:
        if t.shape != shape or t.dtype != torch.uint8:
            raise ValueError(f"cannot batch images of different sizes/dtypes ({tuple(shape)} "
                             f"uint8 and {tuple(t.shape)} {t.dtype}): decode to a fixed size, "
                             f"e.g. PackedDataset(root, decode=DecodeRandomResizedCrop(224))")
    c, h, w = shape
    size = (len(images), h, w, c) if channels_last else (len(images), c, h, w)
    out = shared_empty(size) if get_worker_info() is not None else torch.empty(size, dtype=torch.uint8)
    if channels_last:
        torch.stack([t.permute(1, 2, 0) for t in images], out=out)
        return out.permute(0, 3, 1, 2)  # logical NCHW, channels_last strides
    return torch.stack(images, out=out)


def collate_detection(batch, *, channels_last: bool = True):
    """``(images, targets)`` for detection: targets a list of dicts (crossing from a worker as one
    ``SharedBatch``); images one uint8 batch when they share a size, else a list."""
    images = [b[0] for b in batch]
    share = SharedBatch if get_worker_info() is not None else list
    targets = share(b[1] for b in batch)
    first = images[0]
    if isinstance(first, torch.Tensor) and first.dim() == 3 and all(
            isinstance(t, torch.Tensor) and t.shape == first.shape for t in images):
        if first.dtype == torch.uint8 and not first.is_cuda:
            return stack_images(images, channels_last), targets
        return torch.stack(images), targets
    return share(images), targets


def default_collate_for(dataset, channels_last: bool = True) -> Callable:
    """``collate_detection`` for a detection ``PackedDataset`` (or a ``Mixture`` of them:
    its sources' targets agree), else ``collate_uint8``."""
    if isinstance(dataset, Mixture):
        dataset = dataset.sources[0]
    detection = getattr(dataset, "task", None) == "detection" and getattr(
        getattr(dataset, "make_target", None), "detection", False)
    return functools.partial(collate_detection if detection else collate_uint8,
                             channels_last=channels_last)
