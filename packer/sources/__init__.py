"""Sources: what ``packer.build(source, dst)`` packs (ImageFolder, FileList, Coco, Yolo, Table).

A source is any object with ``read() -> ImageList``, ``options() -> dict`` (recorded in the
manifest and the resume fingerprint) and ``check_destination(dst)``; ``base.Source`` gives
the defaults. Importing this package imports none of them (nor torch)."""
from .._util.lazy import lazy_names

_WHERE = {".folder": ["FileList", "ImageFolder"], ".coco": ["Coco"], ".yolo": ["Yolo"],
          ".table": ["Table"], ".base": ["ImageList", "Source"]}
__all__ = ["Coco", "FileList", "ImageFolder", "ImageList", "Source", "Table", "Yolo"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
