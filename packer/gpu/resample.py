"""The fused GPU augment: crop + antialiased bilinear resize + flip + normalize + dtype of a
whole batch in ONE Triton kernel that reads every decoded image where it lies.

The matmul form (:func:`packer.gpu.augment.resample_crops` with ``method="matmul"``) needs
images zero-padded to a common size, dense weight matrices and some twenty launches per
group, and its GPU time (3.9 ms per batch of 256 stored-size images on an H200, against
0.38 ms here) is taken from the training step it runs beside. Here the batch is described by an :class:`ImageTable` (a
base tensor, and per image a byte offset and strides), so nvJPEG's flat output, a list of
tensors or CPU-decoded HWC pixels all work without a copy; each program computes a tile of
output rows of one image, filtering the source rows it needs horizontally and accumulating
them vertically, all in registers. Triton comes with PyTorch's CUDA wheels; without it
packer uses the matmul form.
"""
from __future__ import annotations

import importlib
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["ImageTable", "fused_resample", "triton_available"]

# Output rows per program and warps. Measured on an H200 (packer.bench.gpu, section 3a),
# GPU time per batch of 256 stored-size images: 8 rows/4 warps 0.38 ms, 4/4 0.34-0.35, 8/2
# 0.45, 16/8 0.53, 16/4 0.61, 32/8 0.96 (the pipeline and training rows ran with 8/4).
CONFIG = {"rows": 8, "num_warps": 4}


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
        """(3, h, w) uint8 tensors of any strides (HWC pixels permuted, padded groups' slices)."""
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
        """The images as (3, h, w) tensors (for the matmul form and for tests)."""
        if self._views is None:
            so = self.base.storage_offset()
            self._views = [self.base.as_strided((3, h, w), (c, r, x), so + off)
                           for (off, c, r, x), (h, w) in zip(self.layout.tolist(), self.sizes.tolist())]
        return self._views

    def tensors(self) -> List[torch.Tensor]:
        """What must stay alive while a kernel reads the images (for ``record_stream``)."""
        return [self.base] if self._images is None else list(self._images)


_TRITON: list = []


def triton_available() -> bool:
    """Whether the fused kernel can run (Triton importable); cached."""
    if not _TRITON:
        try:
            importlib.import_module("triton.language")
            _TRITON.append(True)
        except Exception:  # ImportError, or a Triton that fails to set itself up
            _TRITON.append(False)
    return _TRITON[0]


def fused_resample(images: ImageTable, params: torch.Tensor, size: Tuple[int, int],
                   out: torch.Tensor, affine: Optional[torch.Tensor]) -> torch.Tensor:
    """Run the kernel: ``params`` (B, 8) per image (y0, sy, filter scale y, h, x0, sx, filter
    scale x, w) as :func:`~packer.gpu.augment.resample_crops` builds them (CPU, float64),
    ``affine`` (6,) float32 scale then shift per channel on ``out``'s device (None for uint8)."""
    import triton
    b = len(images)
    oh, ow = size
    if b == 0:
        return out
    p = params.to(torch.float64)
    # One table, one copy: (offset, channel, row, column strides, h, w, y0, sy, fy, x0, sx, fx).
    tab = torch.cat([images.layout.to(torch.float64), images.sizes.to(torch.float64),
                     p[:, 0:3], p[:, 4:7]], 1).contiguous()
    dev = out.device
    if dev.type == "cuda":
        tab = tab.pin_memory().to(dev, non_blocking=True)
    if affine is None:
        affine = torch.zeros(6, dtype=torch.float32, device=dev)
    rows, cols = CONFIG["rows"], min(256, triton.next_power_of_2(ow))
    grid = (b, triton.cdiv(oh, rows), triton.cdiv(ow, cols))
    from .kernel import crop_resize
    crop_resize[grid](images.base, tab, out, affine, *out.stride(), oh, ow,
                    UINT8=out.dtype == torch.uint8, BI=rows, BJ=cols,
                    num_warps=CONFIG["num_warps"])
    return out
