"""``packer demo`` (``run.py``, ``detection.py``), its data (``images.py``, ``scenes.py``) and
the folder baselines it compares with (``folder.py``)."""
from .folder import CocoFolderDataset, FolderDataset
from .images import PHOTOS, load_photos, make_image, make_image_folder
from .run import DEMO_IMAGES, DEMO_MARKER, DemoResult, demo_images, run_demo
from .detection import DETECTION_IMAGES, DetectionDemoResult, detection_demo_images, run_detection_demo

__all__ = ["CocoFolderDataset", "DEMO_IMAGES", "DEMO_MARKER", "DETECTION_IMAGES", "DemoResult",
           "DetectionDemoResult", "FolderDataset", "PHOTOS", "demo_images",
           "detection_demo_images", "load_photos", "make_image", "make_image_folder", "run_demo",
           "run_detection_demo"]
