"""Shared buffers, pinned once, that DataLoader workers write the GPU path's batches into: a
batch then reaches nvJPEG without the pin thread's copy and without mapping and unmapping a new
shared block for it (docs/gpu_decode.md)."""
from __future__ import annotations

import collections
import ctypes
import itertools
import mmap
import multiprocessing as mp
import os
import threading
import warnings
import weakref
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd
from typing import Optional, Tuple

import torch

__all__ = ["BatchRing"]

_RINGS: "weakref.WeakValueDictionary[int, BatchRing]" = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)
FREE, MAIN = 0, -1  # a slot's owner: free, held by the training process, else a worker's pid
CLAIM_WAIT = 1.0  # seconds: a worker kept longer from the claim lock (held for µs) stops claiming


class BatchRing:
    """``slots`` buffers of ``slot_bytes`` in one shared mapping that workers started by
    ``method`` reach: forked ones inherit it; spawn and forkserver ones map a memory file handed
    over as they start (no name in /dev/shm or on disk). A worker claims a free slot for a batch
    that fits (:meth:`claim`), else the batch travels as before; the training process takes it
    over on arrival (:func:`arrived`), pins the whole mapping with CUDA once, and frees the slot
    after the last tensor on it is gone (:meth:`release`). A slot whose worker died before its
    batch arrived is claimed again."""

    def __init__(self, slots: int, slot_bytes: int, method: str = "fork"):
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a BatchRing needs slots and slot_bytes >= 1, got {slots}, {slot_bytes}")
        page = mmap.PAGESIZE
        self.slots, self.slot_bytes = slots, -(-slot_bytes // page) * page
        self.head = -(-8 * slots // page) * page  # the owner table, then the slots
        by_file = method != "fork" and hasattr(os, "memfd_create")
        self.fd = os.memfd_create("packer-batch-ring") if by_file else -1
        if self.fd >= 0:
            os.ftruncate(self.fd, self.head + slots * self.slot_bytes)
            weakref.finalize(self, os.close, self.fd)
        self._map(mp.get_context(method).Lock(), next(_TOKENS))

    def _map(self, lock, token: int) -> None:
        self.nbytes = self.head + self.slots * self.slot_bytes
        self.mm: Optional[mmap.mmap] = mmap.mmap(self.fd, self.nbytes)
        self.owner = (ctypes.c_int64 * self.slots).from_buffer(self.mm)
        self.base = ctypes.addressof(self.owner)
        self.lock, self.token, self.next = lock, token, 0
        self.pinned, self.pending = None, collections.deque()
        # The training process's side; reentrant: a collection inside reap() may release.
        self.pid, self.guard = os.getpid(), threading.RLock()
        _RINGS[token] = self

    def __reduce__(self):
        if self.fd >= 0 and get_spawning_popen() is not None:  # a worker being started
            return _attach, (DupFd(self.fd), self.slots, self.slot_bytes, self.head, self.lock,
                             self.token)
        return _detached, ()  # anywhere else: a ring that never claims

    def claim(self, nbytes: int) -> Optional[torch.Tensor]:
        """In a worker: ``nbytes`` of a free slot, now this process's, or None."""
        if self.mm is None or not 0 < nbytes <= self.slot_bytes:
            return None
        me = os.getpid()
        if not self.lock.acquire(timeout=CLAIM_WAIT):  # its holder was killed in there
            self.mm = None  # this worker's batches travel as blocks of their own from now on
            warnings.warn(f"the GPU batch ring's lock stayed taken for {CLAIM_WAIT} s (a loader "
                          f"worker killed while holding it?): this worker's batches travel as "
                          f"shared blocks from now on", RuntimeWarning)
            return None
        try:
            for k in range(self.slots):
                i = (self.next + k) % self.slots
                who = self.owner[i]
                if who == FREE or (who > 0 and who != me and not _alive(who)):
                    self.owner[i], self.next = me, i + 1
                    return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes,
                                            offset=self.head + i * self.slot_bytes)
        finally:
            self.lock.release()
        return None

    def locate(self, t: torch.Tensor) -> Optional[Tuple[int, int, int]]:
        """``(token, slot, nbytes)`` of a batch a worker wrote into a slot of its own."""
        i, rest = divmod(t.data_ptr() - self.base - self.head, self.slot_bytes)
        if self.mm is None or not 0 <= i < self.slots or rest or self.owner[i] != os.getpid():
            return None
        return self.token, i, t.nbytes

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """In the training process: the batch in ``slot``, which is free again once the
        returned tensor and every view of it are gone (they keep the ring alive)."""
        self.owner[slot] = MAIN
        with self.guard:  # batches of two loaders arrive in two threads
            if self.pinned is None:
                self.pinned = _pin(self.base, self.nbytes)
                if self.pinned:
                    weakref.finalize(self, _unpin, self.base, os.getpid()).atexit = False
        start = self.head + slot * self.slot_bytes
        mv = memoryview(self.mm)[start:start + nbytes]
        weakref.finalize(mv, self.release, slot).atexit = False
        return torch.frombuffer(mv, dtype=torch.uint8)

    def reap(self) -> None:
        """Free the released slots whose copies are done (in the training process; every
        thread a batch arrives in reaps every ring, so one at a time)."""
        with self.guard:
            while self.pending and self.pending[0][1].query():
                self.owner[self.pending.popleft()[0]] = FREE

    def release(self, slot: int) -> None:
        """The last tensor on ``slot`` is gone. Pinned, the slot is free once the work queued so
        far on this thread's CUDA stream is done (a ``non_blocking`` copy may still read it).
        Nothing in a process forked from the training one (not the slot's holder)."""
        if os.getpid() != self.pid:
            return
        if self.pinned:
            try:
                done = torch.cuda.Event()
                done.record()
                with self.guard:
                    self.pending.append((slot, done))
                return
            except RuntimeError:  # CUDA gone (interpreter exit): nothing reads the slot
                pass
        self.owner[slot] = FREE


def locate(t: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """Where a worker's batch lies in a ring, or None (then it travels as a tensor)."""
    return next((w for w in (r.locate(t) for r in list(_RINGS.values())) if w is not None), None)


def arrived(data):
    """In the training process, an arriving batch's data: the view of its ring slot where
    ``data`` is ``(token, slot, nbytes)``, else ``data``. Every arrival frees the slots whose
    release finished (a ring whose slots all wait on the GPU gets no batch in a slot)."""
    for ring in list(_RINGS.values()):
        ring.reap()
    if not isinstance(data, tuple):
        return data
    ring = _RINGS.get(data[0])
    if ring is None:
        raise RuntimeError("a GPU-path batch arrived for a batch ring this process no longer "
                           "has (its loader was deleted while its workers ran)")
    return ring.view(*data[1:])


def _attach(fd, slots: int, slot_bytes: int, head: int, lock, token: int) -> BatchRing:
    """In a worker started by spawn or forkserver: the training process's ring."""
    ring = BatchRing.__new__(BatchRing)
    ring.fd, ring.slots, ring.slot_bytes, ring.head = fd.detach(), slots, slot_bytes, head
    ring._map(lock, token)
    return ring


def _detached() -> BatchRing:
    ring = BatchRing.__new__(BatchRing)
    ring.mm, ring.fd = None, -1
    return ring


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _pin(base: int, nbytes: int) -> bool:
    """Register the mapping with CUDA as pinned memory (False where CUDA says no: the
    batches are then copied by the pin thread as before)."""
    if not torch.cuda.is_available():
        return False
    return int(torch.cuda.cudart().cudaHostRegister(base, nbytes, 1)) == 0  # 1: portable


def _unpin(base: int, pid: int) -> None:
    if os.getpid() == pid:  # never in a forked child, where CUDA cannot run
        torch.cuda.cudart().cudaHostUnregister(base)
