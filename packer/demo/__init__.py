"""The demo and its data: photo-like JPEGs made from photos packer ships (``images.py``), the
ImageFolder-style baseline loader (``folder.py``) and ``packer demo`` itself (``run.py``)."""
from .folder import FolderDataset
from .images import PHOTOS, load_photos, make_image, make_image_folder
from .run import DEMO_IMAGES, DEMO_MARKER, DemoResult, demo_images, run_demo

__all__ = ["DEMO_IMAGES", "DEMO_MARKER", "DemoResult", "FolderDataset", "PHOTOS", "demo_images",
           "load_photos", "make_image", "make_image_folder", "run_demo"]
