"""The read pipeline's second half: batches from DataLoader workers (``loader``,
``epochs``, ``sharedbatch``, ``batchpool``), copied to the GPU ahead of use
(``prefetch``) or produced in a background thread (``threaded``)."""
from .._util.lazy import lazy_names

_WHERE = {".loader": ["collate_detection", "collate_uint8", "default_num_workers", "make_loader"],
          ".prefetch": ["CUDAPrefetcher", "IMAGENET_MEAN", "IMAGENET_STD"],
          ".threaded": ["BackgroundIterator", "background"]}
__all__ = ["BackgroundIterator", "CUDAPrefetcher", "IMAGENET_MEAN", "IMAGENET_STD", "background", "collate_detection", "collate_uint8", "default_num_workers", "make_loader"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
