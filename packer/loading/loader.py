"""Feeding the training loop: ``make_loader`` (a DataLoader tuned for throughput) and the
uint8 collate.

Images stay uint8 from decode to the GPU: a float32 batch is 4x the bytes to collate, to pass
between processes, to pin and to send over PCIe, and the conversion is nearly free on the
GPU (``CUDAPrefetcher`` does it there).
"""
from __future__ import annotations

import atexit
import functools
import math
import multiprocessing as mp
import os
import sys
import weakref
from typing import Callable, Optional

import torch
from torch.utils.data import DataLoader, default_collate, get_worker_info

from .._util.system import usable_cores
from .epochs import EpochBatches, EpochLoader, StampedCollate, StampedDataset, unordered
from ..reading.sampler import PackedSampler
from .batchpool import BatchPool, shared_empty
from .sharedbatch import SharedBatch

try:  # the extensible collate (torch >= 2.0); older torch falls back to default_collate
    from torch.utils.data._utils.collate import collate as _collate
    from torch.utils.data._utils.collate import collate_tensor_fn as _collate_tensor
    from torch.utils.data._utils.collate import default_collate_fn_map as _default_map
except ImportError:  # pragma: no cover
    _collate = None

__all__ = ["collate_detection", "collate_uint8", "default_context", "default_num_workers",
           "make_loader"]

TOTAL_PREFETCH = 8  # batches in flight across all workers, see make_loader


def default_num_workers() -> int:
    """Cores this process may use (affinity mask and cgroup CPU quota), shared among the
    training processes of this host (``LOCAL_WORLD_SIZE``, set by torchrun): one worker per
    core keeps decoding saturated without oversubscribing when 8 ranks share a machine."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, usable_cores() // local)


# -- collate ---------------------------------------------------------------------------------

def collate_uint8(batch, *, channels_last: bool = True):
    """Collate samples whose images are uint8 ``(C, H, W)`` tensors into one uint8 batch.

    Images become one ``(N, C, H, W)`` uint8 tensor, in channels_last memory when asked (the
    layout convolutions on GPU prefer; decoders that hand out HWC buffers make it a plain
    copy). Integer labels become an int64 tensor. Any nesting of tuples, lists and dicts is
    handled; other tensors and values are collated by ``default_collate``'s rules. In a
    worker process the batch is written straight into shared memory, as default_collate does,
    so it crosses to the main process without another copy.

    PIL images are refused with a pointer to ``decode=``: they vary in size and must be
    decoded to tensors in the worker anyway, and decoding straight to a cropped uint8 tensor
    is the fast path.
    """
    if _collate is None:  # pragma: no cover - torch < 2.0
        return default_collate(batch)
    fn_map = dict(_default_map)
    fn_map[torch.Tensor] = functools.partial(_collate_images, channels_last=channels_last)
    try:
        from PIL import Image
        fn_map[Image.Image] = _refuse_pil
    except ImportError:  # pragma: no cover
        pass
    return _collate(batch, collate_fn_map=fn_map)


def collate_detection(batch, *, channels_last: bool = True):
    """``(images, targets)`` for detection: targets stay a list of dicts (their box counts
    differ), as torchvision's detection references collate. Images of one size (a crop or
    letterbox decoder) become one uint8 batch like ``collate_uint8``'s; images of different
    sizes stay a list. ``CUDAPrefetcher`` moves and normalizes either form.

    In a worker, the targets (and a list of images) cross to the main process as one
    shared-memory block each (``SharedBatch``), not one per tensor: per-tensor hand-over
    was the main process's bottleneck with many workers."""
    images = [b[0] for b in batch]
    share = SharedBatch if get_worker_info() is not None else list
    targets = share(b[1] for b in batch)
    first = images[0]
    if isinstance(first, torch.Tensor) and first.dim() == 3 and all(
            isinstance(t, torch.Tensor) and t.shape == first.shape for t in images):
        if first.dtype == torch.uint8 and not first.is_cuda:
            return _collate_images(images, channels_last=channels_last), targets
        return torch.stack(images), targets
    return share(images), targets


def _collate_images(batch, *, channels_last: bool, collate_fn_map=None):
    elem = batch[0]
    if elem.dtype != torch.uint8 or elem.dim() != 3 or elem.is_cuda:
        return _collate_tensor(batch, collate_fn_map=collate_fn_map)
    shape = elem.shape
    for t in batch:
        if t.shape != shape or t.dtype != torch.uint8:
            raise ValueError(f"cannot batch images of different sizes/dtypes ({tuple(shape)} "
                             f"uint8 and {tuple(t.shape)} {t.dtype}): decode to a fixed size, "
                             f"e.g. PackedDataset(root, decode=DecodeRandomResizedCrop(224))")
    c, h, w = shape
    n = len(batch)
    size = (n, h, w, c) if channels_last else (n, c, h, w)
    if get_worker_info() is not None:  # shared memory: the batch is passed, not copied, to the parent
        out = shared_empty(size)
    else:
        out = torch.empty(size, dtype=torch.uint8)
    if channels_last:
        torch.stack([t.permute(1, 2, 0) for t in batch], out=out)
        return out.permute(0, 3, 1, 2)  # logical NCHW, channels_last strides
    torch.stack(batch, out=out)
    return out


def _refuse_pil(batch, *, collate_fn_map=None):
    raise TypeError("make_loader batches uint8 tensors, but the dataset returns PIL images: build "
                    "it with a tensor decoder, e.g. PackedDataset(root, decode=DecodeRandomResizedCrop"
                    "(224)) for training or decode=DecodeCenterCrop(224) for evaluation, or end its "
                    "transform with torchvision.transforms.PILToTensor() (uint8, not ToTensor)")


# -- the DataLoader --------------------------------------------------------------------------

def make_loader(dataset, batch_size: Optional[int], *, shuffle: Optional[bool] = None,
                sampler=None, num_workers: Optional[int] = None, drop_last: bool = False,
                channels_last: bool = True, pin_memory: Optional[bool] = None,
                prefetch_factor: Optional[int] = None, persistent_workers: bool = True,
                multiprocessing_context=None, collate_fn: Optional[Callable] = None,
                stateful: bool = False, across_epochs: bool = True, **kwargs):
    """A ``DataLoader`` set up for throughput; every choice can be overridden.

    Args:
        dataset: any map-style or iterable dataset whose images are uint8 ``(C, H, W)``
            tensors, e.g. ``PackedDataset(root, decode=DecodeRandomResizedCrop(224))``.
        batch_size: samples per batch (``None`` with ``batch_sampler=`` in kwargs).
        shuffle: default True, or False when a ``sampler`` is given (they are exclusive).
        sampler: e.g. ``DistributedSampler``; call ``set_epoch`` on it (or on a
            ``CUDAPrefetcher``) each epoch.
        num_workers: default ``default_num_workers()``: the usable cores of this process,
            divided among the ranks on this host. Decoding is the bottleneck; the main
            process mostly waits on the GPU.
        channels_last: collate images into channels_last memory (convolution's fast layout;
            a free copy from HWC decoders).
        pin_memory: default True when CUDA is available: page-locked batches copy to the GPU
            asynchronously (``non_blocking=True``) and at full PCIe speed.
        prefetch_factor: batches each worker keeps ready. Default: enough for about
            ``TOTAL_PREFETCH`` (8) batches in flight overall, at least 2 per worker, to
            absorb jitter in decode and step times without holding many batches of shared
            memory (each is ``batch_size * 3 * H * W`` bytes).
        persistent_workers: keep workers (and their open shards, warm page cache and
            imported modules) across epochs instead of re-forking each epoch. Workers hold a
            copy of the dataset, so changes to it after the first epoch do not reach them.
        multiprocessing_context: None (the platform default: fork on Linux, cheap and safe
            since shards open lazily per process; forkserver instead in a Linux process whose
            default is spawn, see ``default_context``), or "spawn"/"forkserver" if the main
            process has threads or CUDA state that must not be forked.
        collate_fn: default ``collate_uint8`` with ``channels_last`` (``collate_detection``
            for a detection ``PackedDataset``).
        across_epochs: with a ``PackedSampler`` and workers, the workers run on into the
            next epoch instead of idling at every epoch's end (``packer.loading.epochs``): the
            result is an ``EpochLoader`` (one epoch per ``iter()``, ``len``, ``sampler``,
            ``set_epoch`` as on a DataLoader). ``False`` gives the plain DataLoader.
        stateful: return torchdata's ``StatefulDataLoader`` (same arguments): its
            ``state_dict()`` / ``load_state_dict()`` resume mid-epoch at the next unseen batch;
            wrap it in ``CUDAPrefetcher`` / ``GPUDecoder`` and checkpoint *their* state, which
            counts only the batches the training loop received (docs/loading.md).
        **kwargs: passed to ``DataLoader`` (``worker_init_fn``, ``generator``, ``timeout``,
            ``batch_sampler``, ...).
    """
    if kwargs.get("batch_sampler") is not None:
        if batch_size is not None or sampler is not None or shuffle or drop_last:
            raise ValueError("batch_sampler= decides batches itself: pass batch_size=None and no "
                             "shuffle, sampler or drop_last")
        batch_size, shuffle = 1, False  # DataLoader's defaults, required with batch_sampler
    elif not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if shuffle is None:
        shuffle = sampler is None and kwargs.get("batch_sampler") is None and not iterable
    elif shuffle and sampler is not None:
        raise ValueError("shuffle=True and sampler= are exclusive: the sampler decides the order "
                         "(DistributedSampler shuffles by itself; call its set_epoch each epoch)")
    _check_decoded(dataset)
    num_workers = _workers(num_workers, prefetch_factor, multiprocessing_context, kwargs)
    persistent_workers = persistent_workers and num_workers > 0
    pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
    if collate_fn is None:
        collate_fn = default_collate_for(dataset, channels_last)
    if (across_epochs and isinstance(sampler, PackedSampler) and num_workers and not stateful
            and not iterable):  # an IterableDataset takes no sampler: DataLoader says so
        batches = EpochBatches(sampler, batch_size, drop_last)
        loader = EpochLoader(DataLoader(
            StampedDataset(dataset), batch_sampler=batches, num_workers=num_workers,
            collate_fn=StampedCollate(collate_fn), pin_memory=pin_memory,
            persistent_workers=persistent_workers, **{**unordered(), **kwargs}), batches)
    else:
        loader = _loader_class(stateful)(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
            drop_last=drop_last, persistent_workers=persistent_workers, **kwargs)
    if num_workers:
        watch_worker_starts(loader)
    return loader


def watch_worker_starts(loader) -> None:
    """Hook each start of ``loader``'s workers (its worker iterator): a fresh ``BatchPool``
    for a ``PooledCollate`` just before they fork, one per set of workers (a second
    iterator's workers, or another loader's sharing the collate, must not write into the
    first one's slots), held by that iterator (``packer_pool``) as long as it lives;
    and an exit hook that shuts them down when the interpreter exits, before
    multiprocessing's exit handler joins them one by one (pytorch#81794: with persistent
    workers and a pin-memory thread under CUDA, docs/loading.md's 8-worker example took 24 s
    to exit; 4 s when a hook registered after the loop shut them down). The exit hook is
    registered when the iterator starts, so it runs before the exit hooks of whatever was set
    up before it. Holds only weak references: a reference from the loader to itself through
    the hook made ``del loader`` leave it, its persistent workers and their iterator to the
    garbage collector, which then could run in a later loader's forked worker ("can only
    test a child process")."""
    inner = loader.loader if isinstance(loader, EpochLoader) else loader
    start = type(inner)._get_iterator  # torch's: makes the worker iterator (also StatefulDataLoader)
    owner = weakref.ref(inner)

    def get_iterator():
        loader = owner()
        pool = renew_pool(loader)
        it = start(loader)
        it.packer_pool = pool  # the pool lives as long as the workers that write into it
        atexit.register(_stop_iterator, weakref.ref(it))
        return it
    inner._get_iterator = get_iterator


def renew_pool(loader) -> Optional[BatchPool]:
    """A new ``BatchPool`` for the workers ``loader`` is about to fork, given to its
    ``PooledCollate`` (None where they will not be forked: a spawned worker gets no pool)."""
    collate = getattr(loader.collate_fn, "collate", loader.collate_fn)  # inside a StampedCollate
    if not isinstance(collate, PooledCollate) or loader.num_workers == 0:
        return None
    ctx = loader.multiprocessing_context or mp.get_context()
    forked = ctx.get_start_method() == "fork"
    collate.pool = BatchPool.create(loader.num_workers, loader.prefetch_factor + 2) \
        if forked else None
    return collate.pool


def _stop_iterator(ref) -> None:
    stop = getattr(ref(), "_shutdown_workers", None)  # torch's iterator's own
    if stop is not None:
        stop()


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
    kwargs["multiprocessing_context"] = context if context is not None else default_context()
    return num_workers


def default_context() -> Optional[str]:
    """The workers' start method when the caller names none: the platform's (None), except in
    a Linux process whose own default is spawn (one started by ``torch.multiprocessing.spawn``,
    say), where it is forkserver. Both need a picklable dataset, but a spawned worker finalizes
    the interpreter when it exits, which aborted workers stopped while their result queue's
    thread was still handing a batch over ("terminate called without an active exception";
    an ``EpochLoader``'s workers, running on into the next epoch, always are); a forkserver
    worker exits at once. Measured in docs/benchmarks.md (issue 16, second session)."""
    if sys.platform.startswith("linux") and mp.get_start_method(allow_none=True) == "spawn":
        return "forkserver"
    return None


def default_collate_for(dataset, channels_last: bool = True) -> Callable:
    """``collate_detection`` for a detection ``PackedDataset``, else ``collate_uint8``."""
    detection = getattr(dataset, "task", None) == "detection" and getattr(
        getattr(dataset, "make_target", None), "detection", False)
    return PooledCollate(collate_detection if detection else collate_uint8,
                         channels_last=channels_last)


class PooledCollate(functools.partial):
    """``make_loader``'s collate: ``func(batch, **keywords)``, which a forked worker writes
    into its slots of the ``BatchPool`` made for the current workers (``renew_pool``), so a
    batch reuses shared memory instead of faulting in fresh pages and passing a file
    descriptor per tensor (docs/benchmarks.md, issue 16). A plain call anywhere else."""
    pool: Optional[BatchPool] = None

    def __call__(self, batch):
        pool = self.pool
        return super().__call__(batch) if pool is None else pool.collate(super().__call__, batch)

    def __reduce__(self):  # the pool stays home: a spawned worker collates the plain way
        return type(self), (self.func,), (self.func, self.args, self.keywords, None)


def _loader_class(stateful: bool):
    if not stateful:
        return DataLoader
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise ImportError("make_loader(stateful=True) needs torchdata's StatefulDataLoader: "
                          "pip install torchdata") from None
    return StatefulDataLoader


def _check_decoded(dataset) -> None:
    """Fail now, not in a worker, for a PackedDataset that would hand out PIL images."""
    from ..reading.dataset import PackedDataset
    if (isinstance(dataset, PackedDataset) and dataset.decode is None and dataset.transform is None
            and dataset.transforms is None):
        raise ValueError("this PackedDataset returns PIL images; make_loader needs uint8 tensors: "
                         "pass decode=DecodeRandomResizedCrop(224) (training) or "
                         "decode=DecodeCenterCrop(224) (evaluation) to PackedDataset, or a "
                         "transform ending in torchvision.transforms.PILToTensor() (detection: "
                         "decode=DecodeLetterbox(640), or transforms= ending in v2.ToImage())")
