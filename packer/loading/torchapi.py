"""Every use of torch's private API in packer, in one module, each exercised by
``tests/test_torchapi.py``: the one place to change when torch moves one."""
from __future__ import annotations

import math
import time

import torch

__all__ = ["dead_workers", "discard_iterator", "plain_tensors", "shared_empty", "shared_storage",
           "shutdown_workers", "storage_key"]


def shared_storage(nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` (at least 1) of uninitialised shared memory, as a worker's ``default_collate``
    allocates a batch (``share_memory_()`` would allocate, then copy)."""
    return torch.UntypedStorage._new_shared(max(1, int(nbytes)))


def shared_empty(size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A contiguous, uninitialised tensor of ``size`` in shared memory."""
    size = tuple(size)
    storage = shared_storage(math.prod(size) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, size)


def plain_tensors():
    """A context in which tensor subclasses (torchvision's tv_tensors) run torch's methods as
    plain tensors, without their ``__torch_function__`` (which runs on every call): for
    bookkeeping over many small tensors. Results are plain tensors."""
    return torch._C.DisableTorchFunctionSubclass()


def storage_key(t: torch.Tensor) -> int:
    """Identifies ``t``'s storage: the same for all its views, another for an alias of the
    same memory made elsewhere (a DLPack import, whose ``record_stream`` the allocator
    ignores), unlike ``data_ptr()``."""
    return t.untyped_storage()._cdata


def shutdown_workers(iterator) -> None:
    """Stop a DataLoader iterator's workers (and pin-memory thread) now, as its collection would."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


def dead_workers(iterator, wait: float = 0.0) -> list:
    """Pids of a DataLoader iterator's workers that have exited (none without workers), waiting
    up to ``wait`` seconds for one: torch notices one only in a SIGCHLD handler (main thread
    only) or when its queue stays empty."""
    workers, deadline = getattr(iterator, "_workers", ()), time.monotonic() + wait
    while True:
        dead = [w.pid for w in workers if not w.is_alive()]
        if dead or not workers or time.monotonic() >= deadline:
            return dead
        time.sleep(0.01)


def discard_iterator(loader) -> None:
    """Stop and forget a DataLoader's kept iterator (``persistent_workers``), so that the next
    ``iter()`` starts new workers: after one of them died, the kept one cannot go on."""
    it = getattr(loader, "_iterator", None)
    if it is not None:
        shutdown_workers(it)
        loader._iterator = None
