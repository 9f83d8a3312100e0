"""Shared memory that DataLoader workers reuse batch after batch (``BatchPool``), and the
collate that writes into it (``PooledCollate``).

A fresh shared block per batch (torch's way, and ``torchapi.shared_empty``) costs the worker
a new file whose every page is faulted in and zeroed, and the main process a descriptor
round trip, a map and an unmap, batch after batch (what that costs is in docs/benchmarks.md).
A ``BatchPool``, made by the main process just before the workers fork, gives each worker a
file of reusable slots and a shared byte per slot saying "in use". The worker writes a batch
into a free slot and sends where it lies; the main process maps each file once and hands out
views of the slot; when the last of them is freed, the slot is marked free again. A batch
that finds no free slot (the training loop holds them all) takes a fresh block, so holding
on to batches is safe.
"""
from __future__ import annotations

import functools
import math
import mmap
import multiprocessing as mp
import os
import threading
import weakref
from itertools import count
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.data import get_worker_info

from .sharedbatch import (Handover, aligned, fill_tensors, layout_entry, pack_tensors,
                          rebuild_batch, strip_tensors, tensor_layout, tensors_at, view_of)
from .torchapi import shared_empty

__all__ = ["BatchPool", "PooledCollate", "batch_empty", "rebuild_lent", "renew_pool"]

SLOT_STEP = 1 << 20  # slot sizes in whole MiB, with HEADROOM: pages never written cost nothing
HEADROOM = 1.25  # room in a new slot for a batch a little larger than the one that made it
POOLS: "weakref.WeakValueDictionary[int, BatchPool]" = weakref.WeakValueDictionary()
TOKENS = count(1)
ACTIVE = threading.local()  # the slot of the batch a worker is collating (BatchPool.collate)


class BatchPool:
    """Reusable shared-memory slots for the batches of ``workers`` forked DataLoader
    workers, up to ``slots`` each. Made by the main process just before the workers fork
    (``make_loader`` makes one per set of workers); each worker's collate then runs through
    ``collate``. Worker ``k`` writes only into its own file and its own bytes of ``flags``;
    the main process only maps the files and clears flags."""

    def __init__(self, workers: int, slots: int):
        self.owner, self.slots = os.getpid(), slots
        self.flags = mmap.mmap(-1, workers * slots)  # shared with the forked workers
        self.maps: Dict[int, mmap.mmap] = {}  # main process: each worker's file, mapped
        self.lent: Dict[Tuple[int, int], Tuple[int, int]] = {}  # (worker, slot) viewed: bytes
        self.gone = [False]  # set when the pool goes: slots freed after that give their pages back
        self.files: List[int] = []
        weakref.finalize(self, retire, self.files, self.lent, self.gone)
        for k in range(workers):  # the finalizer closes those made if one of them fails
            self.files.append(os.memfd_create(f"packer-batches-{k}"))
        self.token = next(TOKENS)
        POOLS[self.token] = self
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
        if length:
            give_pages_back(old, [(start, start + length)])
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
            self.lent[worker, slot] = (offset, size)
        mv = memoryview(m)[offset:offset + size]
        weakref.finalize(mv, free_slot, self.flags, worker * self.slots + slot, m, offset, size,
                         self.gone, self.lent, (worker, slot)).atexit = False
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
        nbytes = math.prod(size) * dtype.itemsize
        if self.index is None:
            self.index = self.pool.claim(self.worker, nbytes + self.pool.extra)
            if self.index is None:
                return None
        start, length = self.bounds()
        at = aligned(self.used)
        if at + nbytes > length:
            return None
        self.used = at + nbytes
        return view_of(self.pool.view, start + at, dtype, size)

    def seal(self, out: Any) -> Any:
        """``out`` for the queue: its tensors in the slot (those made elsewhere copied in),
        else in one fresh block, copied now, so the slot can be reused at once."""
        tensors: List[torch.Tensor] = []
        skeleton = strip_tensors(out, tensors)
        if not tensors:
            self.give_back()
            return out
        places = self.place(tensors)
        if places is None:
            self.give_back()
            return Handover(rebuild_batch, (pack_tensors(tensors), tensor_layout(tensors), skeleton))
        start, length = self.bounds()
        layout = []
        for t, (at, strides) in zip(tensors, places):
            if strides is None:  # made elsewhere: copied in, contiguous
                view_of(self.pool.view, start + at, t.dtype, t.shape).copy_(t)
            layout.append(layout_entry(t, at, strides))
        return Handover(rebuild_lent, (self.pool.token, self.worker, self.index, start,
                                       max(self.used, 1), layout, skeleton))

    def place(self, tensors: List[torch.Tensor]) -> Optional[List[Tuple[int, Any]]]:
        """Each tensor's ``(offset in the slot, strides)``: strides for those already in it,
        None for those to copy in after them; None if they do not fit (or no slot)."""
        held = [self.holds(t) for t in tensors]
        extra = sum(aligned(t.numel() * t.element_size()) for t, h in zip(tensors, held) if not h)
        self.pool.extra = max(self.pool.extra, extra)
        if self.index is None:
            self.index = self.pool.claim(self.worker, extra)
            if self.index is None:
                return None
        start, length = self.bounds()
        base = self.pool.view.data_ptr() + start
        at = aligned(self.used)
        if at + extra > length:
            return None
        places = []
        for t, h in zip(tensors, held):
            if h:
                places.append((t.data_ptr() - base, tuple(t.stride())))
            else:
                places.append((at, None))
                at += aligned(t.numel() * t.element_size())
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


def free_slot(flags: mmap.mmap, index: int, m: mmap.mmap, offset: int, size: int,
              gone: List[bool], lent: dict, key: Tuple[int, int]) -> None:
    """The last view of a lent slot is gone: the slot is free for its worker (no longer in
    ``lent`` first: the worker may claim and the main process lend it again at once); if
    the pool went first (its workers with it), its pages go back to the system."""
    lent.pop(key, None)
    flags[index] = 0
    if gone[0]:
        give_pages_back(m, [(offset, offset + size)])


def give_pages_back(m: mmap.mmap, ranges: List[Tuple[int, int]]) -> None:
    """Punch the whole pages of ``ranges`` out of ``m``'s file (the pages stay where the
    system has no ``MADV_REMOVE``)."""
    page = mmap.PAGESIZE
    for start, end in ranges:
        lo, hi = -(-start // page) * page, min(-(-end // page) * page, len(m))
        if hi > lo and hasattr(mmap, "MADV_REMOVE"):
            m.madvise(mmap.MADV_REMOVE, lo, hi - lo)


def retire(fds: List[int], lent: Dict[Tuple[int, int], Tuple[int, int]],
           gone: List[bool]) -> None:
    """A pool is gone (its workers with it): every page of its files that no kept batch
    still views goes back to the system (the rest as each kept batch goes, ``free_slot``),
    then the files are closed; slots the workers had filled for batches never received go
    back too. A batch kept beyond its loader would otherwise keep its worker's whole file
    (every slot) in memory."""
    gone[0] = True
    for worker, fd in enumerate(fds):
        held = sorted((at, at + n) for (w, _), (at, n) in list(lent.items()) if w == worker)
        try:
            size = os.fstat(fd).st_size
            if size:
                m = mmap.mmap(fd, size)
                give_pages_back(m, holes(held, size))
                m.close()
        except (OSError, ValueError):
            pass
        os.close(fd)


def holes(held: List[Tuple[int, int]], size: int) -> List[Tuple[int, int]]:
    """``[0, size)`` outside the ``held`` ranges (sorted), in whole pages: a page that
    holds any held byte is kept."""
    page, out, at = mmap.PAGESIZE, [], 0
    for start, end in held + [(size, size)]:
        lo, hi = -(-at // page) * page, start // page * page
        if hi > lo:
            out.append((lo, hi))
        at = max(at, end)
    return out


def batch_empty(size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A contiguous tensor in shared memory for a batch a worker is collating: in its pool
    slot while ``BatchPool.collate`` runs (and there is room), else a fresh shared block,
    which crosses to the main process without a copy either way."""
    slot = getattr(ACTIVE, "slot", None)
    out = slot.empty(size, dtype) if slot is not None else None
    return shared_empty(size, dtype) if out is None else out


def rebuild_lent(token: int, worker: int, slot: int, offset: int, size: int, layout: list,
                 skeleton: Any) -> Any:
    """The batch a worker left in a pool slot (runs in the main process)."""
    pool = POOLS.get(token)
    if pool is None:
        raise RuntimeError("a batch arrived from the workers of a DataLoader iterator that is "
                           "gone; iterate a loader through the iterator that started its workers")
    return fill_tensors(skeleton, tensors_at(pool.lend(worker, slot, offset, size), layout))


class PooledCollate(functools.partial):
    """``func(batch, **keywords)``, which a forked worker writes into its slots of the
    ``BatchPool`` made for the current workers (``renew_pool``); a plain call anywhere else,
    and in a spawned worker (the pool stays home when it is pickled)."""
    pool: Optional[BatchPool] = None

    def __call__(self, batch):
        pool = self.pool
        return super().__call__(batch) if pool is None else pool.collate(super().__call__, batch)

    def __reduce__(self):
        return type(self), (self.func,), (self.func, self.args, self.keywords, None)


def renew_pool(loader) -> Optional[BatchPool]:
    """A new ``BatchPool`` for the workers ``loader`` (a DataLoader) is about to start,
    given to its ``PooledCollate`` (also inside a ``StampedCollate``); None where there is
    none to give or the workers will not be forked. One per set of workers: a second set, or
    another loader's sharing the collate, must not write into the first one's slots; the
    caller keeps it as long as those workers live."""
    collate = getattr(loader.collate_fn, "collate", loader.collate_fn)
    if not isinstance(collate, PooledCollate) or loader.num_workers == 0:
        return None
    ctx = loader.multiprocessing_context or mp.get_context()
    collate.pool = BatchPool.create(loader.num_workers, loader.prefetch_factor + 2) \
        if ctx.get_start_method() == "fork" else None
    return collate.pool
