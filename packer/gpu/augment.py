"""GPU augmentation maths for ``packer.gpu``: crop boxes (torchvision's
RandomResizedCrop / CenterCrop maths, vectorised) and :func:`resample_crops` (crop +
antialiased bilinear resize + flip of a whole batch as two batched matmuls).
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional, Tuple

import torch

__all__ = ["PaddedBatch", "center_crop_boxes", "plan_groups", "random_resized_crop_boxes",
           "resample_crops"]

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

def resample_crops(images, boxes: torch.Tensor, size: Tuple[int, int],
                   flips: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
                   scale: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None,
                   sizes: Optional[torch.Tensor] = None, budget: int = 512 << 20,
                   method: str = "auto") -> torch.Tensor:
    """Crop ``boxes`` out of ``images`` (uint8 (3, h, w), any sizes and strides, one device:
    a list, a :class:`PaddedBatch` or an :class:`~packer.gpu.resample.ImageTable`), resize
    each to ``size`` (h, w), flip where ``flips``, write ``x * scale + shift``.

    The filter is PIL's BILINEAR with a box (triangle, support widened by the downscale
    factor, so antialiased), the one the CPU decoders use: outputs match PIL to rounding.
    ``method``: "triton" runs the fused kernel (:mod:`packer.gpu.resample`: one launch per
    batch, images read where they lie); "matmul" does the filter, being separable, as two
    matrix products per image, ``Wy @ image @ Wx^T``, two batched matmuls (float16 on the
    GPU, float32 on the CPU) over images zero-padded to a common size with nested tensors,
    in groups of similar size and orientation so padding stays under ``budget`` bytes
    (:func:`plan_groups`; a :class:`PaddedBatch` arrives padded already), flipping by
    walking ``Wx`` backwards; "auto" is "triton" on a CUDA device where Triton imports.
    ``sizes`` ((B, 2) h, w) saves reading the shapes. ``out`` (default float32) may be any
    dtype and memory format; for uint8 the result is rounded, scale/shift unused.
    """
    from .resample import ImageTable, fused_resample, triton_available
    if method not in ("auto", "triton", "matmul"):
        raise ValueError(f"method must be 'auto', 'triton' or 'matmul', got {method!r}")
    b = len(images)
    oh, ow = size
    table = isinstance(images, ImageTable)
    device = boxes.device if not b else (images.base if table else images.groups[0] if
                                         isinstance(images, PaddedBatch) else images[0]).device
    if out is None:
        out = torch.empty((b, 3, oh, ow), dtype=torch.float32, device=device)
    if b == 0:
        return out
    if method == "auto":
        method = "triton" if device.type == "cuda" and triton_available() else "matmul"
    if table:
        sizes = images.sizes if sizes is None else sizes
        if method == "matmul":
            images = images.views()
    cdt = torch.float16 if device.type == "cuda" else torch.float32
    if sizes is None and isinstance(images, PaddedBatch):
        raise ValueError("resample_crops needs sizes= with a PaddedBatch")
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
    uint8 = out.dtype == torch.uint8
    if method == "triton":
        if not table:
            images = ImageTable.from_images(images.slices(sizes) if isinstance(images, PaddedBatch)
                                            else images)
        affine = None
        if not uint8:  # (6,): scale then shift per channel
            sc = torch.ones(3) if scale is None else scale.flatten().expand(3)
            sh = torch.zeros(3) if shift is None else shift.flatten().expand(3)
            affine = torch.cat([sc.to(device), sh.to(device)]).float()
        return fused_resample(images, params, size, out, affine)
    return _matmul_resample(images, _to(params.float(), device), sizes, size, out, scale, shift,
                            budget, cdt)


def _matmul_resample(images, params, sizes, size, out, scale, shift, budget, cdt):
    """The "matmul" method of :func:`resample_crops`: two batched matmuls per group."""
    b, (oh, ow), device = len(images), size, out.device
    uint8 = out.dtype == torch.uint8
    padded = isinstance(images, PaddedBatch)
    if padded:  # decoded straight into padded groups (NvjpegDecoder.decode_padded)
        chunks = images.index
    else:
        chunks = plan_groups(sizes, budget, 2 if cdt == torch.float16 else 4)
    whole = len(chunks) == 1 and chunks[0] == list(range(b))
    if not uint8:
        scale = torch.ones(1, 3, 1, 1, device=device) if scale is None else scale
        shift = torch.zeros(1, 3, 1, 1, device=device) if shift is None else shift
    for g, idx in enumerate(chunks):
        n = len(idx)
        x = images.groups[g].to(cdt) if padded else _pad([images[i] for i in idx], cdt)  # (n, 3, hc, wc)
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


class PaddedBatch:
    """A batch decoded straight into padded groups: ``groups[g]`` is ``(k, 3, H, W)`` uint8
    holding the images ``index[g]`` (batch positions) top-left, anything in the padding
    (it gets zero weight). The groups are :func:`plan_groups`'s, so :func:`resample_crops`
    uses them as they are: no nested tensor, no copy."""
    __slots__ = ("groups", "index")

    def __init__(self, groups: List[torch.Tensor], index: List[List[int]]):
        self.groups, self.index = groups, index

    def __len__(self) -> int:
        return sum(len(i) for i in self.index)

    def tensors(self) -> List[torch.Tensor]:
        return self.groups

    def slices(self, sizes: torch.Tensor) -> List[torch.Tensor]:
        """The images in batch order as (3, h, w) views of their groups."""
        out: List[Optional[torch.Tensor]] = [None] * len(self)
        hw = sizes.tolist()
        for group, idx in zip(self.groups, self.index):
            for k, i in enumerate(idx):
                out[i] = group[k, :, :hw[i][0], :hw[i][1]]
        return out


def plan_groups(sizes: torch.Tensor, budget: int = 512 << 20, el: int = 2) -> List[List[int]]:
    """Batch positions grouped for padding: greedy in (orientation, area) order, so portrait
    and landscape images do not pad each other to a square, each group's padded
    ``(k, 3, H8, W8)`` tensor of ``el``-byte elements under ``budget`` bytes. One group
    (the common case) keeps the batch order."""
    h_l, w_l = sizes[:, 0].tolist(), sizes[:, 1].tolist()
    b = len(h_l)
    order = sorted(range(b), key=lambda i: (h_l[i] > w_l[i], h_l[i] * w_l[i]), reverse=True)
    chunks, cur, mh, mw = [], [], 0, 0
    for i in order:
        nh, nw = max(mh, h_l[i]), max(mw, w_l[i])
        if cur and (len(cur) + 1) * 3 * _up8(nh) * _up8(nw) * el > budget:
            chunks.append(cur)
            cur, nh, nw = [], h_l[i], w_l[i]
        cur.append(i)
        mh, mw = nh, nw
    chunks.append(cur)
    return [list(range(b))] if len(chunks) == 1 else chunks


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
