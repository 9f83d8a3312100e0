"""``PackedIterableDataset``: stream records nearly sequentially, shuffled through a buffer;
each (rank, worker) reads one contiguous run of a block-order epoch. No mid-epoch resume."""
from __future__ import annotations

import itertools
import os
import random
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..format.manifest import dataset_schema
from ..format.records import unpack_record
from .dataset import to_sample
from .targets import TargetMaker
from .reader import ShardReader
from .sampler import global_order, rank_count, resolve_world, seed_for


class PackedIterableDataset(IterableDataset):
    """Iterable dataset over a packed dataset, split across DDP ranks and DataLoader workers.

    Args (others as for ``PackedDataset`` and ``PackedSampler``):
        shuffle: permute blocks per epoch and mix through the buffer; ``False`` streams ``0..n-1``.
        shuffle_buffer: encoded records held per worker (0 or 1: no buffer).
        block_size: consecutive records read as one sequential run before jumping.

    Call ``set_epoch(epoch)`` before each epoch; it reaches existing workers (shared memory)."""

    def __init__(self, root: os.PathLike, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None, *,
                 decode: Optional[Callable[[bytes], Any]] = None, shuffle: bool = True,
                 shuffle_buffer: int = 1024, block_size: int = 1024, seed: int = 0,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 drop_last: bool = False):
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0 records, got {shuffle_buffer}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 record, got {block_size}")
        self.root = os.fspath(root)
        self.reader = ShardReader(root)
        self.make_target = TargetMaker(dataset_schema(self.reader.manifest))
        self.transform, self.target_transform, self.decode = transform, target_transform, decode
        self.shuffle, self.shuffle_buffer = bool(shuffle), int(shuffle_buffer)
        self.block_size, self.seed, self.drop_last = int(block_size), int(seed), bool(drop_last)
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(int(epoch))

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all its workers together)."""
        return rank_count(len(self.reader), 0, self.num_replicas, self.drop_last)

    def positions(self, worker: int = 0, workers: int = 1) -> Tuple[int, int]:
        """The [lo, hi) run of global-order positions ``worker`` reads (past the end: padding)."""
        per_rank = len(self)
        lo = self.rank * per_rank
        return lo + per_rank * worker // workers, lo + per_rank * (worker + 1) // workers

    def __iter__(self) -> Iterator[Tuple[Any, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, n = self.epoch, len(self.reader)
        lo, hi = self.positions(worker, workers)
        if hi <= lo:
            return
        order = global_order(n, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                             order="block", block_size=self.block_size, window=1)
        indices = order[torch.arange(lo, hi) % n]
        rng = random.Random(seed_for(self.seed, epoch, self.rank, worker))
        records = (self.reader.read(i) for c in range(0, len(indices), 8192)
                   for i in indices[c:c + 8192].tolist())
        if self.shuffle and self.shuffle_buffer > 1:
            records = _buffered(records, self.shuffle_buffer, rng)
        for data in records:
            yield to_sample(unpack_record(data), self.decode, self.transform,
                            self.target_transform, make_target=self.make_target)

    def __repr__(self) -> str:
        return (f"PackedIterableDataset({self.root!r}, {len(self.reader)} records, "
                f"rank={self.rank}/{self.num_replicas}, shuffle_buffer={self.shuffle_buffer}, "
                f"seed={self.seed}, epoch={self.epoch})")


def _buffered(items: Iterator, size: int, rng: random.Random) -> Iterator:
    """Shuffle a stream through a buffer of ``size`` items (each item yielded once)."""
    buf = list(itertools.islice(items, size))
    for item in items:
        j = rng.randrange(size)
        yield buf[j]
        buf[j] = item
    rng.shuffle(buf)
    yield from buf
