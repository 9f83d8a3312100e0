"""A batch that crosses from a DataLoader worker to the main process as one shared-memory
block, however many tensors it holds (``SharedBatch``), and the helpers that take a batch's
structure apart and put it back, shared with ``packer.loading.batchpool``.

A worker hands each tensor of its batch to the main process as a separate shared-memory file
whose descriptor the main process fetches over a socket, one round trip per tensor, all in
the one main process; a detection batch carries several small target tensors per image, so
that hand-over became the main process's bottleneck with many workers (docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from .torchapi import shared_storage

__all__ = ["Handover", "SharedBatch", "rebuild_batch"]

ALIGN = 64  # each tensor starts on a cache line (and on its dtype's alignment)


class SharedBatch(list):
    """A list (e.g. a batch's targets) that behaves as itself in the worker and pickles as
    one shared-memory block plus a small layout; unpickled, it is a plain ``list`` again.

    Tensors shared by several entries are copied once per occurrence; views of one block keep
    the whole block alive as long as any of them lives (a batch's lifetime)."""

    def __reduce_ex__(self, protocol):
        tensors: List[torch.Tensor] = []
        skeleton = strip_tensors(list(self), tensors)
        return rebuild_batch, (pack_tensors(tensors), tensor_layout(tensors), skeleton)


class Handover:
    """What a worker's collate returns for the queue to pickle: ``fn(*args)`` in the main
    process rebuilds the batch."""
    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class _Hole:
    """Where the ``index``-th tensor goes back into the rebuilt structure."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def strip_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with every dense CPU tensor replaced by a ``_Hole`` (the tensor appended to
    ``tensors``); dicts, lists (``SharedBatch`` too: it becomes a list) and plain tuples are
    walked, anything else (sparse or CUDA tensors, tensors that need grad, other containers)
    is left to ordinary pickling."""
    if (isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type == "cpu"
            and not obj.requires_grad):
        tensors.append(obj)
        return _Hole(len(tensors) - 1)
    if type(obj) is dict:
        return {k: strip_tensors(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple, SharedBatch):
        return (tuple if type(obj) is tuple else list)(strip_tensors(v, tensors) for v in obj)
    return obj


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def _offsets(tensors: List[torch.Tensor]) -> Tuple[List[int], int]:
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += aligned(t.numel() * t.element_size())
    return offsets, end


def pack_tensors(tensors: List[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor in shared memory holding every tensor's bytes at ``_offsets``."""
    offsets, total = _offsets(tensors)
    block = torch.empty(0, dtype=torch.uint8).set_(shared_storage(total))
    for t, off in zip(tensors, offsets):
        view_of(block, off, t.dtype, t.shape).copy_(t)
    return block


def tensor_layout(tensors: List[torch.Tensor]) -> list:
    offsets, _ = _offsets(tensors)
    return [layout_entry(t, off) for t, off in zip(tensors, offsets)]


def layout_entry(t: torch.Tensor, offset: int, strides: Optional[Tuple[int, ...]] = None):
    """How ``tensors_at`` finds ``t`` again in a block: its bytes from ``offset``,
    contiguous unless ``strides``, its class and that class's metadata."""
    return (offset, t.dtype, tuple(t.shape), strides or contiguous_strides(t.shape), type(t),
            dict(getattr(t, "__dict__", {})))


def contiguous_strides(shape) -> Tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def view_of(block: torch.Tensor, offset: int, dtype: torch.dtype, shape,
          strides: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` (contiguous unless ``strides``) over ``block``'s bytes
    from ``offset``."""
    return torch.empty(0, dtype=dtype).set_(
        block.untyped_storage(), (block.storage_offset() + offset) // dtype.itemsize,
        tuple(shape), strides if strides is not None else contiguous_strides(shape))


def rebuild_batch(block: torch.Tensor, layout: list, skeleton: Any) -> Any:
    """The structure ``SharedBatch`` (or a sealed slot's fallback) pickled, its tensors as
    views of ``block`` (runs in the process that unpickles it)."""
    return fill_tensors(skeleton, tensors_at(block, layout))


def tensors_at(block: torch.Tensor, layout: list) -> List[torch.Tensor]:
    tensors = []
    for off, dtype, shape, strides, cls, state in layout:
        t = view_of(block, off, dtype, shape, strides)
        if cls is not torch.Tensor:
            t = t.as_subclass(cls)
            t.__dict__.update(state)
        tensors.append(t)
    return tensors


def fill_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, _Hole):
        return tensors[obj.index]
    if type(obj) is dict:
        return {k: fill_tensors(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(fill_tensors(v, tensors) for v in obj)
    return obj
