"""``GPUOptions`` (how ``GPUDecoder`` runs) and ``DecodeStats`` (what it did)."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["DecodeStats", "GPUOptions"]


@dataclass(frozen=True)
class GPUOptions:
    """What ``GPUDecoder`` does beyond its common arguments: the augmentation's finer
    settings, then how it runs (threads, queues, decoder). The defaults suit training on one
    GPU (docs/gpu_decode.md says why each was chosen); most users never pass this.

    Augmentation:
    scale, ratio: RandomResizedCrop's area fraction and aspect-ratio ranges (training).
    flip: a random horizontal flip per image (training).
    crop_fraction: evaluation resizes the shorter side to ``size / crop_fraction``, then
        center-crops ``size``, as ``DecodeCenterCrop``.
    min_visible: detection: an object with less than this fraction of its box left in
        the crop is dropped.
    channels_last: the output batch's memory format (else contiguous NCHW).

    Running:
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
    backend: "nvjpeg" calls libnvjpeg directly (``packer.gpu.nvjpeg.NvjpegDecoder``: one
        buffer per batch that the fused kernel reads in place); "torchvision" uses
        ``torchvision.io.decode_jpeg``; "auto" the first of the two that loads.
    decoder: replaces both backends: ``(list of 1-D uint8 CPU tensors, device) -> list of
        (3, h, w) uint8 tensors``; with it ``device`` may be the CPU (tests, dry runs).
    """
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
        scale, ratio = self.scale, self.ratio
        if not (len(scale) == 2 and len(ratio) == 2 and 0 < scale[0] <= scale[1] <= 1
                and 0 < ratio[0] <= ratio[1]):
            raise ValueError(f"scale must be within (0, 1] and ratio positive, got {scale}, {ratio}")
        if not 0 < self.crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], got {self.crop_fraction}")
        if not 0 <= self.min_visible <= 1:
            raise ValueError(f"min_visible must be in [0, 1], got {self.min_visible}")
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


@dataclass
class DecodeStats:
    """Where images were decoded, and where the time went.

    ``cpu``: decoded in workers (not JPEG, or a JPEG nvJPEG does not take well);
    ``retried``: nvJPEG refused a batch and the image was decoded alone (PIL if nvJPEG
    refused it again). ``seconds``: wall time per stage, host side, summed over a stage's
    threads: ``loader`` (decode threads waiting for the DataLoader), ``decode``,
    ``augment`` (``decode+augment`` with ``overlap`` 1 or 2, where each thread does both;
    GPU work is asynchronous, so this is launch time), ``<stage> blocked`` (waiting for room
    in the queue), ``consumer`` (the training loop waiting for a
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
