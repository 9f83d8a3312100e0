"""nvJPEG decoders: :class:`NvjpegDecoder` (libnvjpeg through ctypes, the default) and
torchvision's batched ``decode_jpeg`` (``torchvision_decode``)."""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import List, Optional, Tuple

import torch

from ..errors import FormatError
from .resample import ImageTable

__all__ = ["NvjpegDecoder", "load_nvjpeg", "torchvision_decode"]


def torchvision_decode(datas: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    """torchvision's batched nvJPEG decode (the ``backend="torchvision"`` decoder)."""
    from torchvision.io import ImageReadMode, decode_jpeg
    return decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)


class _Image(ctypes.Structure):  # nvjpegImage_t (nvJPEG >= 11: size_t pitches)
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


class NvjpegDecoder:
    """nvJPEG's batched decoder called directly (ctypes): torchvision's pixels, but one output
    allocation per batch and one handle per decode thread, on a stream of ``priority``.
    Raises OSError/RuntimeError when libnvjpeg cannot be set up. Handles are never freed, so
    :meth:`shared` gives one instance per (device, slot)."""
    _shared: dict = {}

    @classmethod
    def shared(cls, device: torch.device, slot: int = 0) -> "NvjpegDecoder":
        if (device, slot) not in cls._shared:
            cls._shared[device, slot] = cls(device)
        return cls._shared[device, slot]

    def __init__(self, device: torch.device, *, hardware: bool = True, priority: Optional[int] = None):
        self.lib = lib = load_nvjpeg()
        vp, pp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        lib.nvjpegCreateEx.argtypes = [ctypes.c_int, vp, vp, ctypes.c_uint, pp]
        lib.nvjpegJpegStateCreate.argtypes = [vp, pp]
        lib.nvjpegDecodeBatchedInitialize.argtypes = [vp, vp, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.nvjpegDecodeBatched.argtypes = [vp, vp, pp, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(_Image), vp]  # as (n, 8) int64 tables
        ip = ctypes.POINTER(ctypes.c_int)
        # The header read (~1 µs, one per image) keeps the GIL (PyDLL): releasing it would
        # mean waiting to get it back from the other threads once per image.
        self._info = ctypes.PyDLL(lib._name).nvjpegGetImageInfo
        self._info.argtypes = [vp, vp, ctypes.c_size_t, ip, ip, ip, ip]
        self.handle, self.state = vp(), vp()
        self.backend = "hardware"
        status = lib.nvjpegCreateEx(3, None, None, 0, ctypes.byref(self.handle)) if hardware else -1
        if status != 0:  # no hardware engine (status 8: arch mismatch): nvJPEG picks a backend
            self.backend = "default"
            status = lib.nvjpegCreateEx(0, None, None, 0, ctypes.byref(self.handle))
        _check(status, "nvjpegCreateEx")
        _check(lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "nvjpegJpegStateCreate")
        if priority is None:
            priority = torch.cuda.Stream.priority_range()[1]  # the highest
        self.device = device
        self.stream = torch.cuda.Stream(device, priority=priority)
        self._batch = 0
        self._lock = threading.Lock()
        self._w, self._h = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()  # reused by _size
        self._comps, self._sub = ctypes.byref(ctypes.c_int()), ctypes.byref(ctypes.c_int())

    def __call__(self, datas: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
        """Decode 1-D uint8 CPU tensors of JPEG bytes to (3, h, w) uint8 tensors on ``device``."""
        if not datas:
            return []
        ptrs = torch.tensor([d.data_ptr() for d in datas], dtype=torch.int64)
        lens = torch.tensor([d.numel() for d in datas], dtype=torch.int64)
        with self._lock:
            return self._flat(ptrs, lens, device).views()

    def decode_flat(self, data: torch.Tensor, offsets: torch.Tensor, device: torch.device,
                    sizes: Optional[torch.Tensor] = None) -> ImageTable:
        """Decode a flat buffer laid out by ``offsets`` into one allocation, planar RGB in a row.
        ``sizes`` ((n, 2) h, w, checked against the pixel limit) must match nvJPEG's own header
        parse, or ``FormatError`` before anything is allocated."""
        ptrs, lens = offsets[:-1] + data.data_ptr(), (offsets[1:] - offsets[:-1]).contiguous()
        with self._lock:
            return self._flat(ptrs, lens, device, sizes)

    def _flat(self, ptrs: torch.Tensor, lens: torch.Tensor, device: torch.device,
              expect: Optional[torch.Tensor] = None) -> ImageTable:
        hw = torch.tensor([self._size(p, k) for p, k in zip(ptrs.tolist(), lens.tolist())],
                          dtype=torch.int64).view(-1, 2)
        if expect is not None and not torch.equal(hw, expect):
            bad = int((hw != expect).any(1).nonzero()[0])
            raise FormatError(f"image {bad} of the batch: its JPEG header reads "
                              f"{tuple(expect[bad].tolist())} (height, width) to packer but "
                              f"{tuple(hw[bad].tolist())} to nvJPEG; a damaged or crafted file")
        planes = hw[:, 0] * hw[:, 1]
        ends = torch.cumsum(3 * planes, 0)
        out = torch.empty(int(ends[-1]), dtype=torch.uint8, device=device)
        starts = ends - 3 * planes
        self._run(ptrs, lens, out.data_ptr() + starts, planes, hw[:, 1], device)
        return ImageTable.planar(out, starts, hw)

    def _run(self, ptrs, lens, c0, plane, pitch, device) -> None:
        """One batched decode: image i's R, G, B planes at c0[i] + k * plane[i], rows
        ``pitch[i]`` bytes apart (planar RGB straight into (3, h, w)-shaped memory)."""
        n = len(ptrs)
        zero = torch.zeros_like(c0)  # nvjpegImage_t[n] as an (n, 8) int64 table
        table = torch.stack([c0, c0 + plane, c0 + 2 * plane, zero, pitch, pitch, pitch, zero],
                            1).contiguous()
        self.stream.wait_stream(torch.cuda.current_stream(device))  # the caller's allocation
        if self._batch != n:
            _check(self.lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, n, 1, 3),
                   "nvjpegDecodeBatchedInitialize")
            self._batch = n
        status = self.lib.nvjpegDecodeBatched(
            self.handle, self.state, ctypes.cast(ptrs.data_ptr(), ctypes.POINTER(ctypes.c_void_p)),
            ctypes.cast(lens.data_ptr(), ctypes.POINTER(ctypes.c_size_t)),
            ctypes.cast(table.data_ptr(), ctypes.POINTER(_Image)), ctypes.c_void_p(self.stream.cuda_stream))
        if status != 0:
            self._batch = 0  # nvJPEG asks for a fresh initialize after a failed batch
            _check(status, "nvjpegDecodeBatched")
        # Wait here (GIL released): the host bitstreams and nvJPEG's state are free again,
        # and the images are complete whatever stream reads them next.
        self.stream.synchronize()

    def _size(self, ptr: int, length: int) -> Tuple[int, int]:
        w, h = self._w, self._h
        _check(self._info(self.handle, ptr, length, self._comps, self._sub, w, h), "nvjpegGetImageInfo")
        return h[0], w[0]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with nvJPEG status {status}")


@functools.lru_cache(maxsize=None)
def load_nvjpeg():
    """libnvjpeg: torchvision's bundled copy first (it matches torch's CUDA), then the
    system's (CUDA toolkit, nvidia-nvjpeg wheels)."""
    import ctypes.util
    import glob
    import importlib.util
    names = []
    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        root = os.path.dirname(os.path.dirname(spec.origin))
        names += sorted(glob.glob(os.path.join(root, "torchvision.libs", "libnvjpeg*.so*")))
    names += [n for n in (ctypes.util.find_library("nvjpeg"),) if n]
    names += ["libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so.11", "libnvjpeg.so"]
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise OSError("libnvjpeg not found (install torchvision, or the CUDA toolkit's nvJPEG): "
                  + "; ".join(errors[-2:]))
