"""Crop boxes for a batch at once: torchvision's RandomResizedCrop and Resize + CenterCrop
maths (CPU, float64), the same boxes as the CPU decoders' ``box()``; the pixels are then cut
out and resized by :func:`packer.gpu.resample.resample_crops`."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..transforms.decode import DecodeCenterCrop

__all__ = ["center_crop_boxes", "center_crop_inside", "random_resized_crop_boxes"]


def random_resized_crop_boxes(sizes: torch.Tensor, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), *,
                              generator: Optional[torch.Generator] = None,
                              tries: int = 10) -> torch.Tensor:
    """RandomResizedCrop boxes ``(x0, y0, x1, y1)`` for images of ``sizes`` (B, 2): torchvision's
    rule, as ``DecodeRandomResizedCrop.box``, for a batch at once."""
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
    """Evaluation boxes with torchvision's ``Resize + CenterCrop`` geometry, as
    ``DecodeCenterCrop.box`` gives them (one rule for the CPU and GPU paths)."""
    crop = DecodeCenterCrop(size, crop_fraction)
    return torch.tensor([crop.box(w, h) for h, w in sizes.tolist()], dtype=torch.float64)


def center_crop_inside(sizes: torch.Tensor, size: Tuple[int, int],
                       crop_fraction: float = 0.875) -> Optional[torch.Tensor]:
    """Where each image's pixels land in its center crop, ``(B, 4)`` top, left, bottom,
    right, when some crop reaches past its image (CenterCrop pads there, with zeros); else
    None. The resampling kernel's edge pixels would take image pixels in the padding."""
    crop, (oh, ow) = DecodeCenterCrop(size, crop_fraction), size
    inside = [(max(0, -top), max(0, -left), min(oh, rh - top), min(ow, rw - left))
              for rw, rh, left, top in (crop.geometry(w, h) for h, w in sizes.tolist())]
    if all(box == (0, 0, oh, ow) for box in inside):
        return None
    return torch.tensor(inside, dtype=torch.int64)
