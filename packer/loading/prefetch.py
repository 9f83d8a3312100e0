"""``CUDAPrefetcher``: the next batch crosses PCIe as uint8 on a side stream and is normalized
there while this step runs; without CUDA the same conversion runs on the CPU."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from .._util.threads import END, Raised
from .torchapi import plain_tensors, storage_key

__all__ = ["CUDAPrefetcher", "IMAGENET_MEAN", "IMAGENET_STD", "LoaderView", "normalize_affine",
           "normalize_uint8"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class LoaderView:
    """What a wrapper around a loader passes through, so it stands in for the loader:
    ``len()``, ``.dataset``, ``.sampler``, ``.batch_sampler`` and ``set_epoch``."""

    loader: Iterable

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    def set_epoch(self, epoch: int) -> None:
        """Call ``set_epoch(epoch)`` on the loader, its sampler(s) and its dataset, where they
        have one (DistributedSampler needs it to reshuffle each epoch)."""
        seen = {id(self)}
        inner = [getattr(self.loader, n, None) for n in ("sampler", "batch_sampler", "dataset")]
        for obj in [self.loader, *inner, getattr(inner[1], "sampler", None)]:
            fn = getattr(obj, "set_epoch", None)
            if callable(fn) and id(obj) not in seen:
                seen.add(id(obj))
                fn(epoch)


class CUDAPrefetcher(LoaderView):
    """Iterate ``loader`` (re-iterable, a ``LoaderView``) with each batch already on ``device``:
    uint8 ``(N, C, H, W)`` images (or detection's lists of ``(C, H, W)``) become ``dtype``,
    ``(x / 255 - mean) / std`` (``None``: ``x / 255``), channels_last if asked; other tensors
    just move; non-tensors pass unchanged.

    Each batch is made on the side stream ``self.stream``; at hand-out the consumer's stream
    waits on it and every tensor is ``record_stream``-ed there (docs/loading.md). Batches
    should come pinned: a warning says so once per pass."""

    def __init__(self, loader: Iterable, mean: Optional[Sequence[float]] = IMAGENET_MEAN,
                 std: Optional[Sequence[float]] = IMAGENET_STD, *,
                 device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32,
                 channels_last: bool = True):
        if dtype not in _FLOATS:
            raise ValueError(f"dtype must be one of torch.float32, bfloat16, float16 or float64 "
                             f"(what the model consumes), got {dtype}")
        self.loader, self.dtype, self.channels_last = loader, dtype, bool(channels_last)
        self.device = _resolve_device(device)
        self._scale, self._shift = (t.to(self.device) for t in normalize_affine(mean, std))
        self.mean, self.std = (None, None) if mean is None else (tuple(mean), tuple(std))
        self.stream: Optional[torch.cuda.Stream] = None
        self._warned = False
        self._state = None  # the loader's state after the last batch handed out
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            # The constants were written on the current stream; the side stream reads them.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def __iter__(self) -> "PrefetchPass":
        return PrefetchPass(self, iter(self.loader))

    def _loader_state(self):
        return self.loader.state_dict() if hasattr(self.loader, "state_dict") else None

    def state_dict(self) -> dict:
        """The loader's state as of the last batch handed out (the loader is a batch ahead); needs
        a loader with ``state_dict``."""
        if not hasattr(self.loader, "state_dict"):
            raise TypeError("CUDAPrefetcher.state_dict needs a loader with state_dict(): "
                            "make_loader's over a PackedSampler (its default when given no "
                            "sampler), or make_loader(..., stateful=True)")
        return {"loader": self._state if self._state is not None else self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``iter()`` starts at the first batch not handed out before."""
        self.loader.load_state_dict(state["loader"])
        self._state = state["loader"]

    def _preload(self, it):
        """Start copying and normalizing the next batch on the side stream (returns at once);
        the loader's error for this batch as a value (raised in its turn)."""
        try:
            batch = next(it)
        except StopIteration:
            return END
        except Exception as e:  # noqa: B902 - a batch that raised: its turn comes
            return Raised(e)
        if not self._warned:
            self._warned = True
            t = next(iter_tensors(batch), None)
            if t is not None and t.device.type == "cpu" and not t.is_pinned():
                warnings.warn("CUDAPrefetcher got a batch in pageable memory: each copy blocks "
                              "the CPU; use make_loader (or DataLoader(pin_memory=True))",
                              stacklevel=4)
        if record_uses(batch, self.stream):  # made on the consumer's stream (GPU decoding,
            # say): held for this stream, which waits for it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            return self._convert(batch)

    def _handoff(self, batch, stream: torch.cuda.Stream) -> None:
        """Make ``batch`` safe to use on ``stream``: see the class docstring."""
        stream.wait_stream(self.stream)
        record_uses(batch, stream)

    def _convert(self, batch):
        if is_image_list_batch(batch):  # detection: (list of (C, H, W) images, targets)
            images = [self._tensor(im[None])[0] for im in batch[0]]
            return type(batch)([images, *(map_tensors(x, self._tensor) for x in batch[1:])])
        return map_tensors(batch, self._tensor)

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device, non_blocking=True)
        if t.dtype == torch.uint8 and t.dim() == 4:
            return normalize_uint8(t, self._scale, self._shift, dtype=self.dtype,
                                   channels_last=self.channels_last)
        return t

    def __repr__(self) -> str:
        return (f"CUDAPrefetcher({self.loader!r}, mean={self.mean}, std={self.std}, "
                f"device={self.device}, dtype={self.dtype}, channels_last={self.channels_last})")


class PrefetchPass:
    """One pass of a ``CUDAPrefetcher``: its loader's batches in order, each converted (on the
    side stream, one batch ahead). A batch whose loader raised raises in its turn, after the
    batches before it, and ``next()`` goes on, as the loader's own iterator does."""

    def __init__(self, pf: CUDAPrefetcher, it):
        self.pf, self.it = pf, it
        pf._state = pf._loader_state()
        self.ahead = None  # (the next batch converted, END or Raised; the loader's state)

    def __iter__(self) -> "PrefetchPass":
        return self

    def close(self) -> None:
        """End the pass early, as a generator's ``close``: the batch loaded ahead is dropped
        and the loader's iterator closed where it can be."""
        self.ahead = (END, self.pf._state)
        close = getattr(self.it, "close", None)
        if close is not None:
            close()

    def __next__(self):
        pf = self.pf
        if pf.stream is None:  # on the CPU: convert when asked
            if self.ahead is not None:  # closed
                raise StopIteration
            try:
                batch = next(self.it)
            except Exception:  # noqa: B902 - a pass that ended (the next one's start), or a
                pf._state = pf._loader_state()  # batch that raised: counted, as the loader
                raise  # and the GPU path count it
            state = pf._loader_state()
            out = pf._convert(batch)
            pf._state = state
            return out
        cur = self.ahead if self.ahead is not None else (pf._preload(self.it), pf._loader_state())
        self.ahead = cur if cur[0] is END else None
        pf._state = cur[1]  # what the consumer has now received, not what was fetched
        if cur[0] is END:
            raise StopIteration
        if isinstance(cur[0], Raised):
            raised, cur = cur[0], None
            raised.reraise()
        pf._handoff(cur[0], torch.cuda.current_stream(pf.device))  # before the next is queued
        try:  # the next, while this one is used
            self.ahead = pf._preload(self.it), pf._loader_state()
        except Exception as e:  # noqa: B902 - converting it failed (out of memory): its turn
            self.ahead = Raised(e), pf._loader_state()
        return cur[0]


def normalize_uint8(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, *,
                    dtype: torch.dtype = torch.float32, channels_last: bool = True) -> torch.Tensor:
    """``x * scale + shift`` for a uint8 (N, C, H, W) batch, in one kernel: read as uint8,
    computed in float32, written as ``dtype`` in the requested memory format."""
    c = x.shape[1]
    if scale.numel() not in (1, c):
        raise ValueError(f"images have {c} channels but mean/std have {scale.numel()} values")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty(x.shape, dtype=dtype, device=x.device, memory_format=fmt)
    return torch.addcmul(shift, x, scale, out=out)


def normalize_affine(mean, std):
    """(scale, shift) of shape (1, C, 1, 1) with x * scale + shift == (x / 255 - mean) / std."""
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std (0..1 scale, e.g. IMAGENET_MEAN/IMAGENET_STD), "
                         "or neither for x / 255")
    if mean is None:
        mean, std = (0.0,), (1.0,)
    mean, std = (torch.as_tensor(v, dtype=torch.float64).flatten() for v in (mean, std))
    if mean.numel() != std.numel() or mean.numel() == 0:
        raise ValueError(f"mean and std need one value per channel, got {mean.numel()} and "
                         f"{std.numel()}")
    if not bool((std > 0).all()):
        raise ValueError(f"std must be positive, got {std.tolist()}")
    if bool((mean.abs() > 1).any()) or bool((std > 1).any()):
        raise ValueError(f"mean/std are on the 0..1 scale (torchvision's convention; the x255 is "
                         f"done here), got mean={mean.tolist()}, std={std.tolist()}")
    scale = (1.0 / (255.0 * std)).float().view(1, -1, 1, 1)
    shift = (-mean / std).float().view(1, -1, 1, 1)
    return scale, shift


def _resolve_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device} but CUDA is not available; leave device=None to "
                             f"use the GPU when there is one and the CPU otherwise")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device must be a CUDA device or the CPU, got {device}")
    return device


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` on every tensor in nested tuples/lists/dicts, keeping the containers' types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def is_image_list_batch(batch: Any) -> bool:
    """A ``(images, targets)`` batch whose images are a list of uint8 (C, H, W) tensors."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2 or not isinstance(batch[0], list):
        return False
    return bool(batch[0]) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                  and t.dim() == 3 for t in batch[0])


def record_uses(batch, stream: torch.cuda.Stream) -> int:
    """``record_stream`` every CUDA tensor of ``batch`` on ``stream``: the caching allocator
    keeps their memory until the work queued there is done. Once per storage (a detection
    batch's per-image targets are views of a few), and without tv_tensors' dispatch. Returns
    how many storages it recorded."""
    seen = set()
    with plain_tensors():
        for t in iter_tensors(batch):
            if t.device.type == "cuda" and storage_key(t) not in seen:
                seen.add(storage_key(t))
                t.record_stream(stream)
    return len(seen)


def iter_tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (Mapping, list, tuple)):
        for v in obj.values() if isinstance(obj, Mapping) else obj:
            yield from iter_tensors(v)
