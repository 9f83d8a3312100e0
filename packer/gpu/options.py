"""``GPUOptions`` (how ``GPUDecoder`` runs) and ``DecodeStats`` (what it did)."""
from __future__ import annotations

import math
import numbers
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["DecodeStats", "GPUOptions"]


@dataclass(frozen=True)
class GPUOptions:
    """What ``GPUDecoder`` does beyond its common arguments; the defaults suit training on one
    GPU (docs/gpu_decode.md says why each was chosen).

    scale, ratio, flip: RandomResizedCrop's ranges and a random horizontal flip (training).
    crop_fraction: evaluation resizes the shorter side to ``size / crop_fraction``.
    min_visible: detection: an object with less of its box left in the crop is dropped.
    channels_last: the output batch's memory format.
    overlap: 2: background threads on their own streams; 1: one thread; 0: inline.
    decode_threads: with ``overlap=2``, the most that decode at once (None: 3 for nvJPEG, 1 for
    torchvision); those beyond the first work only while the consumer starves.
    queue_depth: decoded batches waiting between stages (bounds GPU memory).
    max_ahead: steps the consumer may queue beyond the last finished (``GPUDecoder.throttle``).
    backend: "nvjpeg", "torchvision" or "auto" (the first that loads).
    decoder: replaces both: ``(list of uint8 CPU tensors, device) -> list of (3, h, w)``."""
    scale: Tuple[float, float] = (0.08, 1.0)
    ratio: Tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    crop_fraction: float = 0.875
    min_visible: float = 0.25
    channels_last: bool = True
    overlap: int = 2
    decode_threads: Optional[int] = None
    queue_depth: int = 2
    max_ahead: Optional[int] = 3
    backend: str = "auto"
    decoder: Optional[Callable[[List[torch.Tensor], torch.device], List[torch.Tensor]]] = None

    def __post_init__(self):
        scale, ratio = _pair(self.scale), _pair(self.ratio)
        if not (scale and ratio and 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1]):
            raise ValueError(f"scale must be within (0, 1] and ratio positive, both (low, high) "
                             f"and finite, got {self.scale!r}, {self.ratio!r}")
        object.__setattr__(self, "scale", scale)  # plain floats, whatever held them
        object.__setattr__(self, "ratio", ratio)
        if not (_real(self.crop_fraction) and 0 < self.crop_fraction <= 1):
            raise ValueError(f"crop_fraction must be in (0, 1], got {self.crop_fraction!r}")
        if not (_real(self.min_visible) and 0 <= self.min_visible <= 1):
            raise ValueError(f"min_visible must be in [0, 1], got {self.min_visible!r}")
        for name in ("flip", "channels_last"):
            v = getattr(self, name)
            if isinstance(v, str) or v not in (True, False):  # numpy's bool and 0/1 too
                raise ValueError(f"{name} must be True or False, got {v!r}")
            object.__setattr__(self, name, bool(v))
        if not (_count(self.overlap) and self.overlap in (0, 1, 2)):
            raise ValueError(f"overlap must be 0, 1 or 2, got {self.overlap!r}")
        if not (_count(self.queue_depth) and self.queue_depth >= 1):
            raise ValueError(f"queue_depth must be an int >= 1, got {self.queue_depth!r}")
        if self.max_ahead is not None and not (_count(self.max_ahead) and self.max_ahead >= 1):
            raise ValueError(f"max_ahead must be None or an int >= 1, got {self.max_ahead!r}")
        threads = self.decode_threads
        if threads is not None and (not _count(threads) or threads < 1
                                    or (threads > 1 and self.overlap != 2)):
            raise ValueError(f"decode_threads must be None or an int >= 1, and 1 unless overlap=2, "
                             f"got {threads!r}")
        if self.backend not in ("auto", "nvjpeg", "torchvision"):
            raise ValueError(f"backend must be 'auto', 'nvjpeg' or 'torchvision', got {self.backend!r}")
        if self.decoder is not None and not callable(self.decoder):
            raise ValueError(f"decoder must be None or a function (images, device) -> images, "
                             f"got {self.decoder!r:.60}")


def _count(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _pair(v) -> Optional[Tuple[float, float]]:
    """``(low, high)`` as floats from any two finite numbers (tuple, list, array), or None."""
    v = v.tolist() if hasattr(v, "tolist") else v
    if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or len(v) != 2:
        return None
    return (float(v[0]), float(v[1])) if all(map(_real, v)) else None


@dataclass
class DecodeStats:
    """Where images were decoded (``cpu``, ``retried``), the decode threads at work as the
    last batch was handed out (``threads``: the pipeline paces them) and the host time per
    stage (``seconds``: ``loader``, ``decode``, ``augment``, ``<stage> blocked``,
    ``consumer``, ``throttle``; docs/gpu_decode.md)."""
    gpu: int = 0
    cpu: int = 0
    retried: int = 0
    batches: int = 0
    threads: int = 0
    seconds: dict = field(default_factory=dict)

    def __post_init__(self):
        self._lock = threading.Lock()  # several decode threads count at once

    def add_time(self, where: str, dt: float) -> None:
        with self._lock:
            self.seconds[where] = self.seconds.get(where, 0.0) + dt

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return asdict(self)
