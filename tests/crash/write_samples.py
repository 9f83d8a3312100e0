"""``packer.write`` of an image folder's JPEGs (sorted), one thread checking: the crash tests'
single-process writer. Usage: python write_samples.py SRC DST."""
import sys
from pathlib import Path

import packer

src, dst = Path(sys.argv[1]), sys.argv[2]
files = sorted(src.rglob("*.jpg"))
samples = [{"image": f.read_bytes(), "path": f.relative_to(src).as_posix(), "label": i % 2}
           for i, f in enumerate(files)]
packer.write(dst, samples, classes=["a", "b"], workers=1, progress=False)
