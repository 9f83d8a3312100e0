"""Feeding the GPU path: ``make_gpu_loader`` (workers ship encoded JPEG bytes) and the CUDA
hardware-queue setting that keeps decoding from waiting behind training kernels.
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch

from ..reading.dataset import PackedDataset
from ..reading.mixture import Mixture
from ..loading.loader import make_loader
from ..format.images import DEFAULT_MAX_PIXELS
from .encoded import EncodedImage, collate_encoded

__all__ = ["ConnectionsWarning", "connections_advice", "make_gpu_loader", "reserve_cuda_queues"]

# nvJPEG's per-image steps wait behind training kernels on a shared hardware queue (8 by
# default; docs/gpu_decode.md); CUDA reads this when its context is created.
CUDA_QUEUES = 32


def reserve_cuda_queues(n: int = CUDA_QUEUES) -> bool:
    """Give this process ``n`` CUDA hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``) before any
    CUDA work, leaving a user's value alone. False when CUDA already started with fewer."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is None and not torch.cuda.is_initialized():
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(n)
        return True
    return connections_advice() is None


class ConnectionsWarning(UserWarning):
    """GPU decoding will wait behind training kernels: too few CUDA hardware queues."""


def connections_advice() -> Optional[str]:
    """Why GPU decoding beside training may be slow in this process, or None."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    try:
        low = value is None or int(value) < 16
    except ValueError:
        low = True
    if not low:
        return None
    now = "unset (8)" if value is None else value
    return (f"CUDA_DEVICE_MAX_CONNECTIONS is {now}: GPU decoding shares the GPU's hardware "
            f"queues with training kernels and waits behind them (several times slower beside a "
            f"training step). Call packer.gpu.reserve_cuda_queues() (or make_gpu_loader) before "
            f"any CUDA work, or set CUDA_DEVICE_MAX_CONNECTIONS={CUDA_QUEUES} in the environment")


def make_gpu_loader(dataset, batch_size: int = 256, *, max_pixels: Optional[int] = None,
                    **kwargs):
    """``make_loader`` for the GPU path: ``dataset`` (a path, a ``PackedDataset`` or a
    ``Mixture`` of them) hands out :class:`EncodedSample`, batches are :class:`EncodedBatch`.

    ``max_pixels``: the largest image a worker lets through, from the JPEG header (None: the
    dataset's ``EncodedImage``'s limit, else build's default). Other keywords go to
    ``make_loader``. Also calls :func:`reserve_cuda_queues`."""
    reserve_cuda_queues()
    own = getattr(dataset, "decode", None)
    own = own.max_pixels if isinstance(own, EncodedImage) else None
    if max_pixels is None:
        max_pixels = own or DEFAULT_MAX_PIXELS
    if isinstance(dataset, Mixture):
        dataset = copy.copy(dataset)
        dataset.sources = [_encoded(d, max_pixels) for d in dataset.sources]
    else:
        dataset = _encoded(dataset, max_pixels)
    kwargs.setdefault("collate_fn", collate_encoded)
    return make_loader(dataset, batch_size, **kwargs)


def _encoded(dataset, max_pixels: int):
    """``dataset`` (a path or a ``PackedDataset``) handing out ``EncodedImage(max_pixels)``
    samples: a copy where its decoder differs; anything else as it is."""
    if isinstance(dataset, (str, os.PathLike)):
        return PackedDataset(dataset, decode=EncodedImage(max_pixels))
    if isinstance(dataset, PackedDataset):
        if dataset.transform is not None:
            raise ValueError("the GPU path augments on the GPU (GPUDecoder(train=..., size=...)): "
                             "build the PackedDataset without transform=")
        own = dataset.decode
        if not isinstance(own, EncodedImage) or own.max_pixels != max_pixels:
            dataset = copy.copy(dataset)
            dataset.decode = EncodedImage(max_pixels)
    return dataset
