"""The read pipeline's first half: records by index (``reader``), the datasets (``dataset``,
``iterable``), their targets (``targets``, ``masks``), ``sampler`` and weighted ``mixture``."""
from .._util.lazy import lazy_names

_WHERE = {".dataset": ["PackedDataset"], ".iterable": ["PackedIterableDataset"],
          ".mixture": ["Mixture"], ".reader": ["ShardReader"], ".sampler": ["PackedSampler"]}
__all__ = ["Mixture", "PackedDataset", "PackedIterableDataset", "PackedSampler", "ShardReader"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
