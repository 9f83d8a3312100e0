"""The CPU side of GPU decoding, in DataLoader workers: JPEG header parsing, the ``decode=``
hook (:class:`EncodedImage`) and the collate into one flat buffer (:class:`EncodedBatch`)."""
from __future__ import annotations

import collections
import ctypes
import itertools
import os
import queue
import threading
from typing import Any, List, NamedTuple, Optional

import torch
from torch.utils.data import default_collate, get_worker_info

from ..errors import FormatError
from ..loading.torchapi import shared_empty
from ..transforms.decode import stored_image
from ..format.images import DEFAULT_MAX_PIXELS
from .detection import DetectionTargets, is_detection_batch, pack_targets
from .ring import BatchRing, arrived, locate

__all__ = ["EncodedBatch", "EncodedCollate", "EncodedImage", "EncodedSample", "JpegInfo",
           "collate_encoded", "gpu_decodable", "jpeg_info"]


# SOFn marker -> (process, arithmetic coding). 0xC4 (DHT), 0xC8 (JPG), 0xCC (DAC) are not SOFs.
_SOF = {0xC0: ("baseline", False), 0xC1: ("extended", False), 0xC2: ("progressive", False),
        0xC3: ("lossless", False), 0xC5: ("hierarchical", False), 0xC6: ("hierarchical", False),
        0xC7: ("hierarchical", False), 0xC9: ("extended", True), 0xCA: ("progressive", True),
        0xCB: ("lossless", True), 0xCD: ("hierarchical", True), 0xCE: ("hierarchical", True),
        0xCF: ("hierarchical", True)}
_CHROMA = {(1, 1): "4:4:4", (2, 1): "4:2:2", (2, 2): "4:2:0", (1, 2): "4:4:0", (4, 1): "4:1:1",
           (4, 2): "4:1:0"}


class JpegInfo(NamedTuple):
    """What the frame header (SOFn) says; enough to choose the GPU or the CPU decoder."""
    width: int
    height: int
    components: int            # 1 grey, 3 YCbCr (or RGB), 4 CMYK/YCCK
    precision: int             # bits per sample (8, or 12 in extended/lossless files)
    process: str               # baseline | extended | progressive | lossless | hierarchical
    arithmetic: bool           # arithmetic instead of Huffman entropy coding
    subsampling: str           # 4:4:4, 4:2:2, 4:2:0, 4:4:0, 4:1:1, 4:1:0, gray or other
    adobe_transform: Optional[int]  # APP14 "Adobe" colour transform (0: no YCbCr), or None


def jpeg_info(data) -> Optional[JpegInfo]:
    """Parse the markers up to the frame header; None for anything that is not a well-formed
    JPEG up to its SOF (then PIL decides what the bytes are)."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i, adobe = 2, None
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        m = data[i + 1]
        if m == 0xFF:  # fill byte
            i += 1
            continue
        if m == 0x01 or 0xD0 <= m <= 0xD7:  # standalone markers
            i += 2
            continue
        if m in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or scan data before any frame header
            return None
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2 or i + 2 + length > n:
            return None
        seg = data[i + 4:i + 2 + length]
        if m == 0xEE and len(seg) >= 12 and bytes(seg[:5]) == b"Adobe":
            adobe = seg[11]
        elif m in _SOF:
            if len(seg) < 6 or len(seg) < 6 + 3 * seg[5]:
                return None
            nf = seg[5]
            factors = [(seg[7 + 3 * k] >> 4, seg[7 + 3 * k] & 15) for k in range(nf)]
            process, arithmetic = _SOF[m]
            return JpegInfo((seg[3] << 8) | seg[4], (seg[1] << 8) | seg[2], nf, seg[0],
                            process, arithmetic, _subsampling(factors), adobe)
        i += 2 + length
    return None


def _subsampling(factors) -> str:
    if len(factors) == 1:
        return "gray"
    if len(factors) == 3 and factors[1] == factors[2] == (1, 1):
        return _CHROMA.get(factors[0], "other")
    return "other"


def gpu_decodable(info: Optional[JpegInfo]) -> bool:
    """True for what nvJPEG's batched path takes well: 8-bit baseline Huffman JPEGs, grey or
    YCbCr in a common subsampling. The rest (progressive: decoded one at a time; CMYK: PIL is
    the reference colour; 12-bit, lossless...) is decoded on the CPU, in workers."""
    return (info is not None and info.process == "baseline" and not info.arithmetic
            and info.precision == 8 and info.width > 0 and info.height > 0
            and (info.components == 1 or (info.components == 3 and info.adobe_transform != 0))
            and info.subsampling in ("4:4:4", "4:2:2", "4:2:0", "4:4:0", "gray"))


class EncodedSample(NamedTuple):
    """One image as it leaves a worker: JPEG bytes for the GPU, or, when ``decoded``, the
    RGB pixels (``height x width x 3`` uint8, row-major) that the CPU decoded instead."""
    data: bytes
    height: int
    width: int
    decoded: bool


class EncodedImage:
    """``PackedDataset(root, decode=EncodedImage())``: no decoding for JPEGs nvJPEG takes; the
    rest is decoded here as ImageFolder does and travels as pixels.

    ``max_pixels`` (the caller's, never the dataset's) bounds every image before its pixels
    exist on the GPU, from the JPEG header alone; beyond it is a ``FormatError``."""

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS):
        if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
            raise ValueError(f"max_pixels must be a positive int, got {max_pixels!r}")
        self.max_pixels = max_pixels

    def __call__(self, data: bytes) -> EncodedSample:
        info = jpeg_info(data)
        if info is not None:
            self._check(info.width, info.height, "its JPEG header claims")
        if gpu_decodable(info):
            return EncodedSample(bytes(data), info.height, info.width, False)
        im = stored_image(data)  # opened lazily: checked before its pixels exist
        self._check(im.width, im.height, "its header claims")
        im = im.convert("RGB")
        return EncodedSample(im.tobytes(), im.height, im.width, True)

    def _check(self, width: int, height: int, what: str) -> None:
        if width * height > self.max_pixels:
            raise FormatError(
                f"an image is too large for the GPU path: {what} {width} x {height} = "
                f"{width * height:,} pixels, over max_pixels={self.max_pixels:,}; a damaged or "
                f"crafted file, or raise the limit: make_gpu_loader(..., max_pixels=N) or "
                f"EncodedImage(max_pixels=N)")

    def __repr__(self) -> str:
        return f"EncodedImage(max_pixels={self.max_pixels})"


class EncodedBatch(NamedTuple):
    """A collated batch: every image's bytes back to back in ``data`` (one tensor, so one
    shared-memory block crosses from the worker instead of one per image)."""
    data: torch.Tensor     # uint8 (total,): JPEG bytes, or HWC RGB pixels where ``decoded``
    offsets: torch.Tensor  # int64 (B + 1,): image i is data[offsets[i]:offsets[i + 1]]
    sizes: torch.Tensor    # int64 (B, 2): (height, width)
    decoded: torch.Tensor  # bool (B,)
    labels: Any            # (B,) as default_collate makes them; detection: DetectionTargets

    def __reduce__(self):
        # Only ``data`` crosses as shared memory (or as its place in a ``BatchRing``); the small
        # fields travel in the message as bytes, not as a shared-memory file each (~30 calls).
        labels = self.labels
        if isinstance(labels, DetectionTargets):
            labels = ("boxes", _raw(labels.boxes), _raw(labels.counts),
                      {k: _raw(v) for k, v in labels.per_box.items()}, labels.per_image,
                      labels.keys)
        elif isinstance(labels, torch.Tensor):
            labels = ("tensor", _raw(labels))
        else:
            labels = ("other", labels)
        data = locate(self.data) or self.data  # only a worker's own slot is located
        return _rebuild, (data, *map(_raw, self[1:4]), labels)

    def images(self) -> List[torch.Tensor]:
        """Per-image views: 1-D JPEG bytes, or (H, W, 3) pixels where ``decoded``."""
        views = list(torch.split(self.data, torch.diff(self.offsets).tolist()))
        for i in self.decoded.nonzero().flatten().tolist():
            h, w = self.sizes[i].tolist()
            views[i] = views[i].view(h, w, 3)
        return views


def _raw(t: torch.Tensor) -> tuple:
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.nbytes), t.dtype, tuple(t.shape)


def _tensor(raw: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)


def _rebuild(data, offsets, sizes, decoded, labels) -> EncodedBatch:
    kind, *rest = labels
    if kind == "boxes":
        boxes, counts, per_box, per_image, keys = rest
        labels = DetectionTargets(_tensor(*boxes), _tensor(*counts),
                                  {k: _tensor(*r) for k, r in per_box.items()}, per_image, keys)
    elif kind == "tensor":
        labels = _tensor(*rest[0])
    else:
        labels = rest[0]
    in_slot = isinstance(data, tuple)
    data = arrived(data)
    if not in_slot and os.environ.get("PACKER_SHM_RELEASE", "1") != "0":
        _RELEASER.hold(data)
    return EncodedBatch(data, _tensor(*offsets), _tensor(*sizes), _tensor(*decoded), labels)


class _Releaser:
    """Frees the shared-memory blocks batches arrive in, in a thread of its own, ``HELD`` batches
    later: else the DataLoader's pin thread, which the whole pipeline waits on, pays ~5 ms per
    batch unmapping them. At most ``HELD`` blocks and ``HELD_BYTES`` are kept (shared memory is
    often small in containers). PACKER_SHM_RELEASE=0: off."""
    HELD, HELD_BYTES = 4, 128 << 20

    def __init__(self):
        self.pid, self.held = None, collections.deque()

    def hold(self, block: torch.Tensor) -> None:
        if self.pid != os.getpid():  # first use, or a forked child: state of this process
            self.pid, self.lock = os.getpid(), threading.Lock()
            self.held, self.out = collections.deque(), queue.SimpleQueue()
            threading.Thread(target=self._free, args=(self.out,), daemon=True,
                             name="packer-shm-release").start()
        with self.lock:
            self.held.append(block)
            while len(self.held) > self.HELD or sum(b.nbytes for b in self.held) > self.HELD_BYTES:
                self.out.put(self.held.popleft())

    @staticmethod
    def _free(out: queue.SimpleQueue) -> None:
        while True:
            out.get()  # dropped here: the unmapping happens in this thread


_RELEASER = _Releaser()


def collate_encoded(batch, ring: Optional[BatchRing] = None) -> EncodedBatch:
    """Collate ``(EncodedSample, label)`` pairs into an :class:`EncodedBatch` (in shared memory
    in a worker: a slot of ``ring`` where one is free and the batch fits)."""
    if not batch:
        raise ValueError("collate_encoded got an empty batch")
    samples, targets = zip(*batch)
    if not isinstance(samples[0], EncodedSample):
        raise TypeError(f"collate_encoded needs samples from PackedDataset(root, decode="
                        f"EncodedImage()) (use make_gpu_loader), got {type(samples[0]).__name__}")
    offsets = [0, *itertools.accumulate(len(s.data) for s in samples)]
    # Everything that can fail comes before a ring slot is claimed: a failed batch's slot
    # would stay its worker's for the worker's life.
    labels = pack_targets(targets) if is_detection_batch(targets) else default_collate(list(targets))
    sizes = torch.tensor([(s.height, s.width) for s in samples], dtype=torch.int64)
    data = _empty_u8(offsets[-1], ring)
    base = data.data_ptr()
    for s, o in zip(samples, offsets):
        ctypes.memmove(base + o, s.data, len(s.data))
    return EncodedBatch(data, torch.tensor(offsets, dtype=torch.int64), sizes,
                        torch.tensor([s.decoded for s in samples], dtype=torch.bool), labels)


class EncodedCollate:
    """``collate_encoded`` into ``ring`` (``make_gpu_loader`` sets it before workers start)."""

    def __init__(self, ring: Optional[BatchRing] = None):
        self.ring = ring

    def __call__(self, batch) -> EncodedBatch:
        return collate_encoded(batch, self.ring)


def _empty_u8(n: int, ring: Optional[BatchRing]) -> torch.Tensor:
    if get_worker_info() is None or n == 0:
        return torch.empty(n, dtype=torch.uint8)
    slot = ring.claim(n) if ring is not None else None
    return shared_empty((n,)) if slot is None else slot

