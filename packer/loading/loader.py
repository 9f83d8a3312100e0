"""``make_loader`` and the one type it returns, ``PackedLoader``: a DataLoader set up for
throughput, one epoch per ``iter()``, resumable mid-epoch."""
from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import os
import sys
import weakref
from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from .._util.system import usable_cores
from ..reading.sampler import PackedSampler
from .collate import default_collate_for
from .epochs import EpochBatches, EpochPass, EpochStream, StampedCollate, StampedDataset
from .prefetch import LoaderView
from .torchapi import discard_iterator, shutdown_workers

__all__ = ["PackedLoader", "default_context", "default_num_workers", "make_loader", "start_method"]

TOTAL_PREFETCH = 8  # batches in flight across all workers, see make_loader
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()  # worker iterators with an exit hook


class PackedLoader(LoaderView):
    """What ``make_loader`` returns: a DataLoader's surface (``loader`` is the one inside), plus
    ``set_epoch`` and, where it can resume (``resumable``), ``state_dict`` / ``load_state_dict``
    counting the batches the training loop received. Over a ``PackedSampler`` the workers run
    on into the next epoch (``packer.loading.epochs``) and the state is the sampler's."""

    def __init__(self, loader: DataLoader, stream: Optional[EpochStream] = None):
        self.loader, self.stream = loader, stream

    @property
    def dataset(self):
        return self.loader.dataset.dataset if self.stream else self.loader.dataset

    @property
    def sampler(self):
        return self.stream.batches.sampler if self.stream else self.loader.sampler

    @property
    def batch_sampler(self):
        """The epoch's batches of indices from where the sampler is, over a copy of it
        (iterating the sampler itself would move its position)."""
        if not self.stream:
            return self.loader.batch_sampler
        b = self.stream.batches
        return BatchSampler(b.sampler.epoch_copy(), b.batch_size, b.drop_last)

    @property
    def collate_fn(self) -> Callable:
        return self.loader.collate_fn.collate if self.stream else self.loader.collate_fn

    def __len__(self) -> int:
        return len(self.stream.batches) if self.stream else len(self.loader)

    def __iter__(self) -> Iterator:
        return EpochPass(self.stream, self._start) if self.stream else self._start()

    def _start(self, fresh: bool = False) -> Iterator:
        """``iter(loader)``, its new workers shut down at interpreter exit (a weak hook registered
        now) before multiprocessing's handler joins them one by one (pytorch#81794);
        ``fresh``: new workers, not the kept ones (one of them died)."""
        if fresh:
            discard_iterator(self.loader)
        it = iter(self.loader)
        if self.loader.num_workers and it not in _HOOKED:
            _HOOKED.add(it)
            atexit.register(_stop_at_exit, weakref.ref(it))
        return it

    @property
    def resumable(self) -> bool:
        """Whether ``state_dict`` / ``load_state_dict`` exist: over a ``PackedSampler``, or
        a ``StatefulDataLoader`` inside (``stateful=True``)."""
        return self.stream is not None or hasattr(self.loader, "state_dict")

    @property
    def state_dict(self) -> Callable[[], dict]:
        """``state_dict()``: the state after the last batch handed out."""
        if not self.resumable:
            raise AttributeError("state_dict")
        return self._save

    @property
    def load_state_dict(self) -> Callable[[dict], None]:
        """``load_state_dict(state)``: the next ``iter()`` continues after the last batch
        handed out before ``state`` was saved."""
        if not self.resumable:
            raise AttributeError("load_state_dict")
        return self._load

    def _save(self) -> dict:
        return {"sampler": self.sampler.state_dict()} if self.stream else self.loader.state_dict()

    def _load(self, state: dict) -> None:
        if self.stream is None:
            self.loader.load_state_dict(state)
        elif not isinstance(state, dict) or set(state) != {"sampler"}:
            raise ValueError("not the state of a loader over a PackedSampler: pass what "
                             "state_dict() of make_loader's loader returned ({'sampler': ...})")
        else:
            self.sampler.load_state_dict(state["sampler"])

    def __getattr__(self, name: str):  # num_workers, pin_memory...: the DataLoader's
        if name in ("state_dict", "load_state_dict"):  # their properties said no
            raise AttributeError(
                f"this loader cannot resume, so it has no {name}(): make_loader resumes over a "
                f"PackedSampler (its default when given no sampler) or with stateful=True")
        if name.startswith("_") or name in ("loader", "stream"):
            raise AttributeError(name)
        if self.stream and name in ("batch_size", "drop_last"):
            return getattr(self.stream.batches, name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        how = "stream over " + repr(self.sampler) if self.stream else type(self.loader).__name__
        return f"PackedLoader({how}, batch_size={self.batch_size}, num_workers={self.num_workers})"


def _stop_at_exit(ref) -> None:
    it = ref()
    if it is not None:
        shutdown_workers(it)


def default_num_workers() -> int:
    """Cores this process may use (affinity and cgroup quota), shared among the ranks of this host
    (``LOCAL_WORLD_SIZE``), less one per rank when there are several (docs/loading.md)."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, usable_cores() // local - (local > 1))


def default_context() -> Optional[str]:
    """The workers' start method when the caller names none: the platform's (None), but
    forkserver in a Linux process whose default is spawn (docs/loading.md)."""
    if sys.platform.startswith("linux") and mp.get_start_method(allow_none=True) == "spawn":
        return "forkserver"
    return None


def make_loader(dataset, batch_size: Optional[int], *, shuffle: Optional[bool] = None,
                sampler=None, num_workers: Optional[int] = None, drop_last: bool = False,
                channels_last: bool = True, pin_memory: Optional[bool] = None,
                prefetch_factor: Optional[int] = None, persistent_workers: bool = True,
                multiprocessing_context=None, collate_fn: Optional[Callable] = None,
                stateful: bool = False, **kwargs) -> PackedLoader:
    """A ``PackedLoader``: DataLoader workers set up for throughput; every choice can be
    overridden (docs/loading.md).

    Args:
        dataset: images as uint8 ``(C, H, W)`` tensors, e.g. ``PackedDataset(root,
            decode=DecodeRandomResizedCrop(224))``.
        batch_size: samples per batch (``None`` with ``batch_sampler=`` in kwargs).
        shuffle: default True without a ``sampler``: a map-style dataset then gets a
            ``PackedSampler`` (seeded from ``generator`` or torch's), so it resumes.
        sampler: e.g. ``PackedSampler(ds, seed=0)`` or ``DistributedSampler``.
        num_workers: default ``default_num_workers()`` (usable cores / ranks on this host).
        channels_last: collate images into channels_last memory.
        pin_memory: default True when CUDA is available.
        prefetch_factor: default: about ``TOTAL_PREFETCH`` batches in flight, >= 2 per worker.
        persistent_workers: keep workers (and their open shards) across epochs.
        multiprocessing_context: None (``default_context()``), "spawn" or "forkserver".
        collate_fn: default ``collate_uint8`` (``collate_detection`` for detection).
        stateful: without a ``PackedSampler``, iterate ``StatefulDataLoader`` so it can resume.
        **kwargs: passed to ``DataLoader``."""
    batch_size, shuffle = _batching(dataset, batch_size, shuffle, sampler, drop_last, kwargs)
    _check_decoded(dataset)
    num_workers = _workers(num_workers, prefetch_factor, multiprocessing_context, kwargs)
    kwargs.update(num_workers=num_workers, persistent_workers=persistent_workers and num_workers > 0,
                  pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)
    collate_fn = collate_fn or default_collate_for(dataset, channels_last)
    iterable = isinstance(dataset, IterableDataset)
    if sampler is None and kwargs.get("batch_sampler") is None and not iterable:
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=kwargs.get("generator")))
        sampler = PackedSampler(dataset, shuffle=shuffle, seed=seed if shuffle else 0,
                                num_replicas=1, rank=0)
    if isinstance(sampler, PackedSampler) and not iterable:
        batches = EpochBatches(sampler, batch_size, drop_last)
        if num_workers:
            kwargs.setdefault("in_order", False)
        loader = DataLoader(StampedDataset(dataset), batch_sampler=batches,
                            collate_fn=StampedCollate(collate_fn), **kwargs)
        return PackedLoader(loader, EpochStream(batches))
    return PackedLoader(_loader_class(stateful)(
        dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, drop_last=drop_last,
        collate_fn=collate_fn, **kwargs))


def _batching(dataset, batch_size, shuffle, sampler, drop_last, kwargs: dict):
    """``(batch_size, shuffle)`` checked, with DataLoader's values for ``batch_sampler=``."""
    if kwargs.get("batch_sampler") is not None:
        if batch_size is not None or sampler is not None or shuffle or drop_last:
            raise ValueError("batch_sampler= decides batches itself: pass batch_size=None and no "
                             "shuffle, sampler or drop_last")
        return 1, False
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if shuffle is None:
        return batch_size, sampler is None and not isinstance(dataset, IterableDataset)
    if shuffle and sampler is not None:
        raise ValueError("shuffle=True and sampler= are exclusive: the sampler decides the order "
                         "(DistributedSampler shuffles by itself; call its set_epoch each epoch)")
    return batch_size, bool(shuffle)


def _workers(num_workers, prefetch_factor, context, kwargs: dict) -> int:
    """The worker count (checked), with prefetch_factor and context put into ``kwargs``."""
    if num_workers is None:
        num_workers = default_num_workers()
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0 (0 loads in the main process), "
                         f"got {num_workers!r}")
    if num_workers == 0:
        if prefetch_factor is not None:
            raise ValueError("prefetch_factor needs num_workers > 0 (it counts batches per worker)")
        return 0
    if prefetch_factor is None:
        prefetch_factor = max(2, math.ceil(TOTAL_PREFETCH / num_workers))
    if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be an int >= 1, got {prefetch_factor!r}")
    kwargs["prefetch_factor"] = prefetch_factor
    kwargs["multiprocessing_context"] = context = default_context() if context is None else context
    if start_method(context) == "spawn":
        kwargs["worker_init_fn"] = _ExitLikeFork(kwargs.get("worker_init_fn"))
    return num_workers


def start_method(context=None) -> str:
    """How workers of a DataLoader with ``multiprocessing_context=context`` start ("fork",
    "spawn", "forkserver"), without fixing the process's default."""
    named = context if isinstance(context, str) else getattr(context, "get_start_method", None)
    method = named() if callable(named) else named
    return method or mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]


class _ExitLikeFork:
    """A spawned worker's ``worker_init_fn``: the caller's, then ``os._exit(0)`` at exit as forked
    workers end (finalizing while a queue's feeder thread is in torch's C++ aborts a worker
    stopped mid-stream, docs/loading.md); the worker loop reports every error through its queue."""

    def __init__(self, fn: Optional[Callable]):
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        atexit.register(_exit_now)  # registered first: hooks the worker adds later still run
        if self.fn is not None:
            self.fn(worker_id)


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


def _loader_class(stateful: bool):
    if not stateful:
        return DataLoader
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise ImportError("make_loader(stateful=True) without a PackedSampler needs torchdata's "
                          "StatefulDataLoader: pip install torchdata, or read through a "
                          "PackedSampler, which resumes by itself") from None
    return StatefulDataLoader


def _check_decoded(dataset) -> None:
    """Fail now, not in a worker, for a PackedDataset that would hand out PIL images."""
    from ..reading.dataset import PackedDataset
    from ..reading.mixture import Mixture
    if isinstance(dataset, Mixture):
        for source in dataset.sources:
            _check_decoded(source)
    elif (isinstance(dataset, PackedDataset) and dataset.decode is None
          and dataset.transform is None and dataset.transforms is None):
        raise ValueError("this PackedDataset returns PIL images; make_loader needs uint8 tensors: "
                         "pass decode=DecodeRandomResizedCrop(224) (training) or "
                         "decode=DecodeCenterCrop(224) (evaluation) to PackedDataset, or a "
                         "transform ending in torchvision.transforms.PILToTensor() (detection: "
                         "decode=DecodeLetterbox(640), or transforms= ending in v2.ToImage())")
