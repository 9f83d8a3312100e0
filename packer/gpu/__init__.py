"""GPU decoding: DataLoader workers ship stored JPEG bytes, the GPU decodes them (nvJPEG) and
augments them in one fused kernel.

    loader.py    make_gpu_loader, reserve_cuda_queues: the workers' side and the CUDA setting
    encoded.py   EncodedImage / collate_encoded: header parse in workers, one flat buffer a batch
    decoder.py   GPUDecoder: the iterator a training loop uses; options.py: GPUOptions, DecodeStats
    pipeline.py  its decode/augment threads, each on its own CUDA stream
    nvjpeg.py    libnvjpeg through ctypes (NvjpegDecoder), torchvision's decoder as fallback
    augment.py   crop boxes and the matmul resize; resample.py + kernel.py: the fused Triton kernel

Importing this package does not start CUDA or change the environment.
"""
from .augment import center_crop_boxes, random_resized_crop_boxes, resample_crops
from .decoder import GPUDecoder
from .encoded import EncodedBatch, EncodedImage, EncodedSample, JpegInfo, collate_encoded, gpu_decodable, jpeg_info
from .loader import CUDA_QUEUES, ConnectionsWarning, connections_advice, make_gpu_loader, reserve_cuda_queues
from .nvjpeg import NvjpegDecoder
from .options import DecodeStats, GPUOptions
from .resample import ImageTable, triton_available

__all__ = ["CUDA_QUEUES", "ConnectionsWarning", "DecodeStats", "EncodedBatch", "EncodedImage",
           "EncodedSample", "GPUDecoder", "GPUOptions", "ImageTable", "JpegInfo", "NvjpegDecoder",
           "center_crop_boxes", "collate_encoded", "connections_advice", "gpu_decodable",
           "jpeg_info", "make_gpu_loader", "random_resized_crop_boxes", "resample_crops",
           "reserve_cuda_queues", "triton_available"]
