"""packer: pack image folders into LMDB shards once, then feed GPUs without waiting on input.

The public API is listed below for editors and type checkers; at run time each name is
imported on first use (PEP 562), so ``import packer`` and ``packer --help`` do not pay for
importing torch. ``docs/architecture.md`` maps the modules. No submodule shares a name
with a function exported here (``packer.build`` is the function; the module is ``builder``).
"""
from importlib import import_module as _import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # the names of __all__ (tests/test_layout.py checks that the three lists agree)
    from .builder import BuildResult, build
    from .check import Transcode
    from .decode import DecodeCenterCrop, DecodeLetterbox, DecodeRandomResizedCrop
    from .errors import FormatError, PackerError
    from .dataset import PackedDataset
    from .gpu import GPUDecoder, GPUOptions, make_gpu_loader
    from .info import verify
    from .loader import collate_detection, collate_uint8, default_num_workers, make_loader
    from .merging import merge
    from .prefetch import IMAGENET_MEAN, IMAGENET_STD, CUDAPrefetcher
    from .reader import ShardReader
    from .sampler import PackedSampler
    from .staging import stage, stage_once_per_node, unstage
    from .streaming import PackedIterableDataset
    from .threaded import BackgroundIterator, background
    from .writing import DatasetWriter, write

_LAZY = {
    "BuildResult": "builder", "build": "builder",
    "Transcode": "check",
    "DecodeCenterCrop": "decode", "DecodeLetterbox": "decode", "DecodeRandomResizedCrop": "decode",
    "FormatError": "errors", "PackerError": "errors",
    "PackedDataset": "dataset",
    "GPUDecoder": "gpu", "GPUOptions": "gpu", "make_gpu_loader": "gpu",
    "verify": "info",
    "collate_detection": "loader", "collate_uint8": "loader", "default_num_workers": "loader",
    "make_loader": "loader",
    "merge": "merging",
    "CUDAPrefetcher": "prefetch", "IMAGENET_MEAN": "prefetch", "IMAGENET_STD": "prefetch",
    "ShardReader": "reader",
    "PackedSampler": "sampler",
    "stage": "staging", "stage_once_per_node": "staging", "unstage": "staging",
    "PackedIterableDataset": "streaming",
    "BackgroundIterator": "threaded", "background": "threaded",
    "DatasetWriter": "writing", "write": "writing",
}

__all__ = ["BackgroundIterator", "BuildResult", "CUDAPrefetcher", "DatasetWriter",
           "DecodeCenterCrop", "DecodeLetterbox", "DecodeRandomResizedCrop", "FormatError",
           "GPUDecoder", "GPUOptions", "IMAGENET_MEAN", "IMAGENET_STD", "PackedDataset",
           "PackedIterableDataset", "PackedSampler", "PackerError", "ShardReader", "Transcode",
           "background", "build", "collate_detection", "collate_uint8", "default_num_workers",
           "make_gpu_loader", "make_loader", "merge", "stage", "stage_once_per_node", "unstage",
           "verify", "write", "__version__"]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'packer' has no attribute {name!r}")
    value = getattr(_import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
