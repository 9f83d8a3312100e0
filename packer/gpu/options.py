"""``GPUOptions`` (how ``GPUDecoder`` runs) and ``DecodeStats`` (what it did)."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

import torch

__all__ = ["DecodeStats", "GPUOptions"]


@dataclass(frozen=True)
class GPUOptions:
    """How ``GPUDecoder`` runs: threads, queues, backends. The defaults are the measured best
    on an H100/H200 (docs/gpu_decode.md); most users never pass this.

    overlap: 2 works in background threads, each on its own CUDA stream, so the next
        batches decode (and augment) while the current one trains; 1 does it all in one
        thread; 0 works inline on the current stream (debugging, measurements).
    decode_threads: decode threads with ``overlap=2``, each with its own stream and nvJPEG
        handle, so one batch's host work overlaps another's decoding; batches still come
        out in the loader's order. None: 2 for nvJPEG called directly, 1 otherwise
        (torchvision decodes behind one global lock).
    queue_depth: decoded batches waiting between stages (bounds GPU memory).
    max_ahead: training steps the consumer may queue on the GPU beyond the last one
        finished (None: no limit; see ``GPUDecoder.throttle``).
    backend: "nvjpeg" calls libnvjpeg directly (:class:`NvjpegDecoder`: one buffer per
        batch that the fused resize reads in place; no torchvision needed); "torchvision"
        uses ``torchvision.io.decode_jpeg``; "auto" the first of the two that loads.
    resample: "triton" crops, resizes, flips and normalizes a batch in one fused kernel
        (``packer.gpu.resample``); "matmul" pads images into groups and runs batched
        matmuls (no Triton needed; 10x the GPU time); "auto": "triton" wherever it imports.
    augment_thread: with ``overlap=2``, augment in a thread of its own rather than in the
        decode threads; None: only for ``resample="matmul"``, whose ~10 ms of host work per
        batch would slow decoding (the fused kernel takes under 1 ms).
    decoder: replaces both backends: ``(list of 1-D uint8 CPU tensors, device) -> list of
        (3, h, w) uint8 tensors``.
    """
    overlap: int = 2
    decode_threads: Optional[int] = None
    queue_depth: int = 2
    max_ahead: Optional[int] = 3
    backend: str = "auto"
    resample: str = "auto"
    augment_thread: Optional[bool] = None
    decoder: Optional[Callable[[List[torch.Tensor], torch.device], List[torch.Tensor]]] = None

    def __post_init__(self):
        if self.overlap not in (0, 1, 2):
            raise ValueError(f"overlap must be 0, 1 or 2, got {self.overlap!r}")
        if not isinstance(self.queue_depth, int) or self.queue_depth < 1:
            raise ValueError(f"queue_depth must be an int >= 1, got {self.queue_depth!r}")
        if self.max_ahead is not None and (not isinstance(self.max_ahead, int) or self.max_ahead < 1):
            raise ValueError(f"max_ahead must be None or an int >= 1, got {self.max_ahead!r}")
        threads = self.decode_threads
        if threads is not None and (not isinstance(threads, int) or threads < 1
                                    or (threads > 1 and self.overlap != 2)):
            raise ValueError(f"decode_threads must be None or an int >= 1, and 1 unless overlap=2, "
                             f"got {threads!r}")
        if self.backend not in ("auto", "nvjpeg", "torchvision"):
            raise ValueError(f"backend must be 'auto', 'nvjpeg' or 'torchvision', got {self.backend!r}")
        if self.resample not in ("auto", "triton", "matmul"):
            raise ValueError(f"resample must be 'auto', 'triton' or 'matmul', got {self.resample!r}")


@dataclass
class DecodeStats:
    """Where images were decoded, and where the time went.

    ``cpu``: decoded in workers (not JPEG, or a JPEG nvJPEG does not take well);
    ``retried``: nvJPEG refused a batch and the image was decoded alone (PIL if nvJPEG
    refused it again). ``seconds``: wall time per stage, host side, summed over a stage's
    threads: ``loader`` (decode threads waiting for the DataLoader), ``decode``,
    ``augment`` (or ``decode+augment`` with ``overlap=1``; GPU work is asynchronous, so
    this is launch time), ``augment waits`` (for decoded batches), ``<stage> blocked``
    (waiting for room in the next queue), ``consumer`` (the training loop waiting for a
    batch: near zero when decoding keeps up) and ``throttle`` (the training loop waiting for
    its own GPU work, ``max_ahead``: large when the model is the limit).
    """
    gpu: int = 0
    cpu: int = 0
    retried: int = 0
    batches: int = 0
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
