"""The read pipeline's first half: records by index (``reader``), the datasets
(``dataset``: ImageFolder/CocoDetection drop-in; ``iterable``), their targets
(``targets``, ``masks``) and the sampler (``sampler``)."""
from .._util.lazy import lazy_names

_WHERE = {".dataset": ["PackedDataset"],
          ".iterable": ["PackedIterableDataset"],
          ".reader": ["ShardReader"],
          ".sampler": ["PackedSampler"]}
__all__ = ["PackedDataset", "PackedIterableDataset", "PackedSampler", "ShardReader"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
