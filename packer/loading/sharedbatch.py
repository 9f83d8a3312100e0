"""``SharedBatch``: a batch that crosses from a worker to the main process as one shared-memory
block, not one file descriptor round trip per tensor (docs/benchmarks.md)."""
from __future__ import annotations

import itertools
from typing import Any, Callable, List

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
    """Where the next tensor (in walk order) goes back into the rebuilt structure."""
    __slots__ = ()


def walk(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with ``leaf`` applied to everything but the dicts, lists and plain tuples it
    walks (a ``SharedBatch`` becomes a list)."""
    if type(obj) is dict:
        return {k: walk(v, leaf) for k, v in obj.items()}
    if type(obj) in (list, tuple, SharedBatch):
        return (tuple if type(obj) is tuple else list)(walk(v, leaf) for v in obj)
    return leaf(obj)


def strip_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with each dense CPU tensor needing no grad moved to ``tensors``, a ``_Hole`` left."""
    def take(t):
        if (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"
                and not t.requires_grad):
            tensors.append(t)
            return _Hole()
        return t
    return walk(obj, take)


def view_of(block: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A contiguous ``dtype`` tensor of ``shape`` over ``block``'s bytes from ``offset``."""
    return torch.empty(0, dtype=dtype).set_(block.untyped_storage(), offset // dtype.itemsize,
                                            tuple(shape))


def rebuild_batch(block: torch.Tensor, layout: list, skeleton: Any) -> Any:
    """The structure a ``SharedBatch`` pickled, its tensors views of ``block`` (on unpickling)."""
    tensors = []
    for off, dtype, shape, cls, state in layout:
        t = view_of(block, off, dtype, shape)
        if cls is not torch.Tensor:
            t = t.as_subclass(cls)
            t.__dict__.update(state)
        tensors.append(t)
    rest = iter(tensors)
    return walk(skeleton, lambda x: next(rest) if isinstance(x, _Hole) else x)
