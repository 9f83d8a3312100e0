"""Sources: what ``packer.build(source, dst)`` packs (ImageFolder, FileList, Coco, Yolo, Table):
objects with ``read() -> ImageList``, ``options() -> dict`` (in the manifest and the resume
fingerprint), ``check_destination(dst)`` (defaults: ``base.Source``); none imported (nor torch)."""
from .._util.lazy import lazy_names

_WHERE = {".folder": ["FileList", "ImageFolder"], ".coco": ["Coco"], ".yolo": ["Yolo"],
          ".table": ["Table"], ".base": ["ImageList", "Source"]}
__all__ = ["Coco", "FileList", "ImageFolder", "ImageList", "Source", "Table", "Yolo"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
