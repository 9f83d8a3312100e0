"""The on-disk format, both ways: the manifest and its checks (``manifest``,
``validation``), typed fields (``fields``), records (``records``), the side tables
(``tables``) and the LMDB file read without a memory map (``lmdbfile``). ``docs/format.md``
is the human version."""
from .._util.lazy import lazy_names

_WHERE = {".manifest": ["read_manifest"],
          ".tables": ["read_column"]}
__all__ = ["read_column", "read_manifest"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
