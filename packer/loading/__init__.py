"""The read pipeline's second half: ``make_loader`` returns a ``PackedLoader`` (``loader``)
whose workers collate uint8 batches (``collate``, ``sharedbatch``) from one stream across
epochs (``epochs``); ``CUDAPrefetcher`` copies them to the GPU ahead of use (``prefetch``);
``background`` runs any iterable in a thread (``threaded``). ``torchapi`` holds every use of
torch's private API."""
from .._util.lazy import lazy_names

_WHERE = {".loader": ["PackedLoader", "default_num_workers", "make_loader"],
          ".collate": ["collate_detection", "collate_uint8"],
          ".prefetch": ["CUDAPrefetcher", "IMAGENET_MEAN", "IMAGENET_STD"],
          ".threaded": ["BackgroundIterator", "background"]}
__all__ = ["BackgroundIterator", "CUDAPrefetcher", "IMAGENET_MEAN", "IMAGENET_STD", "PackedLoader",
           "background", "collate_detection", "collate_uint8", "default_num_workers",
           "make_loader"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
