"""Detection on the GPU path: a batch's targets packed in one :class:`DetectionTargets`, and
:func:`place_boxes` moving them with the crops of :meth:`GPUDecoder.augment_batch`."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..errors import PackerError
from ..format.fields import PER_OBJECT
from ..transforms.boxes import crop_boxes, image_index, letterbox_params, to_device
from ..reading.targets import wrap_boxes


class DetectionTargets(NamedTuple):
    """A batch's detection targets, packed: ``boxes`` (N, 4) XYXY, ``counts`` (B,),
    ``per_box`` (the other per-object tensors: ``PER_OBJECT``'s), ``per_image`` (every other
    key: one value per image, as the dataset gave it) and ``keys`` (the targets' key order)."""
    boxes: torch.Tensor
    counts: torch.Tensor
    per_box: Dict[str, torch.Tensor]
    per_image: Dict[str, list]
    keys: Tuple[str, ...]

    def to(self, device, non_blocking: bool = False) -> "DetectionTargets":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return self._replace(boxes=move(self.boxes), counts=move(self.counts),
                             per_box={k: move(v) for k, v in self.per_box.items()})

    def __len__(self) -> int:  # images, not fields
        return len(self.counts)


def pack_targets(targets: Sequence[Dict]) -> DetectionTargets:
    """Collate per-image detection target dicts (``PackedDataset``'s) into one. Per-box
    masks cannot follow a GPU crop: a target holding them is refused."""
    if "masks" in targets[0] or "segmentation" in targets[0]:
        raise PackerError("the GPU path moves boxes with its crops but not masks or "
                          "segmentations: build the PackedDataset without them (target_keys)")
    keys = tuple(targets[0])
    cat = lambda k: torch.cat([t[k].as_subclass(torch.Tensor) for t in targets])  # noqa: E731
    per_box = [k for k in keys if k in PER_OBJECT]  # as the CPU path cuts
    return DetectionTargets(cat("boxes").float().reshape(-1, 4),
                            torch.tensor([len(t["boxes"]) for t in targets]),
                            {k: cat(k) for k in per_box},
                            {k: [t[k] for t in targets] for k in keys
                             if k != "boxes" and k not in per_box}, keys)


def is_detection_batch(targets: Sequence) -> bool:
    return bool(targets) and isinstance(targets[0], dict) and "boxes" in targets[0]


def letterbox_crops(sizes: torch.Tensor, size: Tuple[int, int], scale_up: bool = True):
    """The letterbox as a crop reaching past the image, and where each image's pixels land:
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
    _, _, h, w = out.shape
    t, l, btm, r = inside.to(out.device).unbind(1)
    if flips is not None:
        f = flips.to(out.device)
        l, r = torch.where(f, w - r, l), torch.where(f, w - l, r)
    rows = torch.arange(h, device=out.device)
    cols = torch.arange(w, device=out.device)
    keep = (((rows[None] >= t[:, None]) & (rows[None] < btm[:, None]))[:, :, None]
            & ((cols[None] >= l[:, None]) & (cols[None] < r[:, None]))[:, None, :])
    out.copy_(torch.where(keep[:, None], out, value.to(out.dtype).view(1, -1, 1, 1)))


def place_boxes(targets: DetectionTargets, crops: torch.Tensor, size: Tuple[int, int],
                flips: Optional[torch.Tensor], min_visible: float,
                device: torch.device) -> List[Dict]:
    """Per-image target dicts on ``device`` for the augmented images (boxes moved, clipped, and
    dropped when less than ``min_visible`` of them stays in view). ``targets`` on the host: each
    field crosses in one copy, split into per-image views, so a batch costs a fixed number of
    calls under the GIL and no wait (docs/gpu_decode.md)."""
    boxes, keep = crop_boxes(targets.boxes, targets.counts, crops, size, flips,
                             min_visible=min_visible)
    image = image_index(targets.counts, len(keep), keep.device)
    counts = torch.bincount(image[keep], minlength=len(targets.counts)).tolist()
    fields = {"boxes": boxes, **targets.per_box}
    moved = {k: to_device(v[keep], device).split(counts) for k, v in fields.items()}
    moved["boxes"] = [wrap_boxes(b, size) for b in moved["boxes"]]
    moved.update({k: [to_device(v, device) if isinstance(v, torch.Tensor) else v for v in vs]
                  for k, vs in targets.per_image.items()})  # as the dataset gave them
    return [{k: moved[k][i] for k in targets.keys} for i in range(len(targets.counts))]
