"""No stall at epoch boundaries: one DataLoader stream (``EpochBatches``) runs on into the next
epoch; batches carry their place (``Numbered``) and ``EpochStream`` hands them out in order."""
from __future__ import annotations

import itertools
import pickle
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional

from torch.utils.data import get_worker_info

from ..reading.sampler import PackedSampler, rank_count
from .torchapi import dead_workers

__all__ = ["EpochBatches", "EpochPass", "EpochStream", "Failed", "Numbered", "StampedCollate",
           "StampedDataset"]

EXIT_WAIT = 5.0  # seconds a connection error waits for its worker to be seen dead


class Numbered(list):
    """A batch of indices that knows its place in the stream (``seq``)."""

    def __init__(self, indices: List[int], seq: int):
        super().__init__(indices)
        self.seq = seq


class StampedDataset:
    """``dataset`` read a batch at a time, keeping its ``seq``; other attributes: the dataset's."""

    def __init__(self, dataset):
        object.__setattr__(self, "dataset", dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, batch: Numbered) -> Numbered:
        try:
            many = getattr(self.dataset, "__getitems__", None)
            samples = many(list(batch)) if many else [self.dataset[i] for i in batch]
        except Exception as e:  # noqa: B902 - it is raised again in the batch's turn
            samples = [Failed(e)]
        return Numbered(samples, batch.seq)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.dataset, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.dataset, name)


class StampedCollate:
    """``(seq, collate(samples))``, or ``(seq, Failed)`` where reading or collating raised."""

    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, samples: Numbered):
        if samples and isinstance(samples[0], Failed):
            return samples.seq, samples[0]
        try:
            return samples.seq, self.collate(samples)
        except Exception as e:  # noqa: B902 - it is raised again in the batch's turn
            return samples.seq, Failed(e)


class Failed:
    """The exception a batch raised, raised again in its turn: as itself in this process; from a
    worker as the same type (else ``RuntimeError``) with the worker's traceback."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __reduce__(self):
        info = get_worker_info()
        where = f"in DataLoader worker process {info.id}" if info else "in a DataLoader worker"
        cls = type(self.exc)
        text = "".join(traceback.format_exception(cls, self.exc, self.exc.__traceback__))
        try:  # a type with no importable name (made in a function, botocore's error factory)
            pickle.dumps(cls)  # would fail in the queue's feeder thread: the batch lost, the
        except Exception:  # noqa: B902 - loop waiting for it for ever
            cls = RuntimeError
        return failed_from, (cls, f"Caught {type(self.exc).__name__} {where}.\nOriginal {text}")

    def reraise(self):
        try:
            raise self.exc
        finally:  # no cycle (exception -> traceback -> this frame -> self -> exception) that
            self.exc = None  # would keep a dropped loader's workers until the collector runs


class WorkerKeyError(KeyError):
    """A worker's ``KeyError`` with its traceback: shown as text (a KeyError shows its
    argument's repr, the traceback on one line with its line breaks escaped)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def failed_from(cls: type, message: str) -> Failed:
    if cls is KeyError:
        return Failed(WorkerKeyError(message))
    try:
        return Failed(cls(message))
    except Exception:  # noqa: B902 - a type that needs other arguments
        return Failed(RuntimeError(message))


class EpochBatches:
    """Batches of ``sampler``'s indices (from a copy), epoch after epoch, none spanning two."""

    def __init__(self, sampler: PackedSampler, batch_size: int, drop_last: bool = False):
        self.sampler, self.batch_size, self.drop_last = sampler, int(batch_size), bool(drop_last)

    def per_epoch(self, samples: int) -> int:
        """Batches of an epoch of ``samples`` on this rank."""
        return rank_count(samples, 0, self.batch_size, self.drop_last)

    def __len__(self) -> int:  # one epoch's worth, as DataLoader's len() reports it
        return self.per_epoch(len(self.sampler))

    def __iter__(self) -> Iterator[Numbered]:
        epoch = self.sampler.epoch_copy()  # from the caller's position (a resume), once
        if not self.per_epoch(len(epoch.epoch_copy(epoch.epoch + 1))):
            return  # every epoch empty (fewer samples than a batch, with drop_last)
        seq = itertools.count()
        while True:
            indices = iter(epoch)
            while batch := list(itertools.islice(indices, self.batch_size)):
                if len(batch) == self.batch_size or not self.drop_last:
                    yield Numbered(batch, next(seq))
            epoch = epoch.epoch_copy(epoch.epoch + 1)


class EpochStream:
    """Epochs (``EpochPass``) from a DataLoader over ``StampedDataset`` batched by ``batches``.
    Each batch handed out is reported to the sampler (``received``); if the sampler is not where
    the stream is (``set_epoch``, a resume), the batches made ahead are dropped and it restarts."""

    def __init__(self, batches: EpochBatches):
        self.batches = batches
        self.it: Optional[Iterator] = None
        self.at: Optional[tuple] = None  # (epoch, start, seed, shuffle, order) the stream is at
        self.early: Dict[int, Any] = {}  # batches that came before their turn, by seq
        self.seq = 0  # the stream's next batch to hand out
        self.broken = False  # the DataLoader raised: its workers are not to be reused
        self.spent: Optional[tuple] = None  # where a pass that handed out its last batch left

    def begin(self, start: Callable[..., Iterator]) -> None:
        """Restart the stream unless it is where the sampler is; then mark it mid-epoch (a
        new pass before this one ends restarts it). A pass that handed out all its batches
        but was not asked for more (``islice(loader, len(loader))``) ended all the same."""
        if self.spent is not None and self.spent == spent_at(self.batches.sampler):
            self.end()
        self.spent = None
        if self.it is None or self.at != position(self.batches.sampler):
            # a new stream from the sampler as it is now; new workers where one died
            self.it = start(fresh=True) if self.broken else start()
            self.early, self.seq, self.broken = {}, 0, False
        self.at = None

    def end(self) -> None:
        """A complete pass: the sampler moves to the next epoch, which the stream is in."""
        s = self.batches.sampler
        s.set_epoch(s.epoch + 1)
        self.at, self.spent = position(s), None

    def next_in_order(self):
        """The stream's next batch; those that finish before it wait in ``early``."""
        while self.seq not in self.early:
            try:
                seq, batch = next(self.it)
                if seq != self.seq and (dead := dead_workers(self.it)):  # the others' batches
                    raise worker_death(dead)  # would keep the queue busy, piling up here
            except Exception as e:  # noqa: B902 - the DataLoader's own (a worker died): its
                it, self.it, self.broken = self.it, None, True  # batches are lost, so the next
                # batch restarts the stream where the loop is, with new workers, not wait for
                # ever. A batch from a worker still exiting fails to connect to it (torch
                # re-raises that until it sees the worker dead): that too is the worker's death
                if isinstance(e, (EOFError, OSError)) and (dead := dead_workers(it, EXIT_WAIT)):
                    raise worker_death(dead) from e
                raise
            self.early[seq] = batch
        self.seq += 1
        return self.early.pop(self.seq - 1)


class EpochPass:
    """One epoch of an ``EpochStream``, as a DataLoader iterator; ``start()`` (``iter(loader)``)
    (re)starts the stream. A batch that raised is counted and raised; ``next()`` goes on."""

    def __init__(self, stream: EpochStream, start: Callable[[], Iterator]):
        self.stream, self.start = stream, start
        self.count: Optional[int] = None  # batches in this pass, known once it starts
        self.done = 0

    def __iter__(self) -> "EpochPass":
        return self

    def __next__(self):
        stream, s = self.stream, self.stream.batches.sampler
        if self.count is None:
            stream.begin(self.start)
            self.count, self.first = stream.batches.per_epoch(len(s)), s.start
        if self.done == self.count:
            stream.end()
            self.done = -1  # StopIteration from now on, as iterators do
        if self.done < 0:
            raise StopIteration
        if stream.it is None:  # broken by an error of the DataLoader's own: restart where the
            s.load_state_dict(s.state_dict(self.reached()))  # loop is, not at the pass's start
            stream.begin(self.start)
        batch = stream.next_in_order()
        self.done += 1
        s.received(self.reached())
        if self.done == self.count:
            stream.spent = spent_at(s)
        if isinstance(batch, Failed):
            failed, batch = batch, None
            failed.reraise()
        return batch

    def reached(self) -> int:
        """Global samples of the epoch the loop has received in this pass."""
        s = self.stream.batches.sampler
        return min(self.first + self.done * self.stream.batches.batch_size * s.num_replicas, s.size)


def worker_death(pids: list) -> RuntimeError:
    return RuntimeError(f"DataLoader worker (pid(s) {', '.join(map(str, pids))}) exited "
                        f"unexpectedly")


def position(s: PackedSampler) -> tuple:
    return s.epoch, s.start, s.seed, s.shuffle, s.order


def spent_at(s: PackedSampler) -> tuple:
    """Where the sampler is, down to the samples received: unchanged until the next pass unless
    the caller moved it (``set_epoch``, ``load_state_dict``)."""
    return *position(s), s.state_dict()["consumed"]
