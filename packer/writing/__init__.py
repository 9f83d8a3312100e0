"""The write pipeline: a source's entries planned into shards (``builder``), written
whole by worker processes (``worker``, ``check``, ``shard``) and taken in plan order into
the journal, side tables and, last, the manifest (``packing``, ``journal``); ``python``
does the same for samples from Python, ``merger`` joins parts."""
from .._util.lazy import lazy_names

_WHERE = {".builder": ["BuildResult", "build"],
          ".check": ["Checks", "Transcode"],
          ".merger": ["merge"],
          ".python": ["DatasetWriter", "write"]}
__all__ = ["BuildResult", "Checks", "DatasetWriter", "Transcode", "build", "merge", "write"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
