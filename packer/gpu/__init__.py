"""GPU decoding: workers ship stored JPEG bytes, the GPU decodes them (nvJPEG) and augments them
in one fused Triton kernel (docs/gpu_decode.md). Importing this package imports nothing until
a name is used, starts no CUDA and changes no environment."""
from .._util.lazy import lazy_names

_WHERE = {".decoder": ["GPUDecoder"], ".options": ["GPUOptions"],
          ".loader": ["make_gpu_loader", "reserve_cuda_queues"],
          ".encoded": ["EncodedImage", "collate_encoded"]}
__all__ = ["EncodedImage", "GPUDecoder", "GPUOptions", "collate_encoded", "make_gpu_loader",
           "reserve_cuda_queues"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
