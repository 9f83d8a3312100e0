"""A batch that crosses from a DataLoader worker to the main process as one shared-memory
block, however many tensors it holds, and (``BatchPool``) in a block the worker reuses.

A worker hands each tensor of its batch to the main process as a separate shared-memory
file whose descriptor the main process fetches over a socket from the worker, one round
trip per tensor. A detection batch of 32 images carries 4-5 small target tensors per image:
130-160 round trips, all in the one main process, which held a 15-worker packed loader to
~0.6x torchvision's (whose targets carry two tensors; docs/benchmarks.md). ``SharedBatch``
copies every tensor of a batch into one shared block when it is pickled; the main process
rebuilds the same structure (dicts, lists, tuples; tensor subclasses such as
``tv_tensors.BoundingBoxes`` with their metadata) as views of that block: one round trip.

A fresh block per batch still costs the worker a new file whose pages are all faulted in
and zeroed (~2,400 for a batch of 64 crops of 224 px), and the main process a round trip, a
map and an unmap: 8 % of a worker's time on the 2-core box (docs/benchmarks.md, issue 16).
A ``BatchPool``, made by the main process just before the workers fork, gives each worker a
file of reusable slots and a shared byte per slot saying "in use". The worker writes a
batch into a free slot and sends where it lies; the main process maps each file once and
hands out views of the slot; when the last of them is freed, the slot is marked free again.
A batch that finds no free slot (the training loop holds them all) takes a fresh block, so
holding on to batches is always safe.
"""
from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from itertools import count
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.data import get_worker_info

__all__ = ["BatchPool", "SharedBatch", "rebuild_batch", "rebuild_lent", "shared_empty"]

ALIGN = 64  # each tensor starts on a cache line (and on its dtype's alignment)
SLOT_STEP = 1 << 20  # slot sizes in whole MiB, with HEADROOM: pages never written cost nothing
HEADROOM = 1.25  # room in a new slot for a batch a little larger than the one that made it
POOLS: "weakref.WeakValueDictionary[int, BatchPool]" = weakref.WeakValueDictionary()
TOKENS = count(1)
ACTIVE = threading.local()  # the slot of the batch a worker is collating (BatchPool.collate)


class SharedBatch(list):
    """A list (e.g. a batch's targets) that behaves as itself in the worker and pickles as
    one shared-memory block plus a small layout; unpickled, it is a plain ``list`` again.

    Tensors shared by several entries are copied once per occurrence; views of one block keep
    the whole block alive as long as any of them lives (a batch's lifetime)."""

    def __reduce_ex__(self, protocol):
        tensors: List[torch.Tensor] = []
        skeleton = _strip(list(self), tensors)
        return rebuild_batch, (_pack(tensors), _layout(tensors), skeleton)


class Handover:
    """What a worker's collate returns for the queue to pickle: ``fn(*args)`` in the main
    process rebuilds the batch."""
    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class BatchPool:
    """Reusable shared-memory slots for the batches of ``workers`` forked DataLoader
    workers, up to ``slots`` each. Made by the main process just before the workers fork
    (``make_loader`` makes one per set of workers); each worker's collate then runs through
    ``collate``. Worker ``k`` writes only into its own file and its own bytes of ``flags``;
    the main process only maps the files and clears flags."""

    def __init__(self, workers: int, slots: int):
        self.owner, self.slots = os.getpid(), slots
        self.files: List[int] = []
        weakref.finalize(self, close_files, self.files)  # also if a later memfd_create fails
        for k in range(workers):
            self.files.append(os.memfd_create(f"packer-batches-{k}"))
        self.flags = mmap.mmap(-1, workers * slots)  # shared with the forked workers
        self.token = next(TOKENS)
        POOLS[self.token] = self
        self.maps: Dict[int, mmap.mmap] = {}  # main process: each worker's file, mapped
        self.lock = threading.Lock()  # the pin-memory thread rebuilds batches too
        self.table: List[Tuple[int, int]] = []  # a worker's own slots: (offset, size)
        self.mapped: Optional[mmap.mmap] = None  # a worker's own file, mapped whole
        self.view: Optional[torch.Tensor] = None  # the same, as uint8
        self.end = 0  # a worker's file size: slots moved on leave holes behind
        self.extra = 0  # the most bytes a batch of this worker added after its images

    @classmethod
    def create(cls, workers: int, slots: int) -> Optional["BatchPool"]:
        """A pool, or None where shared files cannot be made (not Linux, out of files)."""
        try:
            return cls(workers, slots)
        except (AttributeError, OSError):
            return None

    # -- in a worker ---------------------------------------------------------------------

    def collate(self, fn: Callable, batch: Any) -> Any:
        """``fn(batch)``; in one of this pool's workers, handed over from a slot."""
        info = get_worker_info()
        if info is None or os.getpid() == self.owner or info.id >= len(self.files):
            return fn(batch)
        ACTIVE.slot = slot = Slot(self, info.id)
        try:
            out = fn(batch)
        except BaseException:
            slot.give_back()  # the batch failed: its slot must not stay in use for good
            raise
        finally:
            ACTIVE.slot = None
        return slot.seal(out)

    def claim(self, worker: int, nbytes: int) -> Optional[int]:
        """The smallest free slot of ``worker`` holding ``nbytes`` (a new one while fewer than
        ``slots`` exist, else a free one too small moved on to a larger place), marked in
        use; None if every slot is in use."""
        base = worker * self.slots
        free = [j for j in range(len(self.table)) if self.flags[base + j] == 0]
        fits = [j for j in free if self.table[j][1] >= nbytes]
        try:
            if fits:
                best = min(fits, key=lambda j: self.table[j][1])
            elif len(self.table) < self.slots:
                best = self.make_room(worker, len(self.table), nbytes)
            elif free:
                best = self.make_room(worker, free[0], nbytes)
            else:
                return None
        except OSError:  # no memory for a larger file: this batch goes the fresh way
            return None
        self.flags[base + best] = 1
        return best

    def make_room(self, worker: int, slot: int, nbytes: int) -> int:
        """``slot`` (free, or the next new one) given room for ``nbytes`` at the end of
        ``worker``'s file; its old pages, if any, handed back to the system (a hole in the
        file). Nothing changes if the file cannot grow (OSError)."""
        size = -(-int(nbytes * HEADROOM) // SLOT_STEP) * SLOT_STEP
        os.ftruncate(self.files[worker], self.end + size)
        self.mapped, old = mmap.mmap(self.files[worker], self.end + size), self.mapped
        self.view = torch.frombuffer(self.mapped, dtype=torch.uint8)
        if slot == len(self.table):
            self.table.append((0, 0))
        start, length = self.table[slot]
        if length and hasattr(mmap, "MADV_REMOVE"):
            old.madvise(mmap.MADV_REMOVE, start, length)
        self.table[slot] = (self.end, size)
        self.end += size
        return slot

    def release(self, worker: int, slot: int) -> None:
        self.flags[worker * self.slots + slot] = 0

    # -- in the main process -------------------------------------------------------------

    def lend(self, worker: int, slot: int, offset: int, size: int) -> torch.Tensor:
        """The slot's bytes as a uint8 tensor; the slot is free again once it and every view
        of it are gone."""
        with self.lock:
            m = self.maps.get(worker)
            if m is None or len(m) < offset + size:  # the worker's file grew
                fd = self.files[worker]
                m = self.maps[worker] = mmap.mmap(fd, os.fstat(fd).st_size)
        mv = memoryview(m)[offset:offset + size]
        weakref.finalize(mv, free_slot, self.flags, worker * self.slots + slot).atexit = False
        return torch.frombuffer(mv, dtype=torch.uint8)  # holds mv until its storage goes


class Slot:
    """The slot one batch is written into, claimed when its first tensor asks for room."""

    def __init__(self, pool: BatchPool, worker: int):
        self.pool, self.worker = pool, worker
        self.index: Optional[int] = None
        self.used = 0

    def bounds(self) -> Tuple[int, int]:
        return self.pool.table[self.index]

    def empty(self, size, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A contiguous tensor inside the slot, or None where there is no room."""
        nbytes = math.prod(size) * _itemsize(dtype)
        if self.index is None:
            self.index = self.pool.claim(self.worker, nbytes + self.pool.extra)
            if self.index is None:
                return None
        start, length = self.bounds()
        at = -(-self.used // ALIGN) * ALIGN
        if at + nbytes > length:
            return None
        self.used = at + nbytes
        return _view(self.pool.view, start + at, dtype, size)

    def seal(self, out: Any) -> Any:
        """``out`` for the queue: its tensors in the slot (those made elsewhere copied in),
        else in one fresh block, copied now, so the slot can be reused at once."""
        tensors: List[torch.Tensor] = []
        skeleton = _strip(out, tensors)
        if not tensors:
            self.give_back()
            return out
        places = self.place(tensors)
        if places is None:
            self.give_back()
            return Handover(rebuild_batch, (_pack(tensors), _layout(tensors), skeleton))
        start, length = self.bounds()
        layout = []
        for t, (at, strides) in zip(tensors, places):
            if strides is None:  # made elsewhere: copied in, contiguous
                _view(self.pool.view, start + at, t.dtype, t.shape).copy_(t)
                strides = _contiguous(t.shape)
            layout.append((at, t.dtype, tuple(t.shape), strides, type(t),
                           dict(getattr(t, "__dict__", {}))))
        return Handover(rebuild_lent, (self.pool.token, self.worker, self.index, start,
                                       max(self.used, 1), layout, skeleton))

    def place(self, tensors: List[torch.Tensor]) -> Optional[List[Tuple[int, Any]]]:
        """Each tensor's ``(offset in the slot, strides)``: strides for those already in it,
        None for those to copy in after them; None if they do not fit (or no slot)."""
        extra = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors
                    if not self.holds(t))
        self.pool.extra = max(self.pool.extra, extra)
        if self.index is None:
            self.index = self.pool.claim(self.worker, extra)
            if self.index is None:
                return None
        start, length = self.bounds()
        base = self.pool.view.data_ptr() + start
        at = -(-self.used // ALIGN) * ALIGN
        if at + extra > length:
            return None
        places = []
        for t in tensors:
            if self.holds(t):
                places.append((t.data_ptr() - base, tuple(t.stride())))
            else:
                places.append((at, None))
                at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.used = at
        return places

    def holds(self, t: torch.Tensor) -> bool:
        if self.index is None or self.pool.view is None:
            return False
        start, length = self.bounds()
        base = self.pool.view.data_ptr() + start
        return (t.untyped_storage().data_ptr() == self.pool.view.untyped_storage().data_ptr()
                and base <= t.data_ptr() < base + length)

    def give_back(self) -> None:
        if self.index is not None:
            self.pool.release(self.worker, self.index)
            self.index = None


def free_slot(flags: mmap.mmap, index: int) -> None:
    flags[index] = 0


def close_files(fds: List[int]) -> None:
    for fd in fds:
        os.close(fd)


def shared_empty(size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A contiguous tensor in shared memory for a batch a worker is collating: in its pool
    slot while ``BatchPool.collate`` runs (and there is room), else a fresh shared block,
    which crosses to the main process without a copy either way."""
    slot = getattr(ACTIVE, "slot", None)
    out = slot.empty(size, dtype) if slot is not None else None
    if out is None:
        storage = torch.UntypedStorage._new_shared(max(1, math.prod(size) * _itemsize(dtype)))
        out = torch.empty(0, dtype=dtype).set_(storage, 0, tuple(size), _contiguous(size))
    return out


def rebuild_lent(token: int, worker: int, slot: int, offset: int, size: int, layout: list,
                 skeleton: Any) -> Any:
    """The batch a worker left in a pool slot (runs in the main process)."""
    pool = POOLS.get(token)
    if pool is None:
        raise RuntimeError("a batch arrived from the workers of a DataLoader iterator that is "
                           "gone; iterate a loader through the iterator that started its workers")
    return _fill(skeleton, _tensors(pool.lend(worker, slot, offset, size), layout))


class _Hole:
    """Where the ``index``-th tensor goes back into the rebuilt structure."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _strip(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with every dense CPU tensor replaced by a ``_Hole`` (the tensor appended to
    ``tensors``); dicts, lists (``SharedBatch`` too: it becomes a list) and plain tuples are
    walked, anything else (sparse or CUDA tensors, tensors that need grad, other containers)
    is left to ordinary pickling."""
    if (isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type == "cpu"
            and not obj.requires_grad):
        tensors.append(obj)
        return _Hole(len(tensors) - 1)
    if type(obj) is dict:
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple, SharedBatch):
        return (tuple if type(obj) is tuple else list)(_strip(v, tensors) for v in obj)
    return obj


def _offsets(tensors: List[torch.Tensor]) -> Tuple[List[int], int]:
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, end


def _pack(tensors: List[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor in shared memory holding every tensor's bytes at ``_offsets``."""
    offsets, total = _offsets(tensors)
    block = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(1, total)))
    for t, off in zip(tensors, offsets):
        _view(block, off, t.dtype, t.shape).copy_(t)
    return block


def _layout(tensors: List[torch.Tensor]) -> list:
    offsets, _ = _offsets(tensors)
    return [(off, t.dtype, tuple(t.shape), _contiguous(t.shape), type(t),
             dict(getattr(t, "__dict__", {}))) for t, off in zip(tensors, offsets)]


def _contiguous(shape) -> Tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _view(block: torch.Tensor, offset: int, dtype: torch.dtype, shape,
          strides: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` (contiguous unless ``strides``) over ``block``'s bytes
    from ``offset``."""
    return torch.empty(0, dtype=dtype).set_(
        block.untyped_storage(), (block.storage_offset() + offset) // _itemsize(dtype),
        tuple(shape), strides if strides is not None else _contiguous(shape))


def _itemsize(dtype: torch.dtype) -> int:
    return getattr(dtype, "itemsize", None) or torch.empty(0, dtype=dtype).element_size()  # torch < 2.1


def rebuild_batch(block: torch.Tensor, layout: list, skeleton: Any) -> Any:
    """The structure ``SharedBatch`` (or a sealed slot's fallback) pickled, its tensors as
    views of ``block`` (runs in the process that unpickles it)."""
    return _fill(skeleton, _tensors(block, layout))


def _tensors(block: torch.Tensor, layout: list) -> List[torch.Tensor]:
    tensors = []
    for off, dtype, shape, strides, cls, state in layout:
        t = _view(block, off, dtype, shape, strides)
        if cls is not torch.Tensor:
            t = t.as_subclass(cls)
            t.__dict__.update(state)
        tensors.append(t)
    return tensors


def _fill(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, _Hole):
        return tensors[obj.index]
    if type(obj) is dict:
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj
