"""The CPU loading path under attack: a worker that dies after the loop has received batches, a
pass taken by count (``islice``), an exception type that cannot be pickled, the CPU
prefetcher's state after a batch that raised."""
from __future__ import annotations

import itertools
import os
import threading
import time

import torch
from torch.utils.data import Dataset

from packer import CUDAPrefetcher, make_loader


class Labelled(Dataset):
    """Sample i: label i. ``die_at``: the first worker to read that sample exits (an OOM kill),
    once (``flag``); ``bad``: those samples raise ``error(i)``."""

    def __init__(self, n, die_at=None, flag=None, bad=(), error=ValueError):
        self.n, self.die_at, self.flag, self.bad, self.error = n, die_at, flag, bad, error

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.die_at and torch.utils.data.get_worker_info() and not self.flag.exists():
            self.flag.touch()
            os._exit(3)
        if i in self.bad:
            raise self.error(f"sample {i} is bad")
        return torch.zeros(3, 2, 2, dtype=torch.uint8), i


def drain(loader, pause: float = 0.0, got=None, errors=None):
    """(every label of one pass over ``loader``, the messages of the RuntimeErrors it raised on
    the way: the pass goes on after each), ``pause`` seconds before each batch."""
    it, got, errors = iter(loader), [] if got is None else got, [] if errors is None else errors
    while True:
        time.sleep(pause)
        try:
            got += next(it)[1].tolist()
        except StopIteration:
            return got, errors
        except RuntimeError as e:
            errors.append(str(e))


def test_a_worker_that_dies_mid_epoch_costs_no_batch_and_repeats_none(tmp_path):
    # the stream restarted at the epoch's start: the batches the loop had received came again
    # and as many at the end were lost (the pass still counted len(loader) batches)
    ds = Labelled(200, die_at=150, flag=tmp_path / "died")  # batch 37: well after the first
    loader = make_loader(ds, 4, shuffle=False, num_workers=2, pin_memory=False)
    got, errors = drain(loader)
    assert len(errors) == 1 and "exit" in errors[0] and got == list(range(200)), errors
    assert [i for _, y in loader for i in y.tolist()] == list(range(200))  # and then a whole one


class SharerDies(Labelled):
    """``Labelled`` whose first worker to read ``die_at`` first stops serving the shared memory
    of the batches it already sent, then exits a second later: an exiting worker that its
    parent does not yet see dead (torch then raises the raw connection error)."""

    def __getitem__(self, i):
        if i == self.die_at and torch.utils.data.get_worker_info() and not self.flag.exists():
            from multiprocessing import resource_sharer
            self.flag.touch()
            time.sleep(0.2)  # the batch before has been sent
            resource_sharer._resource_sharer.stop()
            time.sleep(1.0)
            os._exit(3)
        return super().__getitem__(i)


def test_a_batch_from_a_worker_still_exiting_is_a_worker_death_not_a_connection_error(tmp_path):
    # unpickling a batch whose sender is exiting fails to connect to it; torch calls that a
    # worker death only once the worker is seen dead, else re-raises the connection error
    loader = make_loader(SharerDies(40, die_at=20, flag=tmp_path / "died"), 4, shuffle=False,
                         num_workers=2, pin_memory=False)
    got, errors = drain(loader, pause=0.3)  # the dying worker's sent batches wait in the queue
    assert len(errors) == 1 and "exited unexpectedly" in errors[0]
    assert got == list(range(40))


class SlowDies(Labelled):
    """``Labelled`` that reads slowly (the loop keeps up: no result of the dying worker is still
    in the queue when it exits)."""

    def __getitem__(self, i):
        time.sleep(0.02)
        return super().__getitem__(i)


def test_a_worker_that_dies_under_a_loop_in_a_thread_is_an_error_not_a_hang(tmp_path):
    # torch sees a dead worker in its SIGCHLD handler (main thread only) or when its queue stays
    # empty; the other workers kept it busy with later batches, which piled up without end
    # while the stream waited for the dead one's
    loader = make_loader(SlowDies(200, die_at=50, flag=tmp_path / "died"), 4, shuffle=False,
                         num_workers=2, pin_memory=False)
    got, errors = [], []
    thread = threading.Thread(target=drain, args=(loader, 0.0, got, errors), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"hung after {len(got)} samples, {len(loader.stream.early)} held"
    assert len(errors) == 1 and "exited unexpectedly" in errors[0] and got == list(range(200))


def test_a_pass_taken_by_count_ends_and_the_next_one_is_the_next_epoch():
    # islice(loader, len(loader)) (zip with a step range, a fixed steps-per-epoch) never asks for
    # the StopIteration: the sampler stayed at epoch 0, every "epoch" the same order, and each
    # restarted the stream (its workers had run on into epoch 1)
    loader = make_loader(Labelled(40), 8, num_workers=2, pin_memory=False,
                         generator=torch.Generator().manual_seed(0))
    by_count = [[i for _, y in itertools.islice(loader, len(loader)) for i in y.tolist()]
                for _ in range(3)]
    whole = make_loader(Labelled(40), 8, num_workers=2, pin_memory=False,
                        generator=torch.Generator().manual_seed(0))
    assert by_count == [[i for _, y in whole for i in y.tolist()] for _ in range(3)]
    assert loader.sampler.epoch == 2 and loader.state_dict()["sampler"]["consumed"] == 40


def test_a_pass_taken_by_count_still_repeats_an_epoch_set_again():
    loader = make_loader(Labelled(40), 8, num_workers=0)
    first = [i for _, y in itertools.islice(loader, len(loader)) for i in y.tolist()]
    loader.set_epoch(0)  # no-op on the sampler's epoch, then a resume into it: a state wins
    loader.load_state_dict({"sampler": {**loader.state_dict()["sampler"], "consumed": 0}})
    assert [i for _, y in loader for i in y.tolist()] == first


def make_local_error():
    class LocalError(Exception):  # no importable name: pickling its type fails
        pass
    return LocalError


def test_an_error_whose_type_cannot_be_pickled_raises_in_turn_not_hangs():
    # the worker's result could not be pickled: the batch was lost in the queue's feeder thread
    # and the loop waited for it for ever (timeout= here only to fail, not hang)
    ds = Labelled(40, bad={9}, error=make_local_error())
    loader = make_loader(ds, 4, shuffle=False, num_workers=2, pin_memory=False, timeout=10)
    it, seen = iter(loader), []
    while len(seen) < 12:
        try:
            seen.append(next(it)[1].tolist())
        except StopIteration:
            break
        except RuntimeError as e:
            seen.append(str(e))
    assert seen[2].startswith("Caught LocalError in DataLoader worker process ")
    assert "sample 9 is bad" in seen[2]
    assert seen[:2] + seen[3:] == [list(range(i, i + 4)) for i in range(0, 40, 4) if i != 8]


def test_the_cpu_prefetcher_counts_a_batch_that_raised_as_the_loader_does():
    # on the CPU the prefetcher kept the state before the failed batch: a checkpoint taken after
    # catching the error resumed into the failed batch again; the loader (and the GPU path)
    # count it as handed out
    loader = make_loader(Labelled(40, bad={9}), 4, shuffle=False, num_workers=0)
    feed = CUDAPrefetcher(loader, mean=None, std=None, device="cpu")
    it = iter(feed)
    next(it), next(it)
    try:
        next(it)
    except ValueError:
        pass
    assert feed.state_dict() == {"loader": loader.state_dict()}
    assert loader.state_dict()["sampler"]["consumed"] == 12
