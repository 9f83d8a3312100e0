"""packer: pack image folders into LMDB shards once, then feed GPUs without waiting on input.

Public names load lazily (PEP 562), so ``packer --help`` does not pay for importing torch.
The CLI's library functions live in their modules (``packer.build.build``,
``packer.build.merge``, ``packer.inspect.verify``...): a top-level ``packer.build``
function would be shadowed by the ``packer.build`` module as soon as it is imported.
"""
from importlib import import_module as _import

__version__ = "0.1.0"

_EXPORTS = {
    "BuildResult": "build",
    "DecodeCenterCrop": "imaging", "DecodeRandomResizedCrop": "imaging", "Transcode": "imaging",
    "FormatError": "errors", "PackerError": "errors",
    "PackedDataset": "dataset", "ShardReader": "reader",
    "PackedIterableDataset": "streaming", "PackedSampler": "sampler",
    "BackgroundIterator": "loader", "background": "loader", "collate_uint8": "loader",
    "make_loader": "loader", "CUDAPrefetcher": "prefetch",
    "GPUDecoder": "gpu_decode", "make_gpu_loader": "gpu_decode",
    "make_image_folder": "demo",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(_import(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packer' has no attribute {name!r}")


def __dir__():
    return __all__
