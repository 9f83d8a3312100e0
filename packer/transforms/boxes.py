"""Box maths for detection augmentation: object boxes that move with the images.

The GPU decoder crops and resizes whole batches (:func:`~packer.gpu.resample.resample_crops`)
and a YOLO-style loader letterboxes them; the boxes of every image must follow without a
Python loop per box. Boxes are XYXY in pixels (continuous coordinates: pixel ``j`` spans
``[j, j + 1)``, the convention of the resizers), stored as one ``(N, 4)`` tensor for the
whole batch plus ``counts`` ``(B,)``, the number of boxes of each image, in order
(:func:`boxes_to_tensor` / :func:`split_boxes` convert from and to per-image lists).
Functions that drop boxes return a ``keep`` mask of the fixed shape ``(N,)`` instead of a
ragged result, so nothing waits for the GPU; :func:`select_boxes` applies it.

The maths runs in float64 (float32 on MPS, which has no float64) whatever the boxes'
dtype, and results come back in the boxes' dtype and device.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = ["boxes_to_tensor", "crop_boxes", "letterbox", "letterbox_boxes", "letterbox_params",
           "select_boxes", "split_boxes"]

Size = Tuple[int, int]


# -- crop + resize + flip -------------------------------------------------------------------

def crop_boxes(boxes: torch.Tensor, counts: torch.Tensor, crops: torch.Tensor, size: Size,
               flips: Optional[torch.Tensor] = None, *,
               min_visible: float = 0.25) -> Tuple[torch.Tensor, torch.Tensor]:
    """Boxes of the images after ``resample_crops(images, crops, size, flips)``.

    ``boxes`` (N, 4) XYXY source pixels of all images concatenated, ``counts`` (B,) boxes
    per image, ``crops`` (B, 4) ``(x0, y0, x1, y1)`` source pixels (as from
    ``random_resized_crop_boxes``), ``size`` (oh, ow), ``flips`` bool (B,) or None.
    Each box is shifted by its crop's origin, scaled by ``ow / (x1 - x0)``,
    ``oh / (y1 - y0)``, mirrored (``x' = ow - x``) where flipped and clipped to the output.

    Returns ``(out, keep)``: ``out`` (N, 4) the clipped boxes of *all* inputs, in output
    pixels; ``keep`` (N,) bool, true where the clipped area is positive and at least
    ``min_visible`` times the area of the box mapped before clipping: a box mostly cut
    away no longer shows its object. Fixed shapes, so nothing syncs with the GPU;
    ``select_boxes(out, counts, keep)`` drops the rest (and ``labels[keep]`` their labels).
    """
    oh, ow = size
    dev, work = boxes.device, _work_dtype(boxes.device)
    cwork = _work_dtype(crops.device)
    c = crops.to(cwork)
    # tensor / tensor: ``number / tensor`` multiplies by a reciprocal, 1 ulp off Python's.
    sx, sy = (c.new_tensor([ow, oh]) / (c[:, 2:] - c[:, :2])).unbind(1)
    if flips is None:
        flips = torch.zeros(len(c), dtype=torch.bool, device=c.device)
    flips = flips.to(c.device, torch.bool)
    # Per image: x' = ax * x + bx, y' = sy * y + by (ax < 0 where flipped).
    ax = torch.where(flips, -sx, sx)
    bx = torch.where(flips, ow + c[:, 0] * sx, -c[:, 0] * sx)
    aff = torch.stack([ax, bx, sy, -c[:, 1] * sy, flips.to(cwork)], 1)
    a = _to(aff.to(work), dev)[_image_index(counts, len(boxes), dev)]        # (N, 5)
    b = boxes.to(work)
    xs = b[:, 0::2] * a[:, 0:1] + a[:, 1:2]                                   # (N, 2)
    ys = b[:, 1::2] * a[:, 2:3] + a[:, 3:4]
    xs = torch.where(a[:, 4:5] > 0, xs.flip(1), xs)  # mirrored: the right edge becomes x0
    order = lambda x, y: torch.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], 1)  # noqa: E731
    clipped = order(xs.clamp(0, ow), ys.clamp(0, oh))
    area, seen = _area(order(xs, ys)), _area(clipped)
    keep = (seen > 0) & (seen >= min_visible * area)
    return clipped.to(boxes.dtype), keep


def select_boxes(boxes: torch.Tensor, counts: torch.Tensor,
                 keep: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(boxes[keep], new_counts)``: the boxes :func:`crop_boxes` keeps and how many each
    image still has. Ragged, so on the GPU this waits for ``keep``: do it once, late."""
    dev = boxes.device
    idx = _image_index(counts, len(boxes), dev)
    keep = keep.to(dev)
    new = torch.zeros(len(counts), dtype=torch.long, device=dev)
    new.index_add_(0, idx, keep.long())
    return boxes[keep], new


# -- letterbox (YOLO) -----------------------------------------------------------------------

def letterbox_params(sizes: torch.Tensor, size: Size, *,
                     scale_up: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ultralytics' ``LetterBox`` geometry for images of ``sizes`` (B, 2) (h, w) into
    ``size`` (oh, ow): ``(scale (B,), pad (B, 2) top/left, new_hw (B, 2))``.

    ``scale = min(oh / h, ow / w)`` (at most 1 unless ``scale_up``: shrink only, as for
    evaluation); the image is resized to ``new_hw = round(h * scale), round(w * scale)``
    (round half to even, Python's ``round``; at least 1) and placed at
    ``top = (oh - new_h) // 2``, ``left = (ow - new_w) // 2``: the odd pixel of padding goes
    bottom / right, what ultralytics' ``round(d / 2 -/+ 0.1)`` gives. Boxes scale by
    ``scale``, as ultralytics' labels do, not by ``new / old`` (they differ by under half a
    pixel at the far edge)."""
    oh, ow = size
    hw = sizes.to(_work_dtype(sizes.device)).reshape(-1, 2)
    ratio = hw.new_tensor([oh, ow]) / hw  # not ``oh / hw``: see crop_boxes
    scale = torch.minimum(ratio[:, 0], ratio[:, 1])
    if not scale_up:
        scale = scale.clamp(max=1.0)
    new = torch.round(hw * scale[:, None]).long().clamp_(min=1)
    return scale, torch.div(new.new_tensor([oh, ow]) - new, 2, rounding_mode="floor"), new


def letterbox_boxes(boxes: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor,
                    pad: torch.Tensor) -> torch.Tensor:
    """Boxes (N, 4) XYXY source pixels, ``counts`` (B,), into the letterboxed images of
    :func:`letterbox_params` / :func:`letterbox`: ``x * scale + left``, ``y * scale + top``.
    Nothing is cut, so nothing is dropped or clipped."""
    dev, work = boxes.device, _work_dtype(boxes.device)
    idx = _image_index(counts, len(boxes), dev)
    s = _to(scale.to(work), dev)[idx][:, None]
    p = _to(pad.to(work), dev)[idx]                                           # (N, 2) top, left
    off = torch.stack([p[:, 1], p[:, 0], p[:, 1], p[:, 0]], 1)
    return (boxes.to(work) * s + off).to(boxes.dtype)


def letterbox(images: Sequence[torch.Tensor], size: Size, *,
              fill: Union[int, Sequence[int]] = 114,
              scale_up: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Letterbox uint8 (C, h, w) ``images`` (any sizes and strides, one device) into one
    ``(B, C, oh, ow)`` uint8 batch: each resized keeping its aspect (bilinear, antialiased
    when shrinking, as PIL's BILINEAR: ``interpolate(antialias=True)`` in float32, rounded)
    and centred on a canvas of ``fill`` (a grey level or one value per channel).

    Returns ``(batch, scale, pad)`` (scale and pad on the images' device) for
    :func:`letterbox_boxes`. One resize per image: sizes differ, so they cannot batch."""
    oh, ow = size
    b = len(images)
    device = images[0].device if b else torch.device("cpu")
    ch = images[0].shape[0] if b else 3
    sizes = torch.tensor([tuple(im.shape[-2:]) for im in images], dtype=torch.long).reshape(-1, 2)
    scale, pad, new = letterbox_params(sizes, size, scale_up=scale_up)
    out = torch.empty((b, ch, oh, ow), dtype=torch.uint8, device=device)
    out[:] = torch.as_tensor(fill, dtype=torch.uint8).reshape(-1, 1, 1).to(device)
    for i, (im, (top, left), (nh, nw)) in enumerate(zip(images, pad.tolist(), new.tolist())):
        if tuple(im.shape[-2:]) == (nh, nw):
            out[i, :, top:top + nh, left:left + nw] = im
            continue
        x = F.interpolate(im[None].float(), size=(nh, nw), mode="bilinear", align_corners=False,
                          antialias=True)
        out[i, :, top:top + nh, left:left + nw] = x[0].round_().clamp_(0, 255)
    return out, scale.to(_work_dtype(device)).to(device), pad.to(device)


# -- per-image lists <-> one tensor ---------------------------------------------------------

def boxes_to_tensor(boxes: Sequence, *, dtype: Optional[torch.dtype] = None,
                    device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-image (n_i, 4) boxes (tensors, arrays or lists; n_i may be 0) to
    ``(boxes (N, 4), counts (B,) int64)``, the layout the functions here take.
    ``dtype`` defaults to the first input's if floating, else float32; ``device`` to the
    first input's."""
    parts = [torch.as_tensor(b).reshape(-1, 4) for b in boxes]
    if dtype is None:
        dtype = parts[0].dtype if parts and parts[0].is_floating_point() else torch.float32
    if device is None:
        device = parts[0].device if parts else torch.device("cpu")
    counts = torch.tensor([len(p) for p in parts], dtype=torch.long).to(device)
    if not parts:
        return torch.zeros((0, 4), dtype=dtype, device=device), counts
    return torch.cat([p.to(device, dtype) for p in parts]), counts


def split_boxes(boxes: torch.Tensor, counts: torch.Tensor) -> List[torch.Tensor]:
    """The inverse of :func:`boxes_to_tensor`: per-image (n_i, 4) views of ``boxes``."""
    sizes = counts.tolist()
    return list(torch.split(boxes, sizes)) if sizes else []


# -- helpers --------------------------------------------------------------------------------

def _work_dtype(device: torch.device) -> torch.dtype:
    """float64 for sub-1e-4 px results on large images; MPS has only float32."""
    return torch.float32 if device.type == "mps" else torch.float64


def _area(b: torch.Tensor) -> torch.Tensor:
    return (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)


def _image_index(counts: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """(n,) image of each box. ``output_size`` keeps a GPU ``counts`` from syncing; host
    counts (free to read) are checked against ``n``."""
    if counts.device.type == "cpu" and int(counts.sum()) != n:
        raise ValueError(f"counts sum to {int(counts.sum())} but there are {n} boxes")
    counts = _to(counts, device)
    rows = torch.arange(len(counts), device=device)
    return torch.repeat_interleave(rows, counts, output_size=n)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor to ``device`` without waiting for the GPU's queued work (a copy
    from pageable memory would block until the stream catches up)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
