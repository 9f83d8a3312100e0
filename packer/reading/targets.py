"""What ``PackedDataset`` returns beside the image, per task: classification's int label,
detection's ``wrap_dataset_for_transforms_v2`` dict (``target_keys``), else a dict of the
fields (or those ``target_fields`` selects)."""
from __future__ import annotations

import sys
from typing import Any, Collection, Dict, List, Optional, Sequence, Union

import torch

from ..errors import FormatError
from ..format.fields import ArrayField, field_of, object_count_problem
from .._util.text import printable

DEFAULT_KEYS = ("boxes", "labels", "image_id")  # torchvision's wrapper's default
DETECTION_KEYS = DEFAULT_KEYS + ("area", "iscrowd")  # what any detection dataset can give
KEY_ORDER = DETECTION_KEYS + ("masks", "segmentation")  # a target's order; COCO adds the last 2
NOT_KEYS = {"bbox": "packer stores 'boxes' (XYXY, clipped to the image) instead",
            "category_id": "'labels' holds the COCO category ids"}
TORCH_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
                "uint16": torch.int32, "int32": torch.int32, "uint32": torch.int64,
                "int64": torch.int64, "float32": torch.float32, "float64": torch.float64}


def array_tensor(f: ArrayField, raw: bytes) -> torch.Tensor:
    """A stored array field as a tensor of its schema's shape (a copy: records are bytes),
    straight from the bytes where torch has the stored dtype (value by value is ~11x slower)."""
    shape, dtype = f.shape_of(len(raw)), TORCH_DTYPES[f.dtype]
    if raw and sys.byteorder == "little" and f.dtype not in ("uint16", "uint32"):
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    return torch.tensor(f.values(raw), dtype=dtype).reshape(shape)


def tv_wrap(kind: str, t: torch.Tensor, **kwargs) -> torch.Tensor:
    """``t`` as ``torchvision.tv_tensors.<kind>`` where torchvision is installed, else as is."""
    try:
        from torchvision import tv_tensors
    except ImportError:  # torchvision is optional: plain tensors then
        return t
    return getattr(tv_tensors, kind)(t, **kwargs)


class TargetMaker:
    """Builds targets from records for one dataset's schema (see the module docstring)."""

    def __init__(self, schema: dict, *, target_fields: Union[None, str, Sequence[str]] = None,
                 target_keys: Union[None, str, Collection[str]] = None, masks: bool = False):
        self.task = schema["task"]
        self.fields = {f["name"]: field_of(f) for f in schema["fields"]}
        if target_fields is not None and target_keys is not None:
            raise ValueError("pass target_keys (the detection target's keys) or target_fields "
                             "(stored fields in place of the target), not both")
        self.single = isinstance(target_fields, str)
        self.names: Optional[List[str]] = [target_fields] if self.single else (
            None if target_fields is None else list(target_fields))
        unknown = [n for n in self.names or () if n not in self.fields]
        if unknown:
            raise ValueError(f"target_fields {unknown} are not fields of this dataset "
                             f"(fields: {', '.join(self.fields) or 'none'})")
        self.keys = self.detection_keys(target_keys, masks) if self.detection else ()
        if target_keys is not None and self.task != "detection":
            raise ValueError(f"target_keys shapes a detection target; this is a {self.task} "
                             f"dataset (select its fields with target_fields)")
        if masks and "segmentation" not in self.fields:
            raise ValueError("masks=True needs a dataset with COCO segmentation "
                             "(built with --coco); this one has none")
        self.masks = "masks" in self.keys
        self.label_only = self.task == "classification" and list(self.fields) == ["label"]

    def detection_keys(self, target_keys, masks: bool) -> tuple:
        """The keys of this dataset's detection targets, in ``KEY_ORDER``."""
        available = [k for k in KEY_ORDER if k not in ("masks", "segmentation")
                     or "segmentation" in self.fields]
        available += [n for n in self.fields if n not in KEY_ORDER + ("label",)]
        if target_keys is None:
            keys = set(DEFAULT_KEYS)
        elif target_keys == "all":
            keys = set(available)
        elif isinstance(target_keys, str):
            raise ValueError(f"target_keys must be 'all' or a collection of keys, got "
                             f"{target_keys!r} (did you mean [{target_keys!r}]?)")
        else:
            keys = set(target_keys)
            extra = sorted(keys - set(available))
            if extra:
                why = "; ".join(f"{k}: {NOT_KEYS[k]}" for k in extra if k in NOT_KEYS)
                raise ValueError(f"target_keys {extra} are not available; this dataset gives "
                                 f"{', '.join(available)}" + (f" ({why})" if why else ""))
        if masks:  # without segmentation, __init__ refuses it
            keys.add("masks")
        return tuple(k for k in available if k in keys)

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
        problem = object_count_problem(self.fields, rec)  # all checked, whatever the keys
        if problem:
            raise ValueError(problem)
        out: Dict[str, Any] = {}
        for key in self.keys:
            if key == "boxes":
                out[key] = wrap_boxes(boxes, (h, w))
            elif key == "masks":
                out[key] = self.masks_of(rec, h, w)
            elif key in ("labels", "area", "iscrowd"):
                dtype = torch.float32 if key == "area" else torch.int64
                out[key] = (array_tensor(self.fields[key], rec[key]).to(dtype)
                            if key in self.fields else torch.zeros(n, dtype=dtype))
            else:
                out[key] = self.value(key, rec[key])
        return out

    def masks_of(self, rec: Dict[str, Any], h: int, w: int):
        from .masks import masks_of
        try:
            m = masks_of(rec["segmentation"], h, w)
        except ValueError as e:
            raise FormatError(f"record {printable(str(rec.get('path')))!s}: its segmentation "
                              f"cannot be made into masks: {e} (limits: docs/security.md)") \
                from None
        return tv_wrap("Mask", m)


def wrap_boxes(boxes: torch.Tensor, canvas_size) -> torch.Tensor:
    """``tv_tensors.BoundingBoxes`` (XYXY) where torchvision is installed, else the tensor."""
    return tv_wrap("BoundingBoxes", boxes, format="XYXY",
                   canvas_size=tuple(int(s) for s in canvas_size))


# EXIF orientation (2-8) as PIL's ``exif_transpose`` applies it: whether x and y swap (the
# image is transposed), then which axes flip (-1: x, -2: y).
ORIENTATIONS = {2: (False, [-1]), 3: (False, [-1, -2]), 4: (False, [-2]), 5: (True, []),
                6: (True, [-1]), 7: (True, [-1, -2]), 8: (True, [-2])}


def oriented(target: Dict[str, Any], orientation: int, width: int, height: int) -> Dict[str, Any]:
    """A detection target of a stored ``width`` x ``height`` image, moved as its image is by
    ``exif_transpose`` for this EXIF orientation: boxes (and ``canvas_size``), masks."""
    if orientation not in ORIENTATIONS:
        return target
    swap, flips = ORIENTATIONS[orientation]
    w, h = (height, width) if swap else (width, height)
    out = dict(target)
    if "boxes" in target:
        x0, y0, x1, y1 = target["boxes"].as_subclass(torch.Tensor).unbind(1)
        if swap:
            x0, y0, x1, y1 = y0, x0, y1, x1
        if -1 in flips:
            x0, x1 = w - x0, w - x1
        if -2 in flips:
            y0, y1 = h - y0, h - y1
        boxes = torch.stack([torch.minimum(x0, x1), torch.minimum(y0, y1),
                             torch.maximum(x0, x1), torch.maximum(y0, y1)], 1)
        out["boxes"] = wrap_boxes(boxes, (h, w))
    if "masks" in target:
        m = target["masks"].as_subclass(torch.Tensor)
        m = m.transpose(-1, -2) if swap else m
        out["masks"] = tv_wrap("Mask", (m.flip(flips) if flips else m).contiguous())
    return out

