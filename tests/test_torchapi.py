"""Each use of torch's private API (``packer.loading.torchapi``), exercised on real
DataLoader worker processes: run on the oldest and the newest torch packer supports."""
from __future__ import annotations

import multiprocessing
import os

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from packer.loading.torchapi import (dead_workers, discard_iterator, plain_tensors, shared_empty,
                                     shared_storage, shutdown_workers, storage_key)


class Filled(Dataset):
    """Sample i: a (3, 4) int32 tensor of i made with ``shared_empty`` in the worker, and
    the worker's pid."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        t = shared_empty((3, 4), torch.int32)
        assert get_worker_info() is not None and t.is_shared()
        return t.fill_(i), os.getpid()


def test_shared_storage_is_uninitialised_shared_memory_of_the_size_asked():
    s = shared_storage(1000)
    assert s.is_shared() and s.nbytes() == 1000 and shared_storage(0).nbytes() == 1
    t = shared_empty((2, 3, 5), torch.float64)
    assert t.is_shared() and t.shape == (2, 3, 5) and t.dtype == torch.float64
    assert t.is_contiguous() and t.untyped_storage().nbytes() == 2 * 3 * 5 * 8


def test_a_shared_empty_tensor_crosses_from_a_worker_unchanged():
    loader = DataLoader(Filled(), batch_size=None, num_workers=2)
    got = [(t.tolist(), pid) for t, pid in loader]
    assert [t for t, _ in got] == [[[i] * 4] * 3 for i in range(6)]
    assert os.getpid() not in {pid for _, pid in got}


def test_shutdown_workers_stops_the_workers_now():
    loader = DataLoader(Filled(), batch_size=None, num_workers=2, persistent_workers=True)
    it = iter(loader)
    pids = {next(it)[1] for _ in range(6)}
    assert pids <= {p.pid for p in multiprocessing.active_children()}
    shutdown_workers(it)
    assert not pids & {p.pid for p in multiprocessing.active_children()}
    shutdown_workers(iter(DataLoader(range(3))))  # no workers: nothing to do


def test_discard_iterator_stops_the_kept_workers_and_the_next_iter_starts_new_ones():
    loader = DataLoader(Filled(), batch_size=None, num_workers=2, persistent_workers=True)
    old = {pid for _, pid in loader}
    discard_iterator(loader)
    assert not old & {p.pid for p in multiprocessing.active_children()}
    new = {pid for _, pid in loader}
    assert new and not new & old
    discard_iterator(DataLoader(range(3)))  # never iterated: nothing to do


def test_dead_workers_names_the_workers_that_exited():
    import signal
    import time
    loader = DataLoader(Filled(), batch_size=None, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    assert dead_workers(it) == [] and dead_workers(iter(DataLoader(range(3)))) == []
    t0 = time.monotonic()  # no workers: nothing to wait for
    assert dead_workers(iter(DataLoader(range(3))), wait=30) == [] and time.monotonic() - t0 < 1
    victim = it._workers[0].pid
    handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # not torch's: it would raise here
    try:
        os.kill(victim, signal.SIGKILL)
        assert dead_workers(it, wait=30) == [victim]  # waits until it is seen dead
    finally:
        signal.signal(signal.SIGCHLD, handler)
        shutdown_workers(it)



class Counted(torch.Tensor):
    """A tensor subclass that counts its ``__torch_function__`` calls, as tv_tensors have one."""
    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Counted.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_plain_tensors_runs_a_subclass_s_methods_without_its_torch_function():
    t = torch.arange(4.0).as_subclass(Counted)
    Counted.calls = 0
    assert type(t.add(1)) is Counted and Counted.calls > 0
    Counted.calls = 0
    with plain_tensors():
        out = t.add(1)
    assert Counted.calls == 0 and type(out) is torch.Tensor and out.tolist() == [1, 2, 3, 4]
    assert type(t.add(1)) is Counted  # only inside


def test_storage_key_is_one_per_storage_and_tells_an_alias_of_the_same_memory_apart():
    t = torch.arange(12.0)
    assert storage_key(t) == storage_key(t[3:7]) == storage_key(t.view(3, 4).T)
    assert storage_key(t) != storage_key(t.clone())
    alias = torch.from_dlpack(t)
    assert alias.data_ptr() == t.data_ptr() and storage_key(alias) != storage_key(t)
