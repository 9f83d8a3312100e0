"""Detection on the GPU path: targets packed per batch, boxes moved with the GPU crops.

Workers collate a batch's targets into one :class:`DetectionTargets` (all boxes of the batch
in one tensor, with per-image counts) so they cross to the GPU in a few copies. After the
crop / letterbox of :meth:`GPUDecoder.augment_batch`, :func:`place_boxes` moves the boxes with
the same crop rectangles and flips (``packer.transforms.boxes``), drops the objects mostly cut away and
hands out torchvision's form: one target dict per image, on the GPU.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..transforms.boxes import crop_boxes, letterbox_params
from ..reading.targets import wrap_boxes


class DetectionTargets(NamedTuple):
    """A batch's detection targets, packed: ``boxes`` (N, 4) XYXY pixels of the stored
    images, ``counts`` (B,) boxes per image, per-box ``labels``/``area``/``iscrowd``,
    per-image ``image_id``."""
    boxes: torch.Tensor
    counts: torch.Tensor
    labels: torch.Tensor
    area: torch.Tensor
    iscrowd: torch.Tensor
    image_id: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "DetectionTargets":
        return DetectionTargets(*(t.to(device, non_blocking=non_blocking) for t in self))

    def __len__(self) -> int:  # images, not fields
        return len(self.counts)


def pack_targets(targets: Sequence[Dict]) -> DetectionTargets:
    """Collate per-image detection target dicts (``PackedDataset``'s) into one."""
    cat = lambda k, dt: torch.cat([t[k].as_subclass(torch.Tensor).to(dt) for t in targets])  # noqa: E731
    boxes = cat("boxes", torch.float32).reshape(-1, 4)
    return DetectionTargets(boxes, torch.tensor([len(t["boxes"]) for t in targets]),
                            cat("labels", torch.int64), cat("area", torch.float32),
                            cat("iscrowd", torch.int64),
                            torch.tensor([int(t["image_id"]) for t in targets]))


def is_detection_batch(targets: Sequence) -> bool:
    return bool(targets) and isinstance(targets[0], dict) and "boxes" in targets[0]


def letterbox_crops(sizes: torch.Tensor, size: Tuple[int, int], scale_up: bool = True):
    """The letterbox as a crop reaching past the image (``resample_crops`` then scales by
    ``scale`` and offsets by the padding), and where each image's pixels land:
    ``(crops (B, 4) float64, inside (B, 4) top, left, bottom, right)``."""
    scale, pad, new = letterbox_params(sizes, size, scale_up=scale_up)
    scale = scale.double()
    oh, ow = size
    top, left = pad[:, 0].double(), pad[:, 1].double()
    crops = torch.stack([-left / scale, -top / scale, (ow - left) / scale, (oh - top) / scale], 1)
    inside = torch.stack([pad[:, 0], pad[:, 1], pad[:, 0] + new[:, 0], pad[:, 1] + new[:, 1]], 1)
    return crops, inside


def fill_outside(out: torch.Tensor, inside: torch.Tensor, flips: Optional[torch.Tensor],
                 value: torch.Tensor) -> None:
    """Set the letterbox padding of ``out`` (B, C, H, W) to ``value`` (C,) in place (a
    flipped image's pixels sit mirrored: its padding is too)."""
    b, _, h, w = out.shape
    ins = inside.to(out.device)
    t, l, btm, r = ins.unbind(1)
    if flips is not None:
        f = flips.to(out.device)
        l, r = torch.where(f, w - r, l), torch.where(f, w - l, r)
    rows = torch.arange(h, device=out.device)
    cols = torch.arange(w, device=out.device)
    keep = (((rows[None] >= t[:, None]) & (rows[None] < btm[:, None]))[:, :, None]
            & ((cols[None] >= l[:, None]) & (cols[None] < r[:, None]))[:, None, :])
    out.copy_(torch.where(keep[:, None], out, value.to(out.dtype).view(1, -1, 1, 1)))


def place_boxes(targets: DetectionTargets, crops: torch.Tensor, size: Tuple[int, int],
                flips: Optional[torch.Tensor], min_visible: float) -> List[Dict]:
    """Per-image target dicts for the augmented images (boxes moved, clipped, and dropped
    when less than ``min_visible`` of them stays in view), on the targets' device."""
    dev = targets.boxes.device
    boxes, keep = crop_boxes(targets.boxes, targets.counts, crops.to(dev), size,
                             None if flips is None else flips.to(dev), min_visible=min_visible)
    counts = targets.counts.tolist()  # (waits for the targets' copy: a few hundred bytes)
    ids = targets.image_id.tolist()
    keep_cpu = keep.cpu()
    out = []
    start = 0
    for i, n in enumerate(counts):
        k = keep_cpu[start:start + n]
        sel = torch.nonzero(k).flatten().to(dev) + start
        out.append({"boxes": wrap_boxes(boxes[sel], size), "labels": targets.labels[sel],
                    "image_id": ids[i], "area": targets.area[sel],
                    "iscrowd": targets.iscrowd[sel]})
        start += n
    return out
