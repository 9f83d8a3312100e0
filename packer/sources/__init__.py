"""Annotation sources beyond ImageFolder and ``--list``: COCO instances JSON (``coco``),
ultralytics YOLO label folders (``yolo``) and per-image metadata tables (``meta``).

Each ``read_*`` returns a ``packer.sources.base.ImageList`` whose ``annotations`` carry the typed
fields and a module-level ``fit`` that the builder calls once an image's size is known.
"""
