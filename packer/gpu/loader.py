"""Feeding the GPU path: ``make_gpu_loader`` (workers ship encoded JPEG bytes) and the CUDA
hardware-queue setting that keeps decoding from waiting behind training kernels."""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch

from ..reading.dataset import PackedDataset
from ..reading.mixture import Mixture
from ..loading.loader import make_loader, start_method
from ..format.images import DEFAULT_MAX_PIXELS
from .encoded import EncodedCollate, EncodedImage
from .ring import BatchRing

__all__ = ["ConnectionsWarning", "connections_advice", "make_gpu_loader", "reserve_cuda_queues"]

# nvJPEG's per-image steps wait behind training kernels on a shared hardware queue (8 by
# default; docs/gpu_decode.md); CUDA reads this when its context is created.
CUDA_QUEUES = 32
# Ring slots beyond the batches the DataLoader keeps in flight, for those the training process
# holds (decoding, decoded, in use, released but read by the GPU); docs/benchmarks.md.
RING_SPARE = 12
RING_BYTES = 1 << 30  # the most a loader's ring takes (pinned host memory)


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
    dataset's ``EncodedImage``'s limit, each source's in a ``Mixture``, else build's default).
    Other keywords go to ``make_loader``. Also calls :func:`reserve_cuda_queues`.

    With the default ``collate_fn`` and workers, batches travel in a
    :class:`~packer.gpu.ring.BatchRing`: one slot per batch the workers may hold plus
    ``RING_SPARE``, each 1.25x the dataset's mean image size x ``batch_size``, at most
    ``RING_BYTES`` in all, pinned once (PACKER_BATCH_RING=0: off)."""
    reserve_cuda_queues()

    def limit(d) -> int:  # the caller's, else the dataset's own (each source's in a Mixture)
        own = getattr(d, "decode", None)
        return max_pixels or (own.max_pixels if isinstance(own, EncodedImage) else
                              DEFAULT_MAX_PIXELS)
    if isinstance(dataset, Mixture):
        dataset = copy.copy(dataset)
        dataset.sources = [_encoded(d, limit(d)) for d in dataset.sources]
    else:
        dataset = _encoded(dataset, limit(dataset))
    collate = EncodedCollate()
    kwargs.setdefault("collate_fn", collate)
    loader = make_loader(dataset, batch_size, **kwargs)
    if (loader.collate_fn is collate and loader.num_workers and batch_size
            and os.environ.get("PACKER_BATCH_RING", "1") != "0"):
        collate.ring = _batch_ring(dataset, batch_size,
                                   loader.num_workers * loader.prefetch_factor + RING_SPARE,
                                   start_method(loader.multiprocessing_context))
    return loader


def _batch_ring(dataset, batch_size: int, slots: int, method: str) -> Optional[BatchRing]:
    """A ring sized from the mean stored size of ``dataset``'s images; None where no manifest
    says it."""
    sources = dataset.sources if isinstance(dataset, Mixture) else [dataset]
    means = [d.manifest.get("bytes", 0) / max(1, d.manifest.get("count", 0)) for d in sources
             if isinstance(d, PackedDataset)]
    slot = int(1.25 * batch_size * max(means, default=0))
    slots = min(slots, RING_BYTES // max(1, slot))
    return BatchRing(slots, slot, method) if slot and slots >= 2 else None


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
