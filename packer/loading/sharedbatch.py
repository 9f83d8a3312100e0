"""``SharedBatch``: a batch that crosses from a worker to the main process as one shared-memory
block, not one file descriptor round trip per tensor (docs/benchmarks.md)."""
from __future__ import annotations

import itertools
from typing import Any, List

import torch

from .torchapi import shared_storage

__all__ = ["SharedBatch"]

ALIGN = 64  # each tensor starts on a cache line (and so on its dtype's alignment)


class SharedBatch(list):
    """A list (a batch's targets) that pickles as one shared-memory block plus a small layout and
    unpickles as a plain list of the same structure, its dense CPU tensors views of the block
    (tensor subclasses keep their class); the block lives as long as any view."""

    def __reduce_ex__(self, protocol):
        tensors: List[torch.Tensor] = []
        skeleton = strip_tensors(list(self), tensors)
        sizes = (-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
        offsets = [0, *itertools.accumulate(sizes)]
        block = torch.empty(0, dtype=torch.uint8).set_(shared_storage(offsets[-1]))
        layout = []
        for t, off in zip(tensors, offsets):
            view_of(block, off, t.dtype, t.shape).copy_(t)
            layout.append((off, t.dtype, tuple(t.shape), type(t), dict(getattr(t, "__dict__", {}))))
        return rebuild_batch, (block, layout, skeleton)


class _Hole:
    """Where the ``index``-th tensor goes back into the rebuilt structure."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def strip_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with every dense CPU tensor that needs no grad replaced by a ``_Hole`` (the
    tensor appended to ``tensors``); dicts, lists and plain tuples are walked."""
    if (isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type == "cpu"
            and not obj.requires_grad):
        tensors.append(obj)
        return _Hole(len(tensors) - 1)
    if type(obj) is dict:
        return {k: strip_tensors(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple, SharedBatch):
        return (tuple if type(obj) is tuple else list)(strip_tensors(v, tensors) for v in obj)
    return obj


def view_of(block: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A contiguous ``dtype`` tensor of ``shape`` over ``block``'s bytes from ``offset``."""
    return torch.empty(0, dtype=dtype).set_(block.untyped_storage(), offset // dtype.itemsize,
                                            tuple(shape))


def rebuild_batch(block: torch.Tensor, layout: list, skeleton: Any) -> Any:
    """The structure a ``SharedBatch`` pickled, its tensors as views of ``block`` (runs in
    the process that unpickles it)."""
    tensors = []
    for off, dtype, shape, cls, state in layout:
        t = view_of(block, off, dtype, shape)
        if cls is not torch.Tensor:
            t = t.as_subclass(cls)
            t.__dict__.update(state)
        tensors.append(t)
    return fill_tensors(skeleton, tensors)


def fill_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, _Hole):
        return tensors[obj.index]
    if type(obj) is dict:
        return {k: fill_tensors(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(fill_tensors(v, tensors) for v in obj)
    return obj
