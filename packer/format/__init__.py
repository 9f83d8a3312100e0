"""The on-disk format, both ways (module map: docs/architecture.md; in words: docs/format.md)."""
from .._util.lazy import lazy_names

_WHERE = {".manifest": ["read_manifest"],
          ".tables": ["read_column"]}
__all__ = ["read_column", "read_manifest"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
