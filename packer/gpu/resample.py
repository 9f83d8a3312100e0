"""Crop + antialiased bilinear resize + flip + normalize + dtype of a whole batch
(:func:`resample_crops`): one Triton kernel on CUDA, :func:`reference_resample` (the same
maths in torch) on the CPU. Within one level of PIL's BILINEAR resize of the same pixels."""
from __future__ import annotations

import importlib
import os
from typing import List, Optional, Sequence, Tuple

import torch

from ..errors import PackerError

__all__ = ["ImageTable", "reference_resample", "resample_crops", "triton_available"]

CONFIG = {"rows": 8, "num_warps": 4}  # the kernel's rows per program, warps (docs/gpu_decode.md)

CPU_PATH = ("use the CPU path: PackedDataset(root, decode=DecodeRandomResizedCrop(224)) with "
            "make_loader and CUDAPrefetcher")
TRITON_MISSING = ("GPU decoding needs Triton for its fused augment kernel: pip install triton (it "
                  "comes with PyTorch's CUDA wheels on Linux; pip install 'packer-lmdb[gpu]' names "
                  f"it); without it {CPU_PATH}")


class ImageTable:
    """Decoded uint8 RGB images of one batch, wherever they lie on one device: a ``base``
    tensor and, per image, its offset in bytes from ``base`` and its (channel, row, column)
    strides (``layout``, (B, 4) int64, on the CPU), with ``sizes`` (B, 2) (h, w)."""
    __slots__ = ("base", "layout", "sizes", "_images", "_views")

    def __init__(self, base: torch.Tensor, layout: torch.Tensor, sizes: torch.Tensor,
                 images: Optional[List[torch.Tensor]] = None):
        if base.dtype != torch.uint8:
            raise TypeError(f"ImageTable needs uint8 images, got {base.dtype}")
        self.base, self.layout, self.sizes = base, layout, sizes
        self._images = self._views = images  # separate tensors: they must stay alive

    @classmethod
    def planar(cls, buffer: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor) -> "ImageTable":
        """Image i as planar RGB (3, h, w) at byte ``starts[i]`` of ``buffer`` (nvJPEG's output)."""
        h, w = sizes[:, 0], sizes[:, 1]
        return cls(buffer, torch.stack([starts, h * w, w, torch.ones_like(w)], 1), sizes)

    @classmethod
    def from_images(cls, images: Sequence[torch.Tensor]) -> "ImageTable":
        """(3, h, w) uint8 tensors of any strides (HWC pixels permuted, slices of a buffer)."""
        images = list(images)
        if not images:
            raise ValueError("ImageTable.from_images needs at least one image")
        if {(t.dtype, t.device) for t in images} != {(torch.uint8, images[0].device)}:
            raise TypeError("ImageTable.from_images needs uint8 images on one device, got "
                            f"{sorted({f'{t.dtype} on {t.device}' for t in images})}")
        base = min(images, key=lambda t: t.data_ptr())
        p0 = base.data_ptr()
        layout = torch.tensor([[t.data_ptr() - p0, *t.stride()] for t in images], dtype=torch.int64)
        sizes = torch.tensor([tuple(t.shape[-2:]) for t in images], dtype=torch.int64)
        return cls(base, layout, sizes, images)

    def __len__(self) -> int:
        return len(self.sizes)

    def views(self) -> List[torch.Tensor]:
        """The images as (3, h, w) tensors."""
        if self._views is None:
            so = self.base.storage_offset()
            self._views = [self.base.as_strided((3, h, w), (c, r, x), so + off)
                           for (off, c, r, x), (h, w) in zip(self.layout.tolist(), self.sizes.tolist())]
        return self._views

    def tensors(self) -> List[torch.Tensor]:
        """What must stay alive while a kernel reads the images (for ``record_stream``)."""
        return [self.base] if self._images is None else list(self._images)


def triton_available() -> bool:
    """Whether the fused kernel can run here (Triton importable and set up)."""
    try:
        importlib.import_module("triton.language")
        return True
    except Exception:  # ImportError, or a Triton that fails to set itself up
        return False


def resample_crops(images, boxes: torch.Tensor, size: Tuple[int, int],
                   flips: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
                   scale: Optional[torch.Tensor] = None,
                   shift: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Crop ``boxes`` ((B, 4) x0, y0, x1, y1, may reach outside) out of ``images`` (an
    :class:`ImageTable` or uint8 (3, h, w) tensors), resize to ``size``, flip where ``flips``,
    and write ``x * scale + shift`` into ``out`` (uint8: the rounded pixels). Taps outside an
    image get no weight. CUDA runs the Triton kernel, the CPU :func:`reference_resample`."""
    table = images if isinstance(images, ImageTable) else None
    b, (oh, ow) = len(images), size
    device = boxes.device if not b else (table.base if table else images[0]).device
    if out is None:
        out = torch.empty((b, 3, oh, ow), dtype=torch.float32, device=device)
    if b == 0:
        return out
    if table is None:
        table = ImageTable.from_images(images)
    hw = table.sizes.to("cpu", torch.float64)
    boxes = boxes.to("cpu", torch.float64)
    flips = torch.zeros(b, dtype=torch.bool) if flips is None else flips.to("cpu", torch.bool)
    # Per axis: centre of output pixel i is start + (i + 0.5) * step; filter half-width
    # max(|step|, 1); a flip walks x backwards from the box's right edge.
    x0, y0, x1, y1 = boxes.unbind(1)
    sy, sx = (y1 - y0) / oh, (x1 - x0) / ow
    params = torch.stack([y0, sy, sy.clamp(min=1), hw[:, 0], torch.where(flips, x1, x0),
                          torch.where(flips, -sx, sx), sx.clamp(min=1), hw[:, 1]], 1)
    affine = None
    if out.dtype != torch.uint8:  # (6,): scale then shift per channel
        sc = torch.ones(3) if scale is None else scale.flatten().expand(3)
        sh = torch.zeros(3) if shift is None else shift.flatten().expand(3)
        affine = torch.cat([sc.to(out.device), sh.to(out.device)]).float()
    if out.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return reference_resample(table, params, size, out, affine)
    if not triton_available():
        raise PackerError(TRITON_MISSING)
    return launch_kernel(table, params, size, out, affine)


def launch_kernel(images: ImageTable, params: torch.Tensor, size: Tuple[int, int],
                  out: torch.Tensor, affine: Optional[torch.Tensor]) -> torch.Tensor:
    """The fused kernel over the batch: ``params`` (B, 8) float64 per image (y0, sy, filter
    half-width y, h, x0, sx, filter half-width x, w) as :func:`resample_crops` builds them,
    ``affine`` (6,) float32 scale then shift per channel on ``out``'s device (None: uint8)."""
    import triton

    from .kernel import crop_resize  # imports Triton's compiler: on first use only
    b, (oh, ow) = len(images), size
    p = params.to(torch.float64)
    # One table, one copy: (offset, channel, row, column strides, h, w, y0, sy, fy, x0, sx, fx).
    tab = torch.cat([images.layout.to(torch.float64), images.sizes.to(torch.float64),
                     p[:, 0:3], p[:, 4:7]], 1).contiguous()
    dev = out.device
    if dev.type == "cuda":  # pinned, so the copy does not wait for the stream's queued work
        tab = tab.pin_memory().to(dev, non_blocking=True)
    if affine is None:
        affine = torch.zeros(6, dtype=torch.float32, device=dev)
    rows, cols = CONFIG["rows"], min(256, triton.next_power_of_2(ow))
    grid = (b, triton.cdiv(oh, rows), triton.cdiv(ow, cols))
    crop_resize[grid](images.base, tab, out, affine, *out.stride(), oh, ow,
                      UINT8=out.dtype == torch.uint8, BI=rows, BJ=cols,
                      num_warps=CONFIG["num_warps"])
    return out


def reference_resample(images: ImageTable, params: torch.Tensor, size: Tuple[int, int],
                       out: torch.Tensor, affine: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel's maths in plain torch, image by image (``Wy @ image @ Wx^T``, the filter
    being separable), for images on the CPU; arguments as :func:`launch_kernel`'s."""
    oh, ow = size
    for k, (im, p) in enumerate(zip(images.views(), params.tolist())):
        wy = _filter(p[0], p[1], p[2], oh, im.shape[1])
        wx = _filter(p[4], p[5], p[6], ow, im.shape[2])
        o = wy @ im.to(torch.float32) @ wx.T  # (3, oh, ow)
        if affine is None:
            out[k] = o.add_(0.5).floor_().clamp_(0, 255)
        else:
            out[k] = o * affine[:3, None, None] + affine[3:, None, None]
    return out


def _filter(start: float, step: float, half: float, n_out: int, n_in: int) -> torch.Tensor:
    """(n_out, n_in) float32: PIL's triangle filter for each output pixel over the input
    pixels, each row divided by its sum (a row with no pixel inside stays 0)."""
    centre = start + (torch.arange(n_out, dtype=torch.float64) + 0.5) * step
    pos = torch.arange(n_in, dtype=torch.float64) + 0.5
    w = (1 - (pos[None, :] - centre[:, None]).abs() / half).clamp_(min=0)
    return (w / w.sum(1, keepdim=True).clamp_(min=1e-12)).float()
