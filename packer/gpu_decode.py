"""GPU decoding: the loader ships stored JPEG bytes, the GPU decodes (nvJPEG) and augments.

Pillow on 16 cores decodes and resizes 4,600-8,000 ImageNet JPEGs/s; one H200 trains a
ResNet-18 on ~13,000/s. So here the DataLoader workers only read records and parse JPEG
headers (microseconds), and the GPU does the rest in whole batches:

    workers   EncodedImage: header parse; CPU decode only for what nvJPEG can't take
              collate_encoded: one flat byte buffer per batch (one shared-memory block)
    thread 1  torchvision.io.decode_jpeg(list, device="cuda"): nvJPEG, hardware engine for
              baseline JPEGs on A100/H100/H200 (torchvision is the optional ``gpu`` extra)
    thread 2  crop boxes, then crop + antialiased bilinear resize + flip of the whole batch
              as two batched matmuls, normalize, dtype, channels_last
    consumer  ``for x, y in GPUDecoder(make_gpu_loader(root, 256)):``

Each thread has its own CUDA stream; batches cross with events and ``record_stream``, as in
``CUDAPrefetcher``, so the training stream waits for a batch only until it is ready.
docs/gpu_decode.md has the measurements, the reasons for each choice, and the limits.
"""
from __future__ import annotations

import copy
import ctypes
import math
import os
import queue
import threading
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils.data import default_collate, get_worker_info

from .errors import PackerError
from .imaging import open_image
from .loader import _drain
from .prefetch import IMAGENET_MEAN, IMAGENET_STD, LoaderView, _affine

__all__ = ["DecodeStats", "EncodedBatch", "EncodedImage", "EncodedSample", "GPUDecoder",
           "JpegInfo", "NvjpegDecoder", "center_crop_boxes", "collate_encoded", "gpu_decodable",
           "jpeg_info", "make_gpu_loader", "random_resized_crop_boxes", "resample_crops"]

# -- JPEG headers ----------------------------------------------------------------------------

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
    """Parse the markers up to the frame header: a few segments, microseconds in Python.

    Returns None for anything that is not a well-formed JPEG up to its SOF (PNG, WEBP,
    truncated headers): the caller then lets PIL decide what the bytes are.
    """
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
    """True for what nvJPEG's batched path takes well: 8-bit baseline Huffman JPEGs, grey
    or YCbCr in a common subsampling. Everything else is decoded on the CPU, in workers:

    - progressive: nvJPEG decodes it, but torchvision does so one image at a time with the
      Huffman decoding on the decode thread's CPU, stalling the whole batch;
    - CMYK/YCCK and Adobe RGB-coded files: PIL's ``convert("RGB")`` is the reference colour;
    - 12-bit, arithmetic, lossless, hierarchical, 4:1:1/4:1:0 (not on the hardware
      engine) and odd subsamplings: not supported, or slow.
    """
    return (info is not None and info.process == "baseline" and not info.arithmetic
            and info.precision == 8 and info.width > 0 and info.height > 0
            and (info.components == 1 or (info.components == 3 and info.adobe_transform != 0))
            and info.subsampling in ("4:4:4", "4:2:2", "4:2:0", "4:4:0", "gray"))


# -- worker side: the decode= hook and the collate -----------------------------------------

class EncodedSample(NamedTuple):
    """One image as it leaves a worker: JPEG bytes for the GPU, or, when ``decoded``, the
    RGB pixels (``height x width x 3`` uint8, row-major) that the CPU decoded instead."""
    data: bytes
    height: int
    width: int
    decoded: bool


class EncodedImage:
    """``PackedDataset(root, decode=EncodedImage())``: no decoding for JPEGs nvJPEG takes.

    The hook sees only the stored bytes, so it reads the JPEG frame header itself (cheaper
    than passing records around, and right whatever wrote the file). Files that
    :func:`gpu_decodable` refuses (PNG, CMYK, progressive...) are decoded here, in the
    worker, exactly as ImageFolder does (``Image.open(f).convert("RGB")``), and travel as
    pixels: the GPU stage then crops and resizes them like the others. EXIF orientation is
    ignored on both paths, as in ImageFolder.
    """

    def __call__(self, data: bytes) -> EncodedSample:
        info = jpeg_info(data)
        if gpu_decodable(info):
            return EncodedSample(bytes(data), info.height, info.width, False)
        im = open_image(data)
        return EncodedSample(im.tobytes(), im.height, im.width, True)

    def __repr__(self) -> str:
        return "EncodedImage()"


class EncodedBatch(NamedTuple):
    """A collated batch: every image's bytes back to back in ``data`` (one tensor, so one
    shared-memory block crosses from the worker instead of one per image)."""
    data: torch.Tensor     # uint8 (total,): JPEG bytes, or HWC RGB pixels where ``decoded``
    offsets: torch.Tensor  # int64 (B + 1,): image i is data[offsets[i]:offsets[i + 1]]
    sizes: torch.Tensor    # int64 (B, 2): (height, width)
    decoded: torch.Tensor  # bool (B,)
    labels: torch.Tensor   # (B,) as default_collate makes them

    def images(self) -> List[torch.Tensor]:
        """Per-image views: 1-D JPEG bytes, or (H, W, 3) pixels where ``decoded``."""
        views = list(torch.split(self.data, torch.diff(self.offsets).tolist()))
        if bool(self.decoded.any()):
            for i in self.decoded.nonzero().flatten().tolist():
                h, w = self.sizes[i].tolist()
                views[i] = views[i].view(h, w, 3)
        return views


def collate_encoded(batch) -> EncodedBatch:
    """Collate ``(EncodedSample, label)`` pairs into an :class:`EncodedBatch`.

    In a worker the byte buffer is allocated in shared memory directly (as default_collate
    does for tensors), so the batch reaches the main process without another copy.
    """
    if not batch:
        raise ValueError("collate_encoded got an empty batch")
    samples, targets = zip(*batch)
    if not isinstance(samples[0], EncodedSample):
        raise TypeError(f"collate_encoded needs samples from PackedDataset(root, decode="
                        f"EncodedImage()) (use make_gpu_loader), got {type(samples[0]).__name__}")
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s.data))
    data = _empty_u8(offsets[-1])
    base = data.data_ptr()
    for s, o in zip(samples, offsets):
        ctypes.memmove(base + o, s.data, len(s.data))
    return EncodedBatch(data, torch.tensor(offsets, dtype=torch.int64),
                        torch.tensor([(s.height, s.width) for s in samples], dtype=torch.int64),
                        torch.tensor([s.decoded for s in samples], dtype=torch.bool),
                        default_collate(list(targets)))


def _empty_u8(n: int) -> torch.Tensor:
    if get_worker_info() is not None and n > 0:
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(n), 0, (n,))
    return torch.empty(n, dtype=torch.uint8)


def make_gpu_loader(dataset, batch_size: int = 256, **kwargs):
    """``make_loader`` for the GPU path: ``dataset`` (a path or a ``PackedDataset``) hands
    out :class:`EncodedSample` and batches are :class:`EncodedBatch`.

    ``pin_memory`` stays make_loader's default (True with CUDA), though nvJPEG reads the
    bytes on the host: DataLoader's pin thread then receives each batch from the workers
    and first-touches its freshly mapped shared memory, work that otherwise lands on the
    decode thread (measured on an H200: 16,100 images/s pinned, 12,700 not). Others go to
    ``make_loader`` (``shuffle``, ``sampler``, ``num_workers``, ``drop_last``...). A
    dataset with a ``decode``/``transform`` of its own is copied with ``decode=EncodedImage()``.
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
    return make_loader(dataset, batch_size, **kwargs)


# -- crop boxes (torchvision's maths, vectorised; CPU float64) ------------------------------

def random_resized_crop_boxes(sizes: torch.Tensor, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), *,
                              generator: Optional[torch.Generator] = None,
                              tries: int = 10) -> torch.Tensor:
    """RandomResizedCrop boxes ``(x0, y0, x1, y1)`` for images of ``sizes`` ``(B, 2)`` (h, w):
    torchvision's 10 tries of (area, log-ratio), the first that fits, else its central
    fallback; the same maths as ``DecodeRandomResizedCrop.box``, for a batch at once."""
    h, w = sizes[:, 0].double(), sizes[:, 1].double()
    b = len(h)
    u = torch.rand(b, tries, 4, dtype=torch.float64, generator=generator)
    target = (h * w)[:, None] * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    r = torch.exp(lo + (hi - lo) * u[..., 1])
    cw, ch = torch.round(torch.sqrt(target * r)), torch.round(torch.sqrt(target / r))
    ok = (cw > 0) & (cw <= w[:, None]) & (ch > 0) & (ch <= h[:, None])
    k = ok.to(torch.uint8).argmax(1, keepdim=True)  # first try that fits
    pick = lambda t: t.gather(1, k).squeeze(1)  # noqa: E731
    cw, ch = pick(cw), pick(ch)
    x = torch.floor(pick(u[..., 2]) * (w - cw + 1))
    y = torch.floor(pick(u[..., 3]) * (h - ch + 1))
    # Fallback: the whole image, clamped to the ratio range, centred.
    ar = w / h
    fw = torch.where(ar > ratio[1], torch.round(h * ratio[1]), w)
    fh = torch.where(ar < ratio[0], torch.round(w / ratio[0]), h)
    has = ok.any(1)
    cw, ch = torch.where(has, cw, fw), torch.where(has, ch, fh)
    x = torch.where(has, x, torch.floor((w - fw) / 2))
    y = torch.where(has, y, torch.floor((h - fh) / 2))
    return torch.stack([x, y, x + cw, y + ch], 1)


def center_crop_boxes(sizes: torch.Tensor, size: Tuple[int, int],
                      crop_fraction: float = 0.875) -> torch.Tensor:
    """Evaluation boxes: ``DecodeCenterCrop.box`` (Resize(size/crop_fraction) + CenterCrop)."""
    h, w = sizes[:, 0].double(), sizes[:, 1].double()
    oh, ow = size
    s = torch.minimum(w, h) * crop_fraction / min(oh, ow)
    cw, ch = torch.minimum(w, ow * s), torch.minimum(h, oh * s)
    x, y = (w - cw) / 2, (h - ch) / 2
    return torch.stack([x, y, x + cw, y + ch], 1)


# -- batched crop + resize ------------------------------------------------------------------

def resample_crops(images: Sequence[torch.Tensor], boxes: torch.Tensor, size: Tuple[int, int],
                   flips: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
                   scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None,
                   sizes: Optional[torch.Tensor] = None, budget: int = 512 << 20) -> torch.Tensor:
    """Crop ``boxes`` out of ``images`` (uint8 (3, h, w), any sizes and strides, one device),
    resize each to ``size`` (h, w), flip where ``flips``, write ``x * scale + shift``.

    The filter is PIL's BILINEAR with a box (triangle, support widened by the downscale
    factor, so antialiased), the one the CPU decoders use: outputs match PIL to rounding.
    Being separable, it is two matrix products per image, ``Wy @ image @ Wx^T``, done as
    two batched matmuls (float16 on the GPU, float32 on the CPU). Images are zero-padded to
    a common size with nested tensors (one C++ call and one kernel, not a Python loop:
    per-image Python work would hold the GIL the decode thread needs), in groups of similar
    size and orientation so padding stays under ``budget`` bytes. Flipping walks ``Wx``
    backwards. ``sizes`` ((B, 2) h, w) saves reading the shapes. ``out`` (default float32)
    may be any dtype and memory format; for uint8 the result is rounded, scale/shift unused.
    """
    b = len(images)
    oh, ow = size
    device = boxes.device if not images else images[0].device
    if out is None:
        out = torch.empty((b, 3, oh, ow), dtype=torch.float32, device=device)
    if b == 0:
        return out
    cdt = torch.float16 if device.type == "cuda" else torch.float32
    if sizes is None:
        sizes = torch.tensor([tuple(im.shape[-2:]) for im in images])
    hw = sizes.to("cpu", torch.float64)
    boxes = boxes.to("cpu", torch.float64)
    flips = torch.zeros(b, dtype=torch.bool) if flips is None else flips.to("cpu", torch.bool)
    # Per axis: centre of output pixel i is start + (i + 0.5) * step; filter scale
    # max(step, 1); pixels at or past the image's size get no weight (padding).
    x0, y0, x1, y1 = boxes.unbind(1)
    sy, sx = (y1 - y0) / oh, (x1 - x0) / ow
    params = torch.stack([y0, sy, sy.clamp(min=1), hw[:, 0], torch.where(flips, x1, x0),
                          torch.where(flips, -sx, sx), sx.clamp(min=1), hw[:, 1]], 1)
    params = _to(params.float(), device)
    # Greedy groups in (orientation, area) order, so portrait and landscape images do not
    # pad each other to a square.
    h_l, w_l = sizes[:, 0].tolist(), sizes[:, 1].tolist()
    order = sorted(range(b), key=lambda i: (h_l[i] > w_l[i], h_l[i] * w_l[i]), reverse=True)
    el = 2 if cdt == torch.float16 else 4
    chunks, cur, mh, mw = [], [], 0, 0
    for i in order:
        nh, nw = max(mh, h_l[i]), max(mw, w_l[i])
        if cur and (len(cur) + 1) * 3 * _up8(nh) * _up8(nw) * el > budget:
            chunks.append(cur)
            cur, nh, nw = [], h_l[i], w_l[i]
        cur.append(i)
        mh, mw = nh, nw
    chunks.append(cur)
    whole = len(chunks) == 1
    if whole:
        chunks = [list(range(b))]  # one group: keep the batch order, no index_copy
    uint8 = out.dtype == torch.uint8
    if not uint8:
        scale = torch.ones(1, 3, 1, 1, device=device) if scale is None else scale
        shift = torch.zeros(1, 3, 1, 1, device=device) if shift is None else shift
    for idx in chunks:
        n = len(idx)
        x = _pad([images[i] for i in idx], cdt)                  # (n, 3, hc, wc)
        hc, wc = x.shape[-2:]
        p = params if whole else params[_to(torch.tensor(idx), device)]
        wy, sy_ = _weights(p[:, 0:4], oh, hc, cdt)               # (n, oh, hc), (n, oh)
        wx, sx_ = _weights(p[:, 4:8], ow, wc, cdt)               # (n, ow, wc), (n, ow)
        t = torch.bmm(x.view(n, 3 * hc, wc), wx.transpose(1, 2))  # (n, 3 * hc, ow)
        del x
        t = t.view(n, 3, hc, ow).transpose(1, 2).reshape(n, hc, 3 * ow)
        o = torch.bmm(wy, t)                                     # (n, oh, 3 * ow)
        o = o.view(n, oh, 3, ow).permute(0, 2, 1, 3)             # (n, 3, oh, ow)
        norm = (sy_[:, :, None] * sx_[:, None, :]).reciprocal_()[:, None]  # (n, 1, oh, ow)
        if uint8:
            res = (o * norm).round_().clamp_(0, 255)
        else:
            res = torch.addcmul(shift, o, norm * scale)              # (n, 3, oh, ow) float32
        if whole:
            out.copy_(res)
        else:
            out.index_copy_(0, _to(torch.tensor(idx), device), res.to(out.dtype))
    return out


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor to ``device`` without waiting for the stream's queued work (a
    copy from pageable memory would block this thread until the GPU catches up)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _up8(v: int) -> int:
    return (v + 7) // 8 * 8  # tensor-core friendly matmul sizes


_NESTED_WARNING = [False]


def _pad(images: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """(n, 3, H, W) ``dtype``, each image top-left, zeros elsewhere; H, W multiples of 8."""
    if not _NESTED_WARNING[0]:  # torch warns once that nested tensors are a prototype API
        _NESTED_WARNING[0] = True
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors", category=UserWarning)
    hm, wm = max(im.shape[-2] for im in images), max(im.shape[-1] for im in images)
    nt = torch.nested.nested_tensor(list(images), dtype=dtype)
    return nt.to_padded_tensor(0.0, (len(images), 3, _up8(hm), _up8(wm)))


def _weights(p: torch.Tensor, n_out: int, width: int, dtype: torch.dtype):
    """Resampling matrices (B, n_out, width) in ``dtype`` from per-image (start, step,
    filter scale, valid width): PIL's triangle filter, unnormalised, plus each row's sum
    over the valid pixels (B, n_out) to divide the result by. Five passes over the matrix,
    in ``dtype`` but for the first: it is the largest temporary of the resample."""
    start, step, fs, valid = (p[:, k:k + 1] for k in range(4))
    inv = 1.0 / fs
    centre = (start + (torch.arange(n_out, device=p.device, dtype=p.dtype) + 0.5) * step) * inv
    j = torch.arange(width, device=p.device, dtype=p.dtype) + 0.5
    w = torch.empty((len(p), n_out, width), dtype=dtype, device=p.device)
    torch.addcmul(-centre[:, :, None], j, inv[:, :, None], out=w)  # (j - centre) / fs
    w.abs_().neg_().add_(1).clamp_(min=0)
    mask = (j < valid).to(dtype)[:, :, None]                       # (B, width, 1)
    return w, torch.bmm(w, mask).squeeze(2).float().clamp_(min=1e-12)


# -- the GPU stage ---------------------------------------------------------------------------

@dataclass
class DecodeStats:
    """Where images were decoded, and where the time went.

    ``cpu``: decoded in workers (not JPEG, or a JPEG nvJPEG does not take well);
    ``retried``: nvJPEG refused a batch and the image was decoded alone (PIL if nvJPEG
    refused it again). ``seconds``: wall time per stage, host side: ``loader`` (waiting for
    the DataLoader), ``decode``, ``augment`` (or ``decode+augment`` with ``overlap=1``; GPU
    work is asynchronous, so this is launch time), and ``consumer`` (the training loop
    waiting for a batch: near zero when decoding keeps up).
    """
    gpu: int = 0
    cpu: int = 0
    retried: int = 0
    batches: int = 0
    seconds: dict = field(default_factory=dict)

    def add_time(self, where: str, dt: float) -> None:
        self.seconds[where] = self.seconds.get(where, 0.0) + dt

    def as_dict(self) -> dict:
        return asdict(self)


def _nvjpeg(datas: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """torchvision's batched nvJPEG decode (the ``backend="torchvision"`` decoder)."""
    from torchvision.io import ImageReadMode, decode_jpeg
    return decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)


class _Image(ctypes.Structure):  # nvjpegImage_t (nvJPEG >= 11: size_t pitches)
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


class NvjpegDecoder:
    """nvJPEG's batched decoder called directly (ctypes): GPU decoding without torchvision.

    Same library and hardware engine as torchvision's decoder (pixels are identical), one
    output allocation per batch instead of one per image, and the work on a stream of
    ``priority`` (default: the highest). The priority was meant to let decoding overtake a
    training step's queued kernels; measured on an H200 it does not (docs/gpu_decode.md),
    so torchvision stays the default where installed. The hardware engine (A100/H100/H200)
    is used when nvJPEG has it, else its default backend. Raises OSError/RuntimeError when
    libnvjpeg cannot be loaded or set up. Calls are serialised by a lock (one nvJPEG state);
    :meth:`shared` gives one instance per device, as nvJPEG handles are never freed here
    (freeing them at interpreter exit can run after CUDA has shut down).
    """
    _shared: dict = {}

    @classmethod
    def shared(cls, device: torch.device) -> "NvjpegDecoder":
        if device not in cls._shared:
            cls._shared[device] = cls(device)
        return cls._shared[device]

    def __init__(self, device: torch.device, *, hardware: bool = True, priority: Optional[int] = None):
        self.lib = lib = _load_nvjpeg()
        vp, pp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        lib.nvjpegCreateEx.argtypes = [ctypes.c_int, vp, vp, ctypes.c_uint, pp]
        lib.nvjpegJpegStateCreate.argtypes = [vp, pp]
        lib.nvjpegDecodeBatchedInitialize.argtypes = [vp, vp, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.nvjpegDecodeBatched.argtypes = [vp, vp, pp, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(_Image), vp]
        ip = ctypes.POINTER(ctypes.c_int)
        lib.nvjpegGetImageInfo.argtypes = [vp, vp, ctypes.c_size_t, ip, ip, ip, ip]
        self.handle, self.state = vp(), vp()
        self.backend = "hardware"
        status = lib.nvjpegCreateEx(3, None, None, 0, ctypes.byref(self.handle)) if hardware else -1
        if status != 0:  # no hardware engine (status 8: arch mismatch): nvJPEG picks a backend
            self.backend = "default"
            status = lib.nvjpegCreateEx(0, None, None, 0, ctypes.byref(self.handle))
        _check(status, "nvjpegCreateEx")
        _check(lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "nvjpegJpegStateCreate")
        if priority is None:
            priority = torch.cuda.Stream.priority_range()[1]  # the highest
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=priority)
        self._batch = 0
        self._lock = threading.Lock()

    def __call__(self, datas: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
        with self._lock:
            return self._decode(datas, device)

    def _decode(self, datas: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
        n = len(datas)
        if n == 0:
            return []
        shapes = [self._size(d) for d in datas]
        offs = [0]
        for h, w in shapes:
            offs.append(offs[-1] + 3 * h * w)
        out = torch.empty(offs[-1], dtype=torch.uint8, device=device)
        base = out.data_ptr()
        images = (_Image * n)()
        for i, (h, w) in enumerate(shapes):
            for c in range(3):  # planar RGB straight into (3, h, w) tensors
                images[i].channel[c] = base + offs[i] + c * h * w
                images[i].pitch[c] = w
        ptrs = (ctypes.c_void_p * n)(*[d.data_ptr() for d in datas])
        lens = (ctypes.c_size_t * n)(*[d.numel() for d in datas])
        # The allocation above belongs to the caller's stream; make ours wait for it.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        if self._batch != n:
            _check(self.lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, n, 1, 3),
                   "nvjpegDecodeBatchedInitialize")
            self._batch = n
        status = self.lib.nvjpegDecodeBatched(self.handle, self.state, ptrs, lens, images,
                                              ctypes.c_void_p(self.stream.cuda_stream))
        if status != 0:
            self._batch = 0  # nvJPEG asks for a fresh initialize after a failed batch
            _check(status, "nvjpegDecodeBatched")
        # Wait here (GIL released): the host bitstreams and nvJPEG's state are free again,
        # and the images are complete whatever stream reads them next.
        self.stream.synchronize()
        return [out[offs[i]:offs[i + 1]].view(3, h, w) for i, (h, w) in enumerate(shapes)]

    def _size(self, data: torch.Tensor) -> Tuple[int, int]:
        comps, sub = ctypes.c_int(), ctypes.c_int()
        w, h = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
        _check(self.lib.nvjpegGetImageInfo(self.handle, data.data_ptr(), data.numel(),
                                           ctypes.byref(comps), ctypes.byref(sub), w, h),
               "nvjpegGetImageInfo")
        return h[0], w[0]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with nvJPEG status {status}")


_NVJPEG_LIB = []


def _load_nvjpeg():
    """libnvjpeg: torchvision's bundled copy first (it matches torch's CUDA), then the
    system's (CUDA toolkit, nvidia-nvjpeg wheels)."""
    if _NVJPEG_LIB:
        return _NVJPEG_LIB[0]
    import ctypes.util
    import glob
    import importlib.util
    names = []
    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        root = os.path.dirname(os.path.dirname(spec.origin))
        names += sorted(glob.glob(os.path.join(root, "torchvision.libs", "libnvjpeg*.so*")))
    names += [n for n in (ctypes.util.find_library("nvjpeg"),) if n]
    names += ["libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so.11", "libnvjpeg.so"]
    errors = []
    for name in names:
        try:
            _NVJPEG_LIB.append(ctypes.CDLL(name))
            return _NVJPEG_LIB[0]
        except OSError as e:
            errors.append(str(e))
    raise OSError("libnvjpeg not found (install torchvision, or the CUDA toolkit's nvJPEG): "
                  + "; ".join(errors[-2:]))


_END = object()


class _Raised:
    __slots__ = ("exc", "where")

    def __init__(self, exc: BaseException, where: str):
        self.exc, self.where = exc, where


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

    ``overlap``: 2 (default) decodes in one thread and augments in another, each on its own
    stream, so decoding batch k+2, augmenting k+1 and training on k overlap; 1 does both in
    one thread; 0 works inline on the current stream (debugging, measurements).
    ``prefetch`` bounds the batches waiting between stages (GPU memory stays bounded).
    ``max_ahead``: training steps the consumer may queue on the GPU beyond the last one
    finished (None: no limit); see ``_throttle`` for why a limit keeps decoding fast.
    ``backend``: "torchvision" uses ``torchvision.io.decode_jpeg``; "nvjpeg" calls libnvjpeg
    directly (:class:`NvjpegDecoder`, no torchvision needed); "auto" (default) the first
    that is installed; ``self.backend`` says which runs. ``decoder``, if
    given, replaces both: ``(list of 1-D uint8 CPU tensors, device) -> list of (3, h, w)
    uint8 tensors``.
    """

    def __init__(self, loader, *, size=224, train: bool = True,
                 mean: Optional[Sequence[float]] = IMAGENET_MEAN,
                 std: Optional[Sequence[float]] = IMAGENET_STD,
                 dtype: torch.dtype = torch.bfloat16, channels_last: bool = True, device=None,
                 scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: bool = True,
                 crop_fraction: float = 0.875, prefetch: int = 2, overlap: int = 2,
                 seed: Optional[int] = None, backend: str = "auto", max_ahead: Optional[int] = 1,
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
        if backend not in ("auto", "nvjpeg", "torchvision"):
            raise ValueError(f"backend must be 'auto', 'nvjpeg' or 'torchvision', got {backend!r}")
        self.device = _gpu_device(device, decoder is None, backend)
        self.backend = "custom" if decoder is not None else backend
        if decoder is None and backend in ("auto", "torchvision"):
            try:
                import torchvision.io  # noqa: F401
                decoder, self.backend = _nvjpeg, "torchvision"
            except ImportError:
                if backend == "torchvision":
                    raise
        if decoder is None:  # "nvjpeg", or "auto" without torchvision
            decoder = NvjpegDecoder.shared(self.device)
            self.backend = f"nvjpeg-{decoder.backend}"
        self.decoder = decoder
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
        self._streams = [None, None]
        if self.device.type == "cuda":
            self._streams = [torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)]
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
        clock, st = time.perf_counter, self.stats
        ahead: list = []
        if self.overlap == 0:
            while True:
                t0 = clock()
                self._throttle(ahead)
                batch = next(it, _END)
                if batch is _END:
                    return
                t1 = clock()
                item = self._decode(batch)
                t2 = clock()
                out = self._augment(item)
                t3 = clock()
                st.add_time("loader", t1 - t0)
                st.add_time("decode", t2 - t1)
                st.add_time("augment", t3 - t2)
                yield out
        pipe = _Pipeline(self, it)
        try:
            while True:
                t0 = clock()
                self._throttle(ahead)
                item = pipe.get()
                st.add_time("consumer", clock() - t0)
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
        the decode thread (several per image in nvJPEG) then waits about one kernel. The
        event recorded at each request marks the end of the previous step's work.
        """
        if self.max_ahead is None or self.device.type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        ahead.append(ev)
        while len(ahead) > self.max_ahead:
            ahead.pop(0).synchronize()

    def _decode(self, batch):
        """nvJPEG for the encoded images, a copy for CPU-decoded ones; all on self.device."""
        if not isinstance(batch, EncodedBatch):
            raise TypeError(f"GPUDecoder needs batches of EncodedBatch (make_gpu_loader(root), or "
                            f"PackedDataset(decode=EncodedImage()) with collate_fn="
                            f"collate_encoded), got {type(batch).__name__}")
        views = batch.images()
        on_gpu = (~batch.decoded).nonzero().flatten().tolist()
        out: List[Optional[torch.Tensor]] = [None] * len(views)
        if on_gpu:
            try:
                decoded = self.decoder([views[i] for i in on_gpu], self.device)
            except RuntimeError:
                decoded = [self._decode_alone(views[i]) for i in on_gpu]
            for i, im in zip(on_gpu, decoded):
                out[i] = im
            got = torch.tensor([im.shape for im in decoded])
            if not torch.equal(got[:, 1:], batch.sizes[on_gpu]) or bool((got[:, 0] != 3).any()):
                raise RuntimeError("the decoder returned images of other sizes than their JPEG "
                                   "headers say (or not 3 channels)")
        for i, v in enumerate(views):
            if out[i] is None:
                out[i] = v.to(self.device, non_blocking=True).permute(2, 0, 1)
        st = self.stats
        st.gpu, st.cpu, st.batches = st.gpu + len(on_gpu), st.cpu + len(views) - len(on_gpu), st.batches + 1
        return out, batch.sizes, batch.labels.to(self.device, non_blocking=True)

    def _decode_alone(self, data: torch.Tensor) -> torch.Tensor:
        self.stats.retried += 1
        try:
            return self.decoder([data], self.device)[0]
        except RuntimeError:
            im = open_image(ctypes.string_at(data.data_ptr(), data.numel()))
            px = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            return px.view(im.height, im.width, 3).to(self.device).permute(2, 0, 1)

    def _augment(self, item):
        images, sizes, labels = item
        if self.train:
            boxes = random_resized_crop_boxes(sizes, self.scale, self.ratio, generator=self._gen)
            flips = torch.rand(len(images), generator=self._gen) < 0.5 if self.flip else None
        else:
            boxes, flips = center_crop_boxes(sizes, self.size, self.crop_fraction), None
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = torch.empty((len(images), 3, *self.size), dtype=self.dtype, device=self.device,
                          memory_format=fmt)
        return resample_crops(images, boxes, self.size, flips, out=out, scale=self._scale,
                              shift=self._shift, sizes=sizes), labels

    def __repr__(self) -> str:
        return (f"GPUDecoder({self.loader!r}, size={self.size}, train={self.train}, "
                f"dtype={self.dtype}, device={self.device}, overlap={self.overlap}, "
                f"backend={self.backend!r})")


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


class _Pipeline:
    """The decode and augment threads (one for ``overlap=1``), joined by bounded queues.

    Threads hold no reference to the consumer's generator, so an abandoned loop can be
    collected; ``close`` stops them, drains the queues and joins, before the loader's
    iterator may be reused (persistent workers reset the same iterator object).
    """

    def __init__(self, dec: GPUDecoder, it):
        self.stop, self.stats = threading.Event(), dec.stats
        self.out: queue.Queue = queue.Queue(dec.prefetch)
        self.queues = [self.out]
        s_dec, s_aug = dec._streams
        src = lambda: next(it)  # noqa: E731
        if dec.overlap == 1:
            stages = [("decode+augment", src, lambda b: dec._augment(dec._decode(b)), s_dec, self.out)]
        else:
            mid: queue.Queue = queue.Queue(dec.prefetch)
            self.queues.append(mid)

            def handoff(item):  # decoded on s_dec, augmented on s_aug
                (images, sizes, labels), event = item
                if event is not None:
                    s_aug.wait_event(event)
                    for t in images:
                        t.record_stream(s_aug)
                    labels.record_stream(s_aug)
                return dec._augment((images, sizes, labels))
            stages = [("decode", src, dec._decode, s_dec, mid),
                      ("augment", self._getter(mid), handoff, s_aug, self.out)]
        self.threads = [threading.Thread(target=self._run, args=st, daemon=True,
                                         name=f"packer-gpu-{st[0]}") for st in stages]
        for t in self.threads:
            t.start()

    def _getter(self, q):
        def get():
            item = self._get(q)
            if item is _END:
                raise StopIteration
            if isinstance(item, _Raised):
                raise _Forward(item)
            return item
        return get

    def _run(self, where, source, fn, stream, q) -> None:
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                clock, wait = time.perf_counter, "loader" if where.startswith("decode") else None
                while not self.stop.is_set():
                    t0 = clock()
                    try:
                        item = source()
                    except StopIteration:
                        break
                    t1 = clock()
                    res = fn(item)
                    if wait:
                        self.stats.add_time(wait, t1 - t0)
                    self.stats.add_time(where, clock() - t1)
                    event = None
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                    self._put(q, (res, event))
                    del item, res
            self._put(q, _END)
        except _Forward as f:
            self._put(q, f.raised)
        except BaseException as e:  # noqa: B902 - everything reaches the consumer
            self._put(q, _Raised(e, where))

    def _put(self, q, item) -> None:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return
            except queue.Full:
                pass

    def _get(self, q):
        while True:
            try:
                return q.get(timeout=0.05)
            except queue.Empty:
                if self.stop.is_set():
                    return _END

    def get(self):
        item = self._get(self.out)
        if isinstance(item, _Raised):
            exc = item.exc
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in packer's GPU {item.where} thread)")
            raise exc
        return item

    def close(self, timeout: float = 60.0) -> None:
        self.stop.set()
        for t in self.threads:
            waited = 0.0
            while t.is_alive() and waited < timeout:  # a stuck loader leaves a daemon thread
                for q in self.queues:
                    _drain(q)
                t.join(0.05)
                waited += 0.05
        for q in self.queues:
            _drain(q)


class _Forward(Exception):
    def __init__(self, raised: _Raised):
        super().__init__(raised.where)
        self.raised = raised
