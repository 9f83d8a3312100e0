"""``GPUDecoder``: decode threads, each on its own CUDA stream, decode whole batches and augment
them in one Triton kernel (docs/gpu_decode.md)."""
from __future__ import annotations

import ctypes
import importlib
import itertools
import threading
import time
import warnings
import weakref
from typing import Optional, Sequence

import torch

from .._util.threads import END
from ..transforms.decode import open_image, output_size
from ..errors import PackerError
from ..loading.epochs import position
from ..loading.loader import PackedLoader
from ..loading.prefetch import (IMAGENET_MEAN, IMAGENET_STD, LoaderView, map_tensors,
                               normalize_affine, record_uses)
from .augment import center_crop_boxes, center_crop_inside, random_resized_crop_boxes
from .detection import DetectionTargets, fill_outside, letterbox_crops, place_boxes
from .encoded import EncodedBatch
from .loader import ConnectionsWarning, connections_advice
from .nvjpeg import NvjpegDecoder, load_nvjpeg, torchvision_decode
from .options import DecodeStats, GPUOptions
from .pipeline import NextPass, Pipeline
from .resample import CPU_PATH, TRITON_MISSING, ImageTable, resample_crops, triton_available

__all__ = ["GPUDecoder"]

LETTERBOX_FILL = 114  # YOLO's grey
KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loader -> a decoder's _kept


class GPUDecoder(LoaderView):
    """Iterate a :func:`make_gpu_loader` loader as ``(images, labels)`` ready on the GPU.

    ``images``: ``(B, 3, *size)`` in ``dtype``, normalized as ``(x / 255 - mean) / std``
    (both None: ``x / 255``; ``torch.uint8``: the rounded pixels). Training: RandomResizedCrop
    + flip; evaluation: resize and center-crop as ``DecodeCenterCrop``; ``letterbox=True``:
    fit ``size`` padded with grey 114. ``seed`` fixes the crops; ``options``
    (:class:`GPUOptions`) holds the finer settings. Detection batches are ``(images,
    targets)``, boxes moved with the crop (docs/gpu_decode.md).

    Needs CUDA, nvJPEG and Triton, else ``PackerError`` naming what to install. The iterator
    protocol is ``CUDAPrefetcher``'s; ``stats`` says where images were decoded and the time went."""

    def __init__(self, loader, *, size=224, train: bool = True,
                 mean: Optional[Sequence[float]] = IMAGENET_MEAN,
                 std: Optional[Sequence[float]] = IMAGENET_STD,
                 dtype: torch.dtype = torch.bfloat16, device=None, seed: Optional[int] = None,
                 letterbox: bool = False, options: Optional[GPUOptions] = None):
        self.options = opts = options if options is not None else GPUOptions()
        self.size = output_size(size)  # as the CPU path's decoders take it
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8):
            raise ValueError(f"dtype must be a float dtype (normalized) or torch.uint8 (pixels), "
                             f"got {dtype}")
        self.device = _gpu_device(device, opts.decoder is None, opts.backend)
        if self.device.type == "cuda" and (advice := connections_advice()):
            warnings.warn(advice, ConnectionsWarning, stacklevel=2)
        self.decoders, self.backend = _decoders(opts, self.device)
        self.decode_threads = len(self.decoders)
        self.loader = loader
        self.train, self.dtype, self.letterbox = bool(train), dtype, bool(letterbox)
        s, t = normalize_affine(mean, std)
        self.norm_scale, self.norm_shift = s.to(self.device), t.to(self.device)
        self.seed = seed
        self._state = None  # the loader's state after the last batch handed out
        self._active = 1  # decode threads at work (Pipeline paces them), kept across passes
        self._ahead: list = []  # events of the consumer's last steps (throttle)
        self._kept: dict = {}  # a pipeline gone on into the next pass: pipe, next, state
        weakref.finalize(self, _close_kept, self._kept)
        self._reseeded = False  # set_epoch reseeded the crops since the last pass began
        self._gen = torch.Generator()
        self._gen.manual_seed(seed if seed is not None else int(torch.randint(1 << 62, ()).item()))
        self.stats = DecodeStats()
        self.streams = [None] * self.decode_threads
        if self.device.type == "cuda":
            self.streams = [torch.cuda.Stream(self.device) for _ in self.streams]
            for st in self.streams:  # the constants were written on the current stream
                st.wait_stream(torch.cuda.current_stream(self.device))

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch`` on the loader's sampler(s) and dataset where they have one; with a
        ``seed``, crops and flips become a function of (seed, epoch) too."""
        super().set_epoch(epoch)
        if self.seed is not None:
            self._gen.manual_seed(_epoch_seed(self.seed, epoch))
            self._reseeded = True

    def __iter__(self):
        snapshot = getattr(self.loader, "state_dict", None)
        reseeded, self._reseeded = self._reseeded, False
        base = int(torch.randint(1 << 62, (), generator=self._gen))  # this pass's crops
        kept = self._kept
        other = KEPT.get(self.loader) if isinstance(self.loader, PackedLoader) else None
        if other is not None and other is not kept:
            _close_kept(other)  # another decoder's threads went on with this loader: stop them
        pipe, nxt, self._state = (kept.pop(k, None) for k in ("pipe", "next", "state"))
        if pipe is not None and nxt.key != (self._position(), base):
            pipe.close()  # the loader or the crops moved since the pass was begun early
            pipe, s = None, self.loader.sampler
            s.received(s.start)  # what the threads drew for it was never handed out
        if pipe is None:
            it = iter(self.loader)
            self._state = snapshot() if snapshot is not None else None
        else:
            nxt.begun.set()  # the threads may draw the rest of the pass
        clock, st = time.perf_counter, self.stats
        ahead = self._ahead  # kept across passes: the GPU's queue does not end with an epoch
        if self.options.overlap == 0:
            for k in itertools.count():
                t0 = clock()
                self.throttle(ahead)
                batch = next(it, END)
                if batch is END:
                    self._state = snapshot() if snapshot is not None else None  # the next pass's
                    return
                state = snapshot() if snapshot is not None else None
                t1 = clock()
                item = self.decode_batch(batch)
                t2 = clock()
                out = self.augment_batch(item, base + k)
                t3 = clock()
                st.add_time("loader", t1 - t0)
                st.add_time("decode", t2 - t1)
                st.add_time("augment", t3 - t2)
                self._state = state
                yield out
        if pipe is None:
            gen = torch.Generator()
            gen.set_state(self._gen.get_state())  # the next passes' crops, if nothing reseeds
            me, stop = weakref.proxy(self), threading.Event()  # threads must not keep self alive
            pipe = Pipeline(me, _passes(me, it, base, gen, reseeded, stop), stop, self._active)
        try:
            for k in itertools.count():
                t0 = clock()
                self.throttle(ahead)
                t1 = clock()
                item = pipe.get(ran_dry=lambda: not ahead or ahead[-1].query())
                self._active = st.threads = pipe.active
                st.add_time("throttle", t1 - t0)
                st.add_time("consumer", clock() - t1)
                if item is END:
                    self._state = snapshot() if snapshot is not None else None  # the next pass's
                    return
                if isinstance(item, NextPass):  # the threads went on: keep them for the next pass
                    state = pipe.states.pop(pipe.handed, None)
                    kept.update(pipe=pipe, next=item, state=state)
                    KEPT[self.loader] = kept
                    self._state = state if state is not None else self._state
                    return
                (images, labels), event = item
                if event is not None:
                    cur = torch.cuda.current_stream(self.device)
                    cur.wait_event(event)
                    record_uses((images, labels), cur)
                self._state = pipe.states.pop(pipe.handed, self._state)
                yield images, labels
        finally:
            if kept.get("pipe") is not pipe:
                pipe.close()

    def state_dict(self) -> dict:
        """The loader's state as of the last batch handed out (decode threads run ahead); needs a
        loader that resumes. Crops after a resume are new draws."""
        if not hasattr(self.loader, "state_dict"):
            raise TypeError("GPUDecoder.state_dict needs a loader with state_dict(): use "
                            "make_gpu_loader with a PackedSampler (its default) or stateful=True")
        return {"loader": self._state if self._state is not None else self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next ``iter()`` starts at the first batch not handed out before."""
        _close_kept(self._kept)
        self.loader.load_state_dict(state["loader"])
        self._state = state["loader"]

    def _position(self) -> Optional[tuple]:
        """Where the sampler of a loader that runs on into the next epoch (make_loader's with a
        ``PackedSampler``) is; None for other loaders, whose passes start anew."""
        if not isinstance(self.loader, PackedLoader) or self.loader.stream is None:
            return None
        return position(self.loader.sampler)

    def throttle(self, ahead: list) -> None:
        """Let the consumer queue at most ``max_ahead`` steps beyond what the GPU finished: a loop
        that runs ahead until the launch queue is full holds the driver's lock, stalling the
        decode threads (docs/gpu_decode.md)."""
        max_ahead = self.options.max_ahead
        if max_ahead is None or self.device.type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        ahead.append(ev)
        while len(ahead) > max_ahead:
            ahead.pop(0).synchronize()

    def decode_batch(self, batch, decoder=None):
        """``(ImageTable on self.device, sizes, labels)``: nvJPEG for the encoded images, a
        copy for those the workers decoded."""
        if not isinstance(batch, EncodedBatch):
            raise TypeError(f"GPUDecoder needs batches of EncodedBatch (make_gpu_loader(root), or "
                            f"PackedDataset(decode=EncodedImage()) with collate_fn="
                            f"collate_encoded), got {type(batch).__name__}")
        decoder = decoder or self.decoders[0]
        flat = getattr(decoder, "decode_flat", None)  # NvjpegDecoder: one buffer per batch
        if flat is not None and not bool(batch.decoded.any()):
            try:
                images = flat(batch.data, batch.offsets, self.device, sizes=batch.sizes)
            except RuntimeError:
                pass  # nvJPEG refused the batch: the path below retries image by image
            else:
                self.stats.add(gpu=len(images), batches=1)
                return images, batch.sizes, self._labels(batch.labels)
        views = batch.images()
        on_gpu = (~batch.decoded).nonzero().flatten().tolist()
        done, retried = {}, 0
        if on_gpu:
            try:
                decoded = decoder([views[i] for i in on_gpu], self.device)
            except RuntimeError:
                decoded = [self._decode_alone(views[i], decoder) for i in on_gpu]
                retried = len(on_gpu)
            done = dict(zip(on_gpu, decoded))
            got = torch.tensor([im.shape for im in decoded])
            if not torch.equal(got[:, 1:], batch.sizes[on_gpu]) or bool((got[:, 0] != 3).any()):
                raise RuntimeError("the decoder returned images of other sizes than their JPEG "
                                   "headers say (or not 3 channels)")
        out = [done[i] if i in done else v.to(self.device, non_blocking=True).permute(2, 0, 1)
               for i, v in enumerate(views)]
        if self.device.type == "cuda":  # copies done here: the batch's host bytes (a ring slot)
            # may be reused once it is dropped, whichever thread (and stream) drops it
            torch.cuda.current_stream(self.device).synchronize()
        self.stats.add(gpu=len(on_gpu), cpu=len(views) - len(on_gpu), retried=retried, batches=1)
        return ImageTable.from_images(out), batch.sizes, self._labels(batch.labels)

    def _labels(self, labels):
        """Class labels on the device; detection targets stay on the host (``place_boxes``)."""
        if isinstance(labels, DetectionTargets):
            return labels
        return map_tensors(labels, lambda t: t.to(self.device, non_blocking=True))  # any nesting

    def _decode_alone(self, data: torch.Tensor, decoder) -> torch.Tensor:
        try:
            return decoder([data], self.device)[0]
        except RuntimeError:
            im = open_image(ctypes.string_at(data.data_ptr(), data.numel()))
            px = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            return px.view(im.height, im.width, 3).to(self.device).permute(2, 0, 1)

    def augment_batch(self, item, seed: int):
        """Crop, resize, flip, normalize one decoded batch; its randomness comes from
        ``seed`` alone, so threads that augment batches at once give the same crops."""
        images, sizes, labels = item
        o = self.options
        gen = torch.Generator().manual_seed(seed)
        inside, fill = None, 0.0  # where the pixels land, and the padding's value around them
        if self.letterbox:
            (boxes, inside), fill = letterbox_crops(sizes, self.size), float(LETTERBOX_FILL)
        elif self.train:
            boxes = random_resized_crop_boxes(sizes, o.scale, o.ratio, generator=gen)
        else:
            boxes = center_crop_boxes(sizes, self.size, o.crop_fraction)
            inside = center_crop_inside(sizes, self.size, o.crop_fraction)
        flips = (torch.rand(len(sizes), generator=gen) < 0.5) if self.train and o.flip else None
        fmt = torch.channels_last if o.channels_last else torch.contiguous_format
        out = torch.empty((len(sizes), 3, *self.size), dtype=self.dtype, device=self.device,
                          memory_format=fmt)
        out = resample_crops(images, boxes, self.size, flips, out=out, scale=self.norm_scale,
                             shift=self.norm_shift)
        if inside is not None:
            value = torch.full((3,), fill, device=self.device)
            if self.dtype != torch.uint8:
                value = value * self.norm_scale.flatten().expand(3) + self.norm_shift.flatten().expand(3)
            fill_outside(out, inside, flips, value)
        if isinstance(labels, DetectionTargets):
            labels = place_boxes(labels, boxes, self.size, flips, o.min_visible, self.device)
        return out, labels

    def __repr__(self) -> str:
        return (f"GPUDecoder({self.loader!r}, size={self.size}, train={self.train}, "
                f"dtype={self.dtype}, device={self.device}, overlap={self.options.overlap}, "
                f"backend={self.backend!r})")


def _epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1_000_003 + epoch


def _passes(dec, it, base: int, gen: torch.Generator, reseeded: bool, stop: threading.Event):
    """``(crop seed, batch)`` of a pass; then, for a loader that runs on into the next epoch, a
    ``NextPass`` and the next pass as ``__iter__`` would begin it (it checks the key). Of a pass
    not yet begun, at most ``queue_depth`` batches are drawn, never its end (which moves the
    sampler on). ``gen`` continues the crop generator; ``reseeded``: the next pass reseeds too."""
    early, begun = min(dec.options.queue_depth, len(dec.loader)), None
    while True:
        for k in itertools.count():
            while begun is not None and k >= early and not begun.wait(0.05):
                if stop.is_set():
                    return
            batch = next(it, END)
            if batch is END:
                break
            yield base + k, batch
        at = dec._position()
        if at is None:
            return
        if reseeded:
            gen = torch.Generator().manual_seed(_epoch_seed(dec.seed, dec.loader.sampler.epoch))
        base = int(torch.randint(1 << 62, (), generator=gen))
        it, begun = iter(dec.loader), threading.Event()
        yield NextPass((at, base), begun)


def _close_kept(kept: dict) -> None:
    """Stop a pipeline kept for the next pass (its decoder is gone, or resumes elsewhere)."""
    pipe = kept.pop("pipe", None)
    kept.clear()
    if pipe is not None:
        pipe.close()


def _gpu_device(device, need_nvjpeg: bool, backend: str = "auto") -> torch.device:
    """The device to decode to, after checking that what it needs is here: nvJPEG (unless a
    custom decoder replaces it), CUDA, and Triton for a CUDA device."""
    if need_nvjpeg:
        try:
            if backend == "nvjpeg":
                raise ImportError
            importlib.import_module("torchvision.io")
        except ImportError:
            try:
                if backend == "torchvision":
                    raise OSError
                load_nvjpeg()
            except OSError:
                raise PackerError(
                    "GPU decoding needs nvJPEG, which comes with torchvision (pip install "
                    f"torchvision, or pip install 'packer-lmdb[gpu]'); without it {CPU_PATH}") from None
        if not torch.cuda.is_available():
            raise PackerError("GPU decoding needs a CUDA device, and torch.cuda.is_available() "
                              f"is False; {CPU_PATH}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise PackerError(f"device={device} but CUDA is not available")
        if not triton_available():
            raise PackerError(TRITON_MISSING)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif need_nvjpeg:
        raise ValueError(f"nvJPEG decodes to a CUDA device, got device={device}")
    return device


def _decoders(opts: GPUOptions, device: torch.device):
    """(one decoder per decode thread, the backend's name)."""
    if opts.decoder is not None:
        return [opts.decoder] * (opts.decode_threads or 1), "custom"
    if opts.backend in ("auto", "nvjpeg"):  # a handle per decode thread
        threads = opts.decode_threads or (3 if opts.overlap == 2 else 1)
        try:
            decoders = [NvjpegDecoder.shared(device, k) for k in range(threads)]
            return decoders, f"nvjpeg-{decoders[0].backend}"
        except (OSError, RuntimeError):
            if opts.backend == "nvjpeg":
                raise
    return [torchvision_decode] * (opts.decode_threads or 1), "torchvision"
