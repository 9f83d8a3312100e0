"""The demo and its data: photo-like JPEGs made from photos packer ships (``images.py``), the
ImageFolder- and CocoDetection-style baseline loaders (``folder.py``) and ``packer demo``
itself (``run.py``; ``detection.py`` for ``packer demo --detection``)."""
from .folder import CocoFolderDataset, FolderDataset
from .images import PHOTOS, load_photos, make_image, make_image_folder
from .run import DEMO_IMAGES, DEMO_MARKER, DemoResult, demo_images, run_demo
from .detection import DETECTION_IMAGES, DetectionDemoResult, detection_demo_images, run_detection_demo

__all__ = ["CocoFolderDataset", "DEMO_IMAGES", "DEMO_MARKER", "DETECTION_IMAGES", "DemoResult",
           "DetectionDemoResult", "FolderDataset", "PHOTOS", "demo_images",
           "detection_demo_images", "load_photos", "make_image", "make_image_folder", "run_demo",
           "run_detection_demo"]
