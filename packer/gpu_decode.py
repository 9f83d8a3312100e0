"""GPU decoding: the loader ships stored JPEG bytes, the GPU decodes (nvJPEG) and augments.

Pillow on 16 cores decodes and resizes 4,600-8,000 ImageNet JPEGs/s; one H200 trains a
ResNet-18 on ~13,000/s. So here the DataLoader workers only read records and parse JPEG
headers (microseconds), and the GPU does the rest in whole batches:

    workers   EncodedImage: header parse; CPU decode only for what nvJPEG can't take
              collate_encoded: one flat byte buffer per batch (one shared-memory block)
    decode    2 threads, batches in turn: NvjpegDecoder (libnvjpeg via ctypes, hardware
              engine on A100/H100/H200) writes each batch into one buffer;
              torchvision.io.decode_jpeg is the fallback
    augment   in the same thread: crop boxes, then ONE Triton kernel crops, resizes
              (antialiased bilinear), flips, normalizes and writes bf16 channels_last,
              reading each image where it lies (packer.gpu_resample)
    consumer  ``for x, y in GPUDecoder(make_gpu_loader(root, 256)):``, batches in order

Each thread has its own CUDA stream; batches cross with events and ``record_stream``, as in
``CUDAPrefetcher``, so the training stream waits for a batch only until it is ready.
docs/gpu_decode.md has the measurements, the reasons for each choice, and the limits.
"""
from __future__ import annotations

import copy
import ctypes
import itertools
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

# The worker side, the augmentation maths and the nvJPEG bindings live in their own modules;
# their public names are re-exported here, where they were first importable.
from .encoded import (EncodedBatch, EncodedImage, EncodedSample, JpegInfo,  # noqa: F401
                      collate_encoded, gpu_decodable, jpeg_info)
from .errors import PackerError
from .gpu_augment import center_crop_boxes, random_resized_crop_boxes, resample_crops  # noqa: F401
from .gpu_pipeline import _END, _Pipeline
from .gpu_resample import ImageTable, triton_available
from .imaging import open_image
from .nvjpeg import NvjpegDecoder, _load_nvjpeg, _nvjpeg  # noqa: F401
from .prefetch import IMAGENET_MEAN, IMAGENET_STD, LoaderView, _affine

__all__ = ["ConnectionsWarning", "DecodeStats", "EncodedBatch", "EncodedImage", "EncodedSample", "GPUDecoder",
           "JpegInfo", "NvjpegDecoder", "center_crop_boxes", "collate_encoded", "gpu_decodable",
           "jpeg_info", "make_gpu_loader", "random_resized_crop_boxes", "resample_crops"]

# nvJPEG works image by image on the GPU (a bitstream copy, a colour-conversion kernel and
# an event wait per image). The GPU feeds its streams through CUDA_DEVICE_MAX_CONNECTIONS
# hardware queues, 8 by default; streams that share one queue are serialised, so each of
# those per-image steps waited behind a training kernel: decoding beside a ResNet-18 step
# fell from ~21,000 to 1,300-10,000 images/s. With 32 queues it stayed at 12,000-20,000
# (docs/gpu_decode.md). The variable is read when the CUDA context is created, so it is set
# here, on import, if the user has not set it and CUDA has not started yet.
CONNECTIONS = 32
if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and not torch.cuda.is_initialized():
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(CONNECTIONS)


class ConnectionsWarning(UserWarning):
    """GPU decoding will wait behind training kernels: too few CUDA hardware queues."""


def connections_advice() -> Optional[str]:
    """Why GPU decoding beside training may be slow in this process, or None."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    try:
        low = value is None or int(value) < 16
    except ValueError:
        low = True
    if not low:
        return None
    now = "unset (8)" if value is None else value
    return (f"CUDA_DEVICE_MAX_CONNECTIONS is {now}: GPU decoding shares the GPU's hardware "
            f"queues with training kernels and waits behind them (measured 2-6x slower beside a "
            f"ResNet-18 step). Set CUDA_DEVICE_MAX_CONNECTIONS={CONNECTIONS} before CUDA starts "
            f"(or import packer.gpu_decode before any CUDA work); see docs/gpu_decode.md")


def make_gpu_loader(dataset, batch_size: int = 256, **kwargs):
    """``make_loader`` for the GPU path: ``dataset`` (a path or a ``PackedDataset``) hands
    out :class:`EncodedSample` and batches are :class:`EncodedBatch`.

    ``pin_memory`` defaults to False here (make_loader's is True with CUDA): nvJPEG reads
    the bytes on the host, and measured on an H200 (docs/gpu_decode.md), a ResNet-18 step
    fed by GPUDecoder kept 93-97 % of its synthetic-data speed unpinned against 87-93 %
    pinned (DataLoader's pin thread and its copy compete with the training process), while
    the pipeline alone ran 20-26k images/s unpinned and 25-34k pinned. Pass
    ``pin_memory=True`` when decoding throughput matters more than the step beside it.
    Others go to ``make_loader`` (``shuffle``, ``sampler``, ``num_workers``, ``drop_last``...).
    A dataset with a ``decode``/``transform`` of its own is copied with ``decode=EncodedImage()``.
    """
    from .dataset import PackedDataset
    from .loader import make_loader
    if isinstance(dataset, (str, os.PathLike)):
        dataset = PackedDataset(dataset, decode=EncodedImage())
    elif isinstance(dataset, PackedDataset):
        if dataset.transform is not None:
            raise ValueError("the GPU path augments on the GPU (GPUDecoder(train=..., size=...)): "
                             "build the PackedDataset without transform=")
        if not isinstance(dataset.decode, EncodedImage):
            dataset = copy.copy(dataset)
            dataset.decode = EncodedImage()
    kwargs.setdefault("collate_fn", collate_encoded)
    kwargs.setdefault("pin_memory", False)
    return make_loader(dataset, batch_size, **kwargs)



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


class GPUDecoder(LoaderView):
    """Iterate a :func:`make_gpu_loader` loader as ``(images, labels)`` ready on the GPU.

    ``images``: ``(B, 3, *size)`` in ``dtype``, normalized as ``(x / 255 - mean) / std``
    (``mean``/``std`` on the 0..1 scale), channels_last if asked; ``dtype=torch.uint8``
    gives the rounded pixels instead, unnormalized. Training (``train=True``):
    RandomResizedCrop(``size``, ``scale``, ``ratio``) + horizontal flip; evaluation: resize
    the shorter side to ``size / crop_fraction`` and center-crop, as ``DecodeCenterCrop``.

    The iterator protocol is ``CUDAPrefetcher``'s: re-iterable, ``len()``, ``set_epoch``
    (sampler, and the crop generator when ``seed`` is given), ``.sampler``,
    ``.batch_sampler``, ``.dataset``. ``stats`` counts GPU- and CPU-decoded images.

    ``overlap``: 2 (default) works in background threads, each on its own stream, so the
    next batches decode (and augment) while the current one trains; 1 does it all in one
    thread; 0 works inline on the current stream (debugging, measurements).
    ``augment_thread`` (with ``overlap=2``): augment in a thread of its own rather than in
    the decode threads; None (default): only for ``resample="matmul"``, whose ~10 ms of
    host work per batch would slow decoding (the fused kernel takes under 1 ms).
    ``prefetch`` bounds the batches waiting between stages (GPU memory stays bounded).
    ``max_ahead``: training steps the consumer may queue on the GPU beyond the last one
    finished (None: no limit; see ``_throttle``).
    ``backend``: "nvjpeg" calls libnvjpeg directly (:class:`NvjpegDecoder`: it decodes each
    batch into one buffer that the fused resize reads in place, and needs no torchvision);
    "torchvision" uses ``torchvision.io.decode_jpeg``; "auto" (default) the first of the two
    that loads; ``self.backend`` says which runs. ``decoder``, if given, replaces both:
    ``(list of 1-D uint8 CPU tensors, device) -> list of (3, h, w) uint8 tensors``.
    ``decode_threads`` (with ``overlap=2``): decode threads, each with its own stream and
    nvJPEG handle, so one batch's host work (header parsing, setup, per-image waits)
    overlaps another's decoding; batches still come out in the loader's order. None
    (default): 2 for "nvjpeg", 1 otherwise (torchvision decodes behind one global lock).
    ``resample``: "triton" crops, resizes, flips and normalizes a batch in one fused kernel
    (:mod:`packer.gpu_resample`) reading each image where nvJPEG wrote it; "matmul" pads the
    images into groups and runs batched matmuls (no Triton needed; 10x the GPU time); "auto"
    (default) is "triton" wherever Triton imports. ``self.resample`` says which runs.
    docs/gpu_decode.md has the measurements behind every default.
    """

    def __init__(self, loader, *, size=224, train: bool = True,
                 mean: Optional[Sequence[float]] = IMAGENET_MEAN,
                 std: Optional[Sequence[float]] = IMAGENET_STD,
                 dtype: torch.dtype = torch.bfloat16, channels_last: bool = True, device=None,
                 scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: bool = True,
                 crop_fraction: float = 0.875, prefetch: int = 2, overlap: int = 2,
                 seed: Optional[int] = None, backend: str = "auto", max_ahead: Optional[int] = 3,
                 decode_threads: Optional[int] = None, resample: str = "auto",
                 augment_thread: Optional[bool] = None,
                 decoder: Optional[Callable[[List[torch.Tensor], torch.device], List[torch.Tensor]]] = None):
        self.size = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
        if len(self.size) != 2 or min(self.size) < 1:
            raise ValueError(f"size must be a positive int or (height, width), got {size!r}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8):
            raise ValueError(f"dtype must be a float dtype (normalized) or torch.uint8 (pixels), "
                             f"got {dtype}")
        if not (0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1]):
            raise ValueError(f"scale must be within (0, 1] and ratio positive, got {scale}, {ratio}")
        if not 0 < crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction}")
        if max_ahead is not None and (not isinstance(max_ahead, int) or max_ahead < 1):
            raise ValueError(f"max_ahead must be None or an int >= 1, got {max_ahead!r}")
        self.max_ahead = max_ahead
        if overlap not in (0, 1, 2) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"overlap must be 0, 1 or 2 and prefetch an int >= 1, got "
                             f"{overlap!r}, {prefetch!r}")
        if decode_threads is not None and (not isinstance(decode_threads, int) or decode_threads < 1
                                           or (decode_threads > 1 and overlap != 2)):
            raise ValueError(f"decode_threads must be None or an int >= 1, and 1 unless overlap=2, "
                             f"got {decode_threads!r}")
        if backend not in ("auto", "nvjpeg", "torchvision"):
            raise ValueError(f"backend must be 'auto', 'nvjpeg' or 'torchvision', got {backend!r}")
        if resample not in ("auto", "triton", "matmul"):
            raise ValueError(f"resample must be 'auto', 'triton' or 'matmul', got {resample!r}")
        self.device = _gpu_device(device, decoder is None, backend)
        if resample == "auto":
            resample = "triton" if self.device.type == "cuda" and triton_available() else "matmul"
        elif resample == "triton" and not triton_available():
            raise PackerError("resample='triton' needs Triton (it comes with PyTorch's CUDA "
                              "wheels on Linux: pip install triton); resample='matmul' needs none")
        elif (resample == "triton" and self.device.type != "cuda"
              and os.environ.get("TRITON_INTERPRET") != "1"):
            raise ValueError(f"resample='triton' runs on a CUDA device, got {self.device}; "
                             f"use resample='matmul' (or TRITON_INTERPRET=1 to debug the kernel)")
        self.resample = resample
        # The fused kernel takes under 1 ms per batch: the decode threads launch it
        # themselves. The matmul form takes ~10 ms of host time: it gets a thread of its own.
        self.augment_thread = resample != "triton" if augment_thread is None else bool(augment_thread)
        advice = connections_advice() if self.device.type == "cuda" else None
        if advice:
            warnings.warn(advice, ConnectionsWarning, stacklevel=2)
        self.backend = "custom" if decoder is not None else backend
        if decoder is None and backend in ("auto", "nvjpeg"):  # a handle per decode thread
            threads = decode_threads or (2 if overlap == 2 else 1)
            try:
                self.decoders = [NvjpegDecoder.shared(self.device, k) for k in range(threads)]
                self.backend = f"nvjpeg-{self.decoders[0].backend}"
            except (OSError, RuntimeError):
                if backend == "nvjpeg":
                    raise
        if self.backend in ("auto", "torchvision"):
            import torchvision.io  # noqa: F401  (_gpu_device checked that one of the two loads)
            decoder, self.backend = _nvjpeg, "torchvision"
        if decoder is not None:
            self.decoders = [decoder] * (decode_threads or 1)
        self.decode_threads = len(self.decoders)
        self.decoder = self.decoders[0]
        self.loader = loader
        self.train, self.flip, self.dtype = bool(train), bool(flip), dtype
        self.scale, self.ratio, self.crop_fraction = tuple(scale), tuple(ratio), crop_fraction
        self.channels_last, self.prefetch, self.overlap = bool(channels_last), prefetch, overlap
        s, t = _affine(mean, std)
        self._scale, self._shift = s.to(self.device), t.to(self.device)
        self.seed = seed
        self._gen = torch.Generator()
        self._gen.manual_seed(seed if seed is not None else int(torch.randint(1 << 62, ()).item()))
        self.stats = DecodeStats()
        self._streams = [None] * (self.decode_threads + 1)  # decode thread(s), then augment
        if self.device.type == "cuda":
            self._streams = [torch.cuda.Stream(self.device) for _ in self._streams]
            for st in self._streams:  # the constants were written on the current stream
                st.wait_stream(torch.cuda.current_stream(self.device))

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch`` on the loader's sampler(s) and dataset where they have one; with a
        ``seed``, crops and flips become a function of (seed, epoch) too."""
        super().set_epoch(epoch)
        if self.seed is not None:
            self._gen.manual_seed(self.seed * 1_000_003 + epoch)

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self):
        it = iter(self.loader)
        base = int(torch.randint(1 << 62, (), generator=self._gen))  # this pass's crops
        clock, st = time.perf_counter, self.stats
        ahead: list = []
        if self.overlap == 0:
            for k in itertools.count():
                t0 = clock()
                self._throttle(ahead)
                batch = next(it, _END)
                if batch is _END:
                    return
                t1 = clock()
                item = self._decode(batch)
                t2 = clock()
                out = self._augment(item, base + k)
                t3 = clock()
                st.add_time("loader", t1 - t0)
                st.add_time("decode", t2 - t1)
                st.add_time("augment", t3 - t2)
                yield out
        pipe = _Pipeline(self, it, base)
        try:
            while True:
                t0 = clock()
                self._throttle(ahead)
                t1 = clock()
                item = pipe.get()
                st.add_time("throttle", t1 - t0)
                st.add_time("consumer", clock() - t1)
                if item is _END:
                    return
                (images, labels), event = item
                if event is not None:
                    cur = torch.cuda.current_stream(self.device)
                    cur.wait_event(event)
                    images.record_stream(cur)
                    labels.record_stream(cur)
                yield images, labels
        finally:
            pipe.close()

    def _throttle(self, ahead: list) -> None:
        """Let the consumer queue at most ``max_ahead`` steps beyond what the GPU finished.

        A training loop that never synchronizes runs ahead until the driver's launch queue
        is full, then blocks inside a launch, holding the driver's lock: every CUDA call of
        the decode threads (several per image in nvJPEG) then waits about one kernel, and
        every batch handed out holds its memory. Too tight a limit idles the GPU whenever a
        batch comes a little late (measured, ResNet-18 as one CUDA graph: 76.6 % of the
        synthetic speed with 1, 89.3 % with 3, 91.2 % with 4). The event recorded at each
        request marks the end of the previous step's work.
        """
        if self.max_ahead is None or self.device.type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        ahead.append(ev)
        while len(ahead) > self.max_ahead:
            ahead.pop(0).synchronize()

    def _decode(self, batch, decoder=None):
        """nvJPEG for the encoded images, a copy for CPU-decoded ones; all on self.device."""
        if not isinstance(batch, EncodedBatch):
            raise TypeError(f"GPUDecoder needs batches of EncodedBatch (make_gpu_loader(root), or "
                            f"PackedDataset(decode=EncodedImage()) with collate_fn="
                            f"collate_encoded), got {type(batch).__name__}")
        decoder = decoder or self.decoder
        fused = self.resample == "triton"
        # NvjpegDecoder: the whole batch into one buffer (fused resize) or straight into the
        # matmul resize's padded groups.
        whole = getattr(decoder, "decode_flat" if fused else "decode_padded", None)
        if whole is not None and not bool(batch.decoded.any()):
            try:
                images, got = whole(batch.data, batch.offsets, self.device)
            except RuntimeError:
                pass  # nvJPEG refused the batch: the path below retries image by image
            else:
                if not torch.equal(got, batch.sizes):
                    raise RuntimeError("the decoder returned images of other sizes than their "
                                       "JPEG headers say")
                self.stats.add(gpu=len(got), batches=1)
                return images, batch.sizes, batch.labels.to(self.device, non_blocking=True)
        views = batch.images()
        n = len(views)
        on_gpu = (~batch.decoded).nonzero().flatten().tolist()
        out: List[Optional[torch.Tensor]] = [None] * n
        retried = 0
        if on_gpu:
            try:
                decoded = decoder([views[i] for i in on_gpu], self.device)
            except RuntimeError:
                decoded = [self._decode_alone(views[i], decoder) for i in on_gpu]
                retried = len(on_gpu)
            for i, im in zip(on_gpu, decoded):
                out[i] = im
            got = torch.tensor([im.shape for im in decoded])
            if not torch.equal(got[:, 1:], batch.sizes[on_gpu]) or bool((got[:, 0] != 3).any()):
                raise RuntimeError("the decoder returned images of other sizes than their JPEG "
                                   "headers say (or not 3 channels)")
        for i, v in enumerate(views):
            if out[i] is None:
                out[i] = v.to(self.device, non_blocking=True).permute(2, 0, 1)
        self.stats.add(gpu=len(on_gpu), cpu=n - len(on_gpu), retried=retried, batches=1)
        images = ImageTable.from_images(out) if fused else out
        return images, batch.sizes, batch.labels.to(self.device, non_blocking=True)

    def _decode_alone(self, data: torch.Tensor, decoder) -> torch.Tensor:
        try:
            return decoder([data], self.device)[0]
        except RuntimeError:
            im = open_image(ctypes.string_at(data.data_ptr(), data.numel()))
            px = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            return px.view(im.height, im.width, 3).to(self.device).permute(2, 0, 1)

    def _augment(self, item, seed: int):
        """Crop, resize, flip, normalize one decoded batch; its randomness comes from
        ``seed`` alone, so threads that augment batches at once give the same crops."""
        images, sizes, labels = item
        if self.train:
            gen = torch.Generator().manual_seed(seed)
            boxes = random_resized_crop_boxes(sizes, self.scale, self.ratio, generator=gen)
            flips = torch.rand(len(images), generator=gen) < 0.5 if self.flip else None
        else:
            boxes, flips = center_crop_boxes(sizes, self.size, self.crop_fraction), None
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = torch.empty((len(images), 3, *self.size), dtype=self.dtype, device=self.device,
                          memory_format=fmt)
        return resample_crops(images, boxes, self.size, flips, out=out, scale=self._scale,
                              shift=self._shift, sizes=sizes, method=self.resample), labels

    def __repr__(self) -> str:
        return (f"GPUDecoder({self.loader!r}, size={self.size}, train={self.train}, "
                f"dtype={self.dtype}, device={self.device}, overlap={self.overlap}, "
                f"backend={self.backend!r}, resample={self.resample!r})")


def _gpu_device(device, need_nvjpeg: bool, backend: str = "auto") -> torch.device:
    if need_nvjpeg:
        try:
            if backend == "nvjpeg":
                raise ImportError
            import torchvision.io  # noqa: F401
        except ImportError:
            try:
                if backend == "torchvision":
                    raise OSError
                _load_nvjpeg()
            except OSError:
                raise PackerError(
                    "GPU decoding needs nvJPEG, which comes with torchvision (pip install "
                    "torchvision, or pip install 'packer[gpu]'); without it use the CPU path: "
                    "PackedDataset(root, decode=DecodeRandomResizedCrop(224)) with make_loader "
                    "and CUDAPrefetcher") from None
        if not torch.cuda.is_available():
            raise PackerError(
                "GPU decoding needs a CUDA device, and torch.cuda.is_available() is False; use the "
                "CPU path: PackedDataset(root, decode=DecodeRandomResizedCrop(224)) with "
                "make_loader and CUDAPrefetcher")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PackerError(f"device={device} but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif need_nvjpeg:
        raise ValueError(f"nvJPEG decodes to a CUDA device, got device={device}")
    return device
