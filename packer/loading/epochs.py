"""No stall at epoch boundaries: one DataLoader stream that runs on into the next epoch.

A plain DataLoader starts the next epoch's first batches only when the new epoch's iterator
is made, after the last batch of the current one: every worker idles for the time one batch
takes to decode (about a second for 256 ImageNet JPEGs on one worker), and so does the GPU.
``PackedSampler`` knows every epoch's order in advance, so here the batch sampler goes on
from epoch *e*'s last batch to epoch *e + 1*'s first, and the workers never stop:
:class:`EpochLoader` hands out one epoch per ``iter()`` from that endless stream.

The stream draws each epoch from a copy of the sampler (the caller's sampler, its epoch and
its ``state_dict`` stay the caller's). If the caller's next epoch is not the one the stream
ran on into (``set_epoch`` to another number, a resume, an epoch abandoned midway), the
prefetched batches are dropped and the stream restarts there: correct first, fast when used
as a training loop uses it.

Batches are handed to whichever worker has room (DataLoader's ``in_order=False``) and put
back in order here. In order, DataLoader gives batch *k* to worker *k mod W*, so the loader
runs at W times its slowest worker's pace, and with 16 workers on 16 cores one always shares
its core with the main process or the kernel: 0.875 of what 16 busy cores decode, 0.956
when the busier workers take fewer batches (docs/benchmarks.md, issue 16). Each batch
carries its place in the stream (``Numbered``, ``StampedDataset``, ``StampedCollate``);
``EpochLoader`` holds the few that arrive early.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, Iterator, List, Optional

from torch.utils.data import DataLoader

from .prefetch import LoaderView
from ..reading.sampler import PackedSampler

__all__ = ["EpochBatches", "EpochLoader", "Numbered", "StampedCollate", "StampedDataset",
           "unordered"]


def unordered() -> Dict[str, Any]:
    """DataLoader keywords for delivery as batches finish (``in_order``: torch >= 2.6)."""
    return {"in_order": False} if "in_order" in inspect.signature(DataLoader).parameters else {}


class Numbered(list):
    """A batch of indices that knows its place in the stream (``seq``)."""

    def __init__(self, indices: List[int], seq: int):
        super().__init__(indices)
        self.seq = seq


class StampedDataset:
    """``dataset`` read a batch at a time (DataLoader's ``__getitems__``), the samples
    keeping the batch's ``seq``; anything else is the dataset's."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, batch: Numbered) -> Numbered:
        many = getattr(self.dataset, "__getitems__", None)
        samples = many(list(batch)) if many else [self.dataset[i] for i in batch]
        return Numbered(samples, batch.seq)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value) -> None:  # worker_init_fn's info.dataset.x = ...
        if name == "dataset":
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.dataset, name)


class StampedCollate:
    """``(seq, collate(samples))``: the batch and its place in the stream."""

    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, samples: Numbered):
        return samples.seq, self.collate(samples)


class EpochBatches:
    """Batches of ``sampler``'s indices, epoch after epoch, never ending; a batch never spans
    two epochs (the last one of an epoch may be short unless ``drop_last``)."""

    def __init__(self, sampler: PackedSampler, batch_size: int, drop_last: bool = False):
        self.sampler, self.batch_size, self.drop_last = sampler, int(batch_size), bool(drop_last)

    def per_epoch(self, samples: int) -> int:
        """Batches of an epoch of ``samples`` on this rank."""
        return samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)

    def __len__(self) -> int:  # one epoch's worth, as DataLoader's len() reports it
        return self.per_epoch(len(self.sampler))

    def __iter__(self) -> Iterator[Numbered]:
        epoch = self.sampler.epoch_copy()  # from the caller's position (a resume), once
        seq = 0
        while True:
            batch: List[int] = []
            for index in epoch:
                batch.append(index)
                if len(batch) == self.batch_size:
                    yield Numbered(batch, seq)
                    batch, seq = [], seq + 1
            if batch and not self.drop_last:
                yield Numbered(batch, seq)
                seq += 1
            epoch = epoch.epoch_copy(epoch.epoch + 1)


class EpochLoader(LoaderView):
    """One epoch per ``iter()``, from a DataLoader whose workers run on into the next epoch
    (``make_loader`` returns one for a ``PackedSampler``; see the module docstring).

    ``len()``, ``.dataset``, ``.sampler`` (the caller's ``PackedSampler``), ``set_epoch``
    work as on the DataLoader; the sampler's ``state_dict`` counts the batches handed out.
    """

    def __init__(self, loader, batches: EpochBatches):
        self.loader, self.batches = loader, batches
        self._it: Optional[Iterator] = None
        self._at: Optional[tuple] = None  # (epoch, start, seed, shuffle, order) the stream is at
        self._early: Dict[int, Any] = {}  # batches that came before their turn, by seq
        self._seq = 0  # the stream's next batch to hand out

    @property
    def dataset(self):
        return getattr(self.loader.dataset, "dataset", self.loader.dataset)

    @property
    def collate_fn(self):
        return getattr(self.loader.collate_fn, "collate", self.loader.collate_fn)

    @property
    def sampler(self) -> PackedSampler:
        return self.batches.sampler

    @property
    def batch_size(self) -> int:
        return self.batches.batch_size

    def __getattr__(self, name: str):  # num_workers, pin_memory...: the DataLoader's
        if name.startswith("_") or name in ("loader", "batches"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.batches.sampler.set_epoch(epoch)

    def __iter__(self):
        s = self.batches.sampler
        step = self.batches.batch_size * s.num_replicas  # global samples per batch
        want = (s.epoch, s.start, s.seed, s.shuffle, s.order)  # the order the stream must be
        if self._it is None or self._at != want:
            self._it = iter(self.loader)  # a new stream from the sampler as it is now
            self._early, self._seq = {}, 0
        count = self.batches.per_epoch(len(s))
        start = s.start
        self._at = None  # mid-epoch: a new iter() before the end restarts the stream
        if count == 0:  # resumed after the epoch's last batch: this pass is done already
            s.received(start, done=True)
        for k in range(count):
            batch = self._next_in_order()
            s.received(min(start + (k + 1) * step, s.size), done=k + 1 == count)
            yield batch
        self._at = (s.epoch + 1, 0, s.seed, s.shuffle, s.order)  # already into the next epoch

    def _next_in_order(self):
        """The stream's next batch; those that finish before it wait in ``_early``."""
        while self._seq not in self._early:
            seq, batch = next(self._it)
            self._early[seq] = batch
        self._seq += 1
        return self._early.pop(self._seq - 1)
