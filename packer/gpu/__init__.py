"""GPU decoding: DataLoader workers ship stored JPEG bytes, the GPU decodes them (nvJPEG) and
augments them in one fused Triton kernel (docs/gpu_decode.md).

    loader.py    make_gpu_loader, reserve_cuda_queues: the workers' side and the CUDA setting
    encoded.py   EncodedImage / collate_encoded: header parse and pixel limit in workers, one
                 flat buffer a batch
    decoder.py   GPUDecoder: the iterator a training loop uses; options.py: GPUOptions, DecodeStats
    pipeline.py  its decode/augment threads, each on its own CUDA stream
    nvjpeg.py    libnvjpeg through ctypes (NvjpegDecoder), torchvision's decoder as fallback
    augment.py   crop boxes; resample.py + kernel.py: the fused Triton kernel
    detection.py detection targets moved with the crops

``EncodedImage`` and ``collate_encoded`` are exported for a DataLoader made by hand
(``PackedDataset(root, decode=EncodedImage())`` with ``collate_fn=collate_encoded``);
everything else is reached through ``GPUDecoder`` and ``make_gpu_loader``. Importing this
package imports nothing until a name is used, starts no CUDA and changes no environment.
"""
from .._util.lazy import lazy_names

_WHERE = {".decoder": ["GPUDecoder"], ".options": ["GPUOptions"],
          ".loader": ["make_gpu_loader", "reserve_cuda_queues"],
          ".encoded": ["EncodedImage", "collate_encoded"]}
__all__ = ["EncodedImage", "GPUDecoder", "GPUOptions", "collate_encoded", "make_gpu_loader",
           "reserve_cuda_queues"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
