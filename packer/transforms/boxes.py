"""Box maths for detection augmentation: XYXY pixel boxes of a whole batch, ``(N, 4)`` plus
per-image ``counts``, that follow crops and resizes without a Python loop per box. The
maths runs in float64 (float32 on MPS); results keep the boxes' dtype and device."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["crop_boxes", "image_index", "letterbox_params", "to_device"]

Size = Tuple[int, int]


def crop_boxes(boxes: torch.Tensor, counts: torch.Tensor, crops: torch.Tensor, size: Size,
               flips: Optional[torch.Tensor] = None, *,
               min_visible: float = 0.25) -> Tuple[torch.Tensor, torch.Tensor]:
    """Boxes (N, 4) XYXY, ``counts`` (B,) per image, after ``resample_crops(images, crops, size,
    flips)``. Returns ``(out, keep)``: the boxes clipped to the output, and where at least
    ``min_visible`` of a box is still in view. Fixed shapes, so nothing syncs with the GPU."""
    oh, ow = size
    dev, work = boxes.device, _work_dtype(boxes.device)
    c = crops.to(_work_dtype(crops.device))
    # tensor / tensor: ``number / tensor`` multiplies by a reciprocal, 1 ulp off Python's.
    sx, sy = (c.new_tensor([ow, oh]) / (c[:, 2:] - c[:, :2])).unbind(1)
    if flips is None:
        flips = torch.zeros(len(c), dtype=torch.bool, device=c.device)
    flips = flips.to(c.device, torch.bool)
    # Per image: x' = ax * x + bx, y' = sy * y + by (ax < 0 where flipped).
    ax = torch.where(flips, -sx, sx)
    bx = torch.where(flips, ow + c[:, 0] * sx, -c[:, 0] * sx)
    aff = torch.stack([ax, bx, sy, -c[:, 1] * sy, flips.to(c.dtype)], 1)
    a = to_device(aff.to(work), dev)[image_index(counts, len(boxes), dev)]   # (N, 5)
    b = boxes.to(work)
    xs = b[:, 0::2] * a[:, 0:1] + a[:, 1:2]                                   # (N, 2)
    ys = b[:, 1::2] * a[:, 2:3] + a[:, 3:4]
    xs = torch.where(a[:, 4:5] > 0, xs.flip(1), xs)  # mirrored: the right edge becomes x0
    order = lambda x, y: torch.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], 1)  # noqa: E731
    clipped = order(xs.clamp(0, ow), ys.clamp(0, oh))
    area, seen = _area(order(xs, ys)), _area(clipped)
    keep = (seen > 0) & (seen >= min_visible * area)
    return clipped.to(boxes.dtype), keep


def letterbox_params(sizes: torch.Tensor, size: Size, *,
                     scale_up: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ultralytics' ``LetterBox`` geometry of ``sizes`` (B, 2) into ``size``: ``(scale (B,),
    pad (B, 2) top/left, new_hw (B, 2))``; never up unless ``scale_up``; odd padding pixel
    bottom/right; boxes scale by ``scale``, as ultralytics' labels do."""
    oh, ow = size
    hw = sizes.to(_work_dtype(sizes.device)).reshape(-1, 2)
    ratio = hw.new_tensor([oh, ow]) / hw  # not ``oh / hw``: see crop_boxes
    scale = torch.minimum(ratio[:, 0], ratio[:, 1])
    if not scale_up:
        scale = scale.clamp(max=1.0)
    new = torch.round(hw * scale[:, None]).long().clamp_(min=1)
    return scale, torch.div(new.new_tensor([oh, ow]) - new, 2, rounding_mode="floor"), new


def _work_dtype(device: torch.device) -> torch.dtype:
    """float64 for sub-1e-4 px results on large images; MPS has only float32."""
    return torch.float32 if device.type == "mps" else torch.float64


def _area(b: torch.Tensor) -> torch.Tensor:
    return (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)


def image_index(counts: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """(n,) image of each box. ``output_size`` keeps a GPU ``counts`` from syncing; host
    counts (free to read) are checked against ``n``."""
    if counts.device.type == "cpu" and int(counts.sum()) != n:
        raise ValueError(f"counts sum to {int(counts.sum())} but there are {n} boxes")
    counts = to_device(counts, device)
    rows = torch.arange(len(counts), device=device)
    return torch.repeat_interleave(rows, counts, output_size=n)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor to ``device`` without waiting for the GPU's queued work (a copy
    from pageable memory would block until the stream catches up)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
