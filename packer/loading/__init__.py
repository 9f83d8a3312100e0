"""The read pipeline's second half: ``make_loader``, its uint8 collates and epoch stream,
``CUDAPrefetcher`` and ``background``; ``torchapi`` holds every use of torch's private API."""
from .._util.lazy import lazy_names

_WHERE = {".loader": ["PackedLoader", "default_num_workers", "make_loader"],
          ".collate": ["collate_detection", "collate_uint8"],
          ".prefetch": ["CUDAPrefetcher", "IMAGENET_MEAN", "IMAGENET_STD"],
          ".threaded": ["BackgroundIterator", "background"]}
__all__ = ["BackgroundIterator", "CUDAPrefetcher", "IMAGENET_MEAN", "IMAGENET_STD", "PackedLoader",
           "background", "collate_detection", "collate_uint8", "default_num_workers",
           "make_loader"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
