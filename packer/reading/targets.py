"""What ``PackedDataset`` returns beside the image: a record's fields, shaped per task.

- classification: the int label (ImageFolder's target);
- detection: the dict torchvision's detection references and
  ``wrap_dataset_for_transforms_v2(CocoDetection(...))`` give — ``boxes`` as
  ``tv_tensors.BoundingBoxes`` (XYXY, ``canvas_size``), ``labels`` int64, ``image_id``,
  ``area``, ``iscrowd`` and, when asked, ``masks`` (``tv_tensors.Mask``) — so
  ``torchvision.transforms.v2`` moves boxes with the image (plain tensors without
  torchvision);
- anything else: a dict of the fields (arrays as tensors, text as str), or the fields that
  ``target_fields`` selects (one name: that value alone).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from ..errors import FormatError
from ..format.fields import ArrayField, field_of
from .._util.text import printable

DETECTION_KEYS = ("boxes", "labels", "image_id", "area", "iscrowd")
TORCH_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
                "uint16": torch.int32, "int32": torch.int32, "uint32": torch.int64,
                "int64": torch.int64, "float32": torch.float32, "float64": torch.float64}


def array_tensor(f: ArrayField, raw: bytes) -> torch.Tensor:
    """A stored array field as a tensor of its schema's shape (a copy: records are bytes)."""
    return torch.tensor(f.values(raw), dtype=TORCH_DTYPES[f.dtype]).reshape(f.shape_of(len(raw)))


def tv_tensors():
    """torchvision's tv_tensors module, or None where torchvision is not installed."""
    try:
        from torchvision import tv_tensors as tv
    except ImportError:  # torchvision is optional: plain tensors then
        return None
    return tv


class TargetMaker:
    """Builds targets from records for one dataset's schema (see the module docstring)."""

    def __init__(self, schema: dict, *, target_fields: Union[None, str, Sequence[str]] = None,
                 masks: bool = False):
        self.task = schema["task"]
        self.fields = {f["name"]: field_of(f) for f in schema["fields"]}
        if isinstance(target_fields, str):
            names: Optional[List[str]] = [target_fields]
        else:
            names = list(target_fields) if target_fields is not None else None
        unknown = [n for n in names or () if n not in self.fields]
        if unknown:
            raise ValueError(f"target_fields {unknown} are not fields of this dataset "
                             f"(fields: {', '.join(self.fields) or 'none'})")
        self.single = isinstance(target_fields, str)
        self.names = names
        if masks and "segmentation" not in self.fields:
            raise ValueError("masks=True needs a dataset with COCO segmentation "
                             "(built with --coco); this one has none")
        self.masks = masks
        self.label_only = self.task == "classification" and list(self.fields) == ["label"]

    @property
    def detection(self) -> bool:
        return self.task == "detection" and self.names is None

    def __call__(self, rec: Dict[str, Any]) -> Any:
        try:
            return self.make(rec)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:  # not its schema
            raise FormatError(f"record {printable(str(rec.get('path')))!s} does not match its "
                              f"dataset's schema ({type(e).__name__}: {e}); the shard is damaged "
                              f"or not from packer (run `packer verify`)") from None

    def make(self, rec: Dict[str, Any]) -> Any:
        if self.names is not None:
            values = {n: self.value(n, rec[n]) for n in self.names}
            return values[self.names[0]] if self.single else values
        if self.label_only:  # ImageFolder's target: the per-sample path stays one lookup
            return rec["label"]
        if self.detection:
            return self.detection_target(rec)
        return {n: self.value(n, rec[n]) for n in self.fields}

    def value(self, name: str, v: Any) -> Any:
        f = self.fields[name]
        return array_tensor(f, v) if isinstance(f, ArrayField) else v

    def detection_target(self, rec: Dict[str, Any]) -> Dict[str, Any]:
        """torchvision's detection target for one record, boxes in the stored image's pixels."""
        h, w = rec["height"], rec["width"]
        boxes = array_tensor(self.fields["boxes"], rec["boxes"])
        n = len(boxes)
        out: Dict[str, Any] = {"boxes": wrap_boxes(boxes, (h, w))}
        out["labels"] = array_tensor(self.fields["labels"], rec["labels"]).to(torch.int64)
        out["image_id"] = rec["image_id"]
        for name, dtype in (("area", torch.float32), ("iscrowd", torch.int64)):
            if name in self.fields:
                out[name] = array_tensor(self.fields[name], rec[name]).to(dtype)
            else:
                out[name] = torch.zeros(n, dtype=dtype)
        for name in ("labels", "area", "iscrowd"):
            if len(out[name]) != n:
                raise ValueError(f"{n} boxes but {len(out[name])} {name}")
        if self.masks:
            from .masks import masks_of
            m = masks_of(rec["segmentation"], h, w)
            tv = tv_tensors()
            out["masks"] = tv.Mask(m) if tv is not None else m
        return out


def wrap_boxes(boxes: torch.Tensor, canvas_size) -> torch.Tensor:
    """``tv_tensors.BoundingBoxes`` (XYXY) where torchvision is installed, else the tensor."""
    tv = tv_tensors()
    if tv is None:
        return boxes
    return tv.BoundingBoxes(boxes, format="XYXY", canvas_size=tuple(int(s) for s in canvas_size))
