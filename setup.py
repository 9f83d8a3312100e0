"""The one thing setup.cfg cannot say: packer's optional C accelerator.

``packer.sources._polygons`` turns COCO polygon text into stored bytes in one pass (see its
source). It is optional: where it cannot be compiled (no C compiler), the build falls back
to the same work in Python, with the same results.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("packer.sources._polygons", ["packer/sources/_polygons.c"],
                             optional=True)])
