"""Sources: what ``packer.build(source, dst)`` packs, as objects in torchvision's style.

- ``ImageFolder(root, extensions=None, is_valid_file=None, allow_empty=False)``: classes from
  subfolders, torchvision's rules (a plain path given to ``build`` means this);
- ``FileList(list_file, root=None)``: ``relative/path<TAB>label`` lines;
- ``Coco(images, annotations, skip_empty=False)``: a COCO instances JSON (detection);
- ``Yolo(images, labels, names)``: ultralytics label files (detection);
- ``Table(images, table, label=None)``: a JSONL/CSV table of typed per-image fields.

The protocol the builder calls, all of it (``base.Source`` gives the defaults; any object
with these members is a source):

- ``read() -> ImageList``: the images to pack, paths relative to ``ImageList.root``, in build
  order, with class names, labels (-1: none) and any ``Annotations`` (typed fields, their
  rows and a module-level ``fit(row, width, height)`` the build's workers call once an
  image's size is known). A bad input is a ``PackerError`` naming what to fix; an unusable
  image or object is left out and listed (``Annotations.dropped``). ``read`` takes no part
  or order: the builder selects ``part`` and ``shuffle`` from what it returns, the same way
  for every source (``base.select``; the rows follow their entries).
- ``options() -> dict``: what the manifest's ``options`` record of the source (text and
  bools; e.g. ``{"coco": "instances.json"}``); they are part of the resume fingerprint too.
- ``check_destination(dst)``: a ``PackerError`` where writing the dataset to ``dst`` would
  change what ``read`` finds (a DST inside an ImageFolder's root would become a class).

Importing this package imports none of them (nor torch): each is imported on first use.
"""
from .._util.lazy import lazy_names

_WHERE = {".folder": ["FileList", "ImageFolder"], ".coco": ["Coco"], ".yolo": ["Yolo"],
          ".table": ["Table"], ".base": ["ImageList", "Source"]}
__all__ = ["Coco", "FileList", "ImageFolder", "ImageList", "Source", "Table", "Yolo"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
