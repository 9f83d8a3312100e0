"""Code shared by the tests (not fixtures: those are in conftest.py): realistic and broken
images made on the fly, ImageFolder's rule as torchvision writes it, running packer."""
from __future__ import annotations

import errno
import hashlib
import json
import io
import os
import random
import struct
import subprocess
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from array import array
from typing import Dict, List, Tuple

import ctypes

import lmdb

import pytest
import torch
from PIL import Image, features

from packer.demo import make_image
from packer.format.lmdbfile import shard_records
from packer.writing.shard import ShardWriter

# torchvision.datasets.folder.IMG_EXTENSIONS, copied here on purpose (not from packer).
TV_IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def imagefolder_rule(root) -> Tuple[List[str], Dict[str, int], List[Tuple[str, int]]]:
    """torchvision's ``find_classes`` + ``make_dataset``, re-implemented from its source.

    Returns (classes, class_to_idx, samples) with sample paths relative to ``root`` (posix).
    """
    root = os.fspath(root)
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    class_to_idx = {cls_name: i for i, cls_name in enumerate(classes)}
    samples = []
    for target_class in sorted(class_to_idx.keys()):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(root, target_class)
        if not os.path.isdir(target_dir):
            continue
        for dirpath, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(dirpath, fname)
                if path.lower().endswith(TV_IMG_EXTENSIONS):
                    samples.append((Path(os.path.relpath(path, root)).as_posix(), class_index))
    return classes, class_to_idx, samples


# -- image makers --------------------------------------------------------------------------

def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def small_photo(rng: random.Random, photos, size=(160, 120)) -> Image.Image:
    """A crop of a real photo at a small size: realistic content, cheap to decode."""
    base = rng.choice(photos)
    bw, bh = base.size
    cw, ch = bw // 2, bh // 2
    x, y = rng.randint(0, bw - cw), rng.randint(0, bh - ch)
    return base.crop((x, y, x + cw, y + ch)).resize(size, Image.BICUBIC)


def exif_rotated_jpeg(im: Image.Image) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    return encode(im, "JPEG", quality=90, exif=exif.tobytes())


def png16(im: Image.Image) -> bytes:
    im16 = im.convert("L").convert("I").point(lambda v: v * 257).convert("I;16")
    return encode(im16, "PNG")


def palette_transparent_png(im: Image.Image) -> bytes:
    p = im.convert("P", palette=Image.ADAPTIVE, colors=32)
    return encode(p, "PNG", transparency=0)


def bomb_png(w: int = 12000, h: int = 12000) -> bytes:
    """A real decompression bomb: a 1-bit PNG of w*h pixels that compresses to ~20 KB."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = zlib.compress(b"\x00" * (h * (1 + (w + 7) // 8)), 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


def corrupt_png(im: Image.Image) -> bytes:
    data = bytearray(encode(im, "PNG"))
    i = data.find(b"IDAT")
    data[i + 100:i + 164] = b"\xff" * 64
    return bytes(data)


def corrupt_header_jpeg(im: Image.Image) -> bytes:
    data = bytearray(encode(im, "JPEG", quality=90))
    data[2:300] = bytes(298)  # SOI kept, every marker after it destroyed
    return bytes(data)


@dataclass
class OddTree:
    root: Path
    good: Dict[str, str] = field(default_factory=dict)   # rel path -> what it is
    bad: Dict[str, str] = field(default_factory=dict)    # rel path -> expected reason prefix
    ignored: List[str] = field(default_factory=list)     # files that are not images by name
    empty_classes: List[str] = field(default_factory=list)

    @property
    def sources(self) -> List[str]:
        return sorted(self.good) + sorted(self.bad)


def make_odd_tree(base: Path, photos, seed: int = 0) -> OddTree:
    rng = random.Random(seed)
    root, outside = base / "src", base / "outside"
    t = OddTree(root)

    def put(rel: str, data: bytes, kind: str, good: bool = True, at: Path = root):
        p = at / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        if at == root:
            (t.good if good else t.bad)[rel] = kind

    def jpg(size=(160, 120), **kw):
        return encode(small_photo(rng, photos, size), "JPEG", quality=rng.randint(80, 95), **kw)

    # 'B' (upper case sorts before 'Z10', 'Z9', '_x', 'a' and 'é' by code point)
    put("B/a.jpg", make_image(rng, photos), "realistic JPEG")
    put("B/B.jpg", make_image(rng, photos), "realistic JPEG")
    put("B/Z10.jpg", jpg(), "JPEG")
    put("B/Z9.jpg", jpg(), "JPEG")
    put("B/_x.jpg", jpg(), "JPEG")
    put("B/é.jpg", jpg(), "JPEG")
    # 'Z10': JPEG variants
    put("Z10/cmyk.jpg", encode(small_photo(rng, photos).convert("CMYK"), "JPEG", quality=90), "CMYK JPEG")
    put("Z10/gray.jpg", encode(small_photo(rng, photos).convert("L"), "JPEG", quality=90), "grayscale JPEG")
    put("Z10/progressive.jpg", jpg((200, 150), progressive=True), "progressive JPEG")
    put("Z10/exif_rotated.jpg", exif_rotated_jpeg(small_photo(rng, photos, (180, 100))), "EXIF-rotated JPEG")
    # 'Z9': PNG modes
    put("Z9/png16.png", png16(small_photo(rng, photos)), "16-bit PNG")
    put("Z9/palette_transparent.png", palette_transparent_png(small_photo(rng, photos)),
        "palette PNG with transparency")
    put("Z9/rgba.png", encode(small_photo(rng, photos).convert("RGBA"), "PNG"), "RGBA PNG")
    put("Z9/gray_alpha.png", encode(small_photo(rng, photos).convert("LA"), "PNG"), "LA PNG")
    put("Z9/bilevel.png", encode(small_photo(rng, photos).convert("1"), "PNG"), "1-bit PNG")
    # '_x': extensions in any case, files that are not images, nesting, a symlinked subfolder
    put("_x/Upper.JPG", jpg(), "upper-case extension")
    put("_x/lower.jpeg", jpg(), ".jpeg")
    put("_x/Mixed.Png", encode(small_photo(rng, photos), "PNG"), "mixed-case extension")
    for rel in ("_x/notes.txt", "_x/anim.gif", "_x/Thumbs.db", "_x/image.jpg.bak"):
        (root / rel).write_bytes(b"not an image by its name")
        t.ignored.append(rel)
    # torchvision sorts the os.walk tuples by path: 'sub' < 'sub dir' < 'sub-dir' < 'sub/deeper'
    put("_x/sub/s.jpg", jpg(), "nested")
    put("_x/sub/deeper/d.jpg", jpg(), "nested twice")
    put("_x/sub dir/s.jpg", jpg(), "nested, space in folder")
    put("_x/sub-dir/s.jpg", jpg(), "nested")
    put("subtarget/t.jpg", jpg(), "", at=outside)
    (root / "_x/linksub").symlink_to(outside / "subtarget", target_is_directory=True)
    t.good["_x/linksub/t.jpg"] = "inside a symlinked subfolder"
    # 'a': other formats
    put("a/img.bmp", encode(small_photo(rng, photos), "BMP"), "BMP")
    put("a/img.tif", encode(small_photo(rng, photos), "TIFF"), "TIFF")
    put("a/img.ppm", encode(small_photo(rng, photos), "PPM"), "PPM")
    put("a/img.pgm", encode(small_photo(rng, photos).convert("L"), "PPM"), "PGM")
    if features.check("webp"):
        put("a/img.webp", encode(small_photo(rng, photos), "WEBP"), "WEBP")
    # empty classes: no files at all, and only files that are not images
    (root / "empty").mkdir()
    (root / "only_txt").mkdir()
    (root / "only_txt/readme.txt").write_text("no images here")
    t.empty_classes += ["empty", "only_txt"]
    # a symlinked class folder
    put("linked_target/l1.jpg", jpg(), "", at=outside)
    put("linked_target/l2.png", encode(small_photo(rng, photos), "PNG"), "", at=outside)
    (root / "linked").symlink_to(outside / "linked_target", target_is_directory=True)
    t.good["linked/l1.jpg"] = "in a symlinked class folder"
    t.good["linked/l2.png"] = "in a symlinked class folder"
    # 'with space': broken files, and one good image
    good_jpeg = jpg((200, 150))
    prog_jpeg = jpg((200, 150), progressive=True)
    put("with space/ok image.jpg", good_jpeg, "JPEG, space in name")
    put("with space/empty.jpg", b"", "empty file", good=False)
    put("with space/truncated.jpg", good_jpeg[:len(good_jpeg) // 2], "truncated", good=False)
    put("with space/truncated_progressive.jpg", prog_jpeg[:len(prog_jpeg) // 2], "truncated", good=False)
    put("with space/corrupt.png", corrupt_png(small_photo(rng, photos)), "corrupt", good=False)
    put("with space/corrupt_header.jpg", corrupt_header_jpeg(small_photo(rng, photos)),
        "not an image", good=False)
    put("with space/not_image.jpg", b"<html>this is a web page, not a JPEG</html>\n" * 20,
        "not an image", good=False)
    put("with space/bomb.png", bomb_png(), "decompression bomb", good=False)
    (root / "with space/dangling.jpg").symlink_to(base / "does-not-exist.jpg")
    t.bad["with space/dangling.jpg"] = "unreadable"
    # 'é': unicode and spaces in names
    put("é/café ü.jpg", jpg(), "unicode name")
    put("é/name with spaces.png", encode(small_photo(rng, photos), "PNG"), "spaces in name")
    put("é/日本語.jpg", jpg(), "CJK name")
    return t


# -- fixtures --------------------------------------------------------------------------------

def image_files(root: Path) -> List[str]:
    """Every image file under ``root`` by ImageFolder's rule, relative and sorted."""
    return sorted(p for p, _ in imagefolder_rule(root)[2])


def run_packer(*args, check=True, **kw) -> subprocess.CompletedProcess:
    """``packer ARGS`` in a subprocess (``python -m packer``), text output captured."""
    proc = subprocess.run([sys.executable, "-m", "packer", *map(str, args)],
                          capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"packer {' '.join(map(str, args))} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def quiet_build(src, dst, **kw):
    """``build`` in this process, no progress bar, a folder path's empty classes allowed (the
    odd tree has two), their warnings silenced."""
    from packer import build
    from packer.sources import ImageFolder
    kw.setdefault("progress", False)
    if isinstance(src, (str, os.PathLike)):
        src = ImageFolder(src, allow_empty=True)
    kw.setdefault("workers", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(src, dst, **kw)


# -- the GPU path, with PIL standing in for nvJPEG where there is no GPU ----------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rgb_tensor(im: Image.Image) -> torch.Tensor:
    im = im.convert("RGB")
    px = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
    return px.view(im.height, im.width, 3).permute(2, 0, 1)


def pil_decoder(datas, device):
    """nvJPEG's contract with PIL behind it: (3, h, w) uint8 per 1-D byte tensor."""
    return [rgb_tensor(Image.open(io.BytesIO(ctypes.string_at(d.data_ptr(), d.numel())))).to(device)
            for d in datas]


def photo_images(photos, n, seed=0):
    rng = random.Random(seed)
    return [Image.open(io.BytesIO(make_image(rng, photos))).convert("RGB") for _ in range(n)]


KINDS = {  # file name -> (what, expected to go to the GPU)
    "baseline.jpg": ("baseline 4:2:0", True),
    "q444.jpg": ("baseline 4:4:4", True),
    "gray.jpg": ("grayscale", True),
    "progressive.jpg": ("progressive", False),
    "cmyk.jpg": ("CMYK", False),
    "image.png": ("PNG", False),
}


def kind_bytes(photos, name, seed=0):
    rng = random.Random(seed)
    im = small_photo(rng, photos, (200, 150))
    return {
        "baseline.jpg": lambda: encode(im, "JPEG", quality=90),
        "q444.jpg": lambda: encode(im, "JPEG", quality=95, subsampling=0),
        "gray.jpg": lambda: encode(im.convert("L"), "JPEG", quality=90),
        "progressive.jpg": lambda: encode(im, "JPEG", quality=90, progressive=True),
        "cmyk.jpg": lambda: encode(im.convert("CMYK"), "JPEG", quality=90),
        "image.png": lambda: encode(im, "PNG"),
    }[name]()


# -- bounded child processes ---------------------------------------------------------------------

# Python code that caps the running process's address space at what it has mapped once torch
# and packer are imported, plus PACKER_TEST_EXTRA_AS bytes: the cap then means "this much more
# memory", the same with a CPU torch (~1 GiB mapped) as with a CUDA one (many GiB mapped).
LIMIT_AFTER_IMPORTS = (
    "import os, resource\n"
    "_extra = int(os.environ.get('PACKER_TEST_EXTRA_AS', '0'))\n"
    "if _extra:\n"
    "    import torch, packer.cli  # noqa\n"
    "    _vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) << 10\n"
    "    resource.setrlimit(resource.RLIMIT_AS, (_vm + _extra, _vm + _extra))\n")


def limited_packer_cli(extra_address_space: int) -> list:
    """argv for ``python -m packer ...`` whose process may map at most ``extra_address_space``
    bytes beyond torch and packer (pass PACKER_TEST_EXTRA_AS in its environment too)."""
    return [sys.executable, "-c", LIMIT_AFTER_IMPORTS + "import runpy\n"
            "runpy.run_module('packer', run_name='__main__')"]


# -- a build held at one image: a FIFO among the sources ------------------------------------

# packer reads only regular files as images (a FIFO is skipped at once, never waited on), so a
# held build runs packer with this prelude: a source file named ``*_gate.jpg`` (the test's
# FIFO) is read by a plain blocking read, every other image as packer reads it. Only the
# hold is the test's; everything the build writes is packer's own, in its own process.
GATED_PRELUDE = (
    "import runpy\n"
    "import packer.writing.worker as worker\n"
    "_read_file = worker.read_file\n"
    "def read_file(path, *args, **kwargs):\n"
    "    if str(path).endswith('_gate.jpg'):\n"
    "        with open(path, 'rb') as f:\n"
    "            return f.read()\n"
    "    return _read_file(path, *args, **kwargs)\n"
    "worker.read_file = read_file\n"
    "runpy.run_module('packer', run_name='__main__')\n")


def gated_packer_cmd(*args) -> list:
    """argv for ``packer ARGS`` whose build blocks reading a FIFO named ``*_gate.jpg`` until
    the test writes it (``wait_for_reader``, ``release``)."""
    return [sys.executable, "-c", GATED_PRELUDE, *map(str, args)]


def wait_for_reader(fifo: Path, proc: subprocess.Popen, timeout: float = 60) -> int:
    """Block until ``proc`` opens ``fifo`` to read it; return the write end. Until that is
    written and closed the process stays blocked in its read."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"the build ended (rc {proc.returncode}) before reading "
                                     f"{fifo}: {out}{err}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the build did not read {fifo} within {timeout} s")
            time.sleep(0.002)
        else:
            os.set_blocking(fd, True)
            return fd


def release(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# -- packer as a command -------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def packer_cmd(*args) -> list:
    return [sys.executable, "-m", "packer", *map(str, args)]


def packer_env() -> dict:
    """The environment for a packer subprocess: this checkout first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


# -- crafted datasets: records and side tables rewritten, the manifest made to agree ----------

def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def edit_manifest(root: Path, fn) -> None:
    man = json.loads((root / "manifest.json").read_text())
    fn(man)
    (root / "manifest.json").write_text(json.dumps(man))


def retable(root: Path, key: str, name: str, table: array) -> None:
    """Rewrite a side table and make the manifest agree with it (a crafted, consistent set)."""
    (root / name).write_bytes(table.tobytes())

    def fix(man):
        entry = man[key] if "." not in key else man[key.split(".")[0]][key.split(".")[1]]
        entry.update(bytes=(root / name).stat().st_size, sha256=sha(root / name))
    edit_manifest(root, fix)


def rewrite_first_record(root: Path, record: bytes) -> None:
    """Replace record 0 of shard 0 by ``record`` bytes; shard entry and offsets made consistent."""
    reader_recs = shard_records(root / "shard-00000.lmdb")
    env = lmdb.open(str(root / "shard-00000.lmdb"), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        values = [bytes(v) for _, v in txn.cursor()]
    env.close()
    values[0] = record
    tmp = root / "rebuilt.lmdb"
    w = ShardWriter(tmp, expected_bytes=1 << 22)
    for v in values:
        w.append(v)
    entry = w.finish()
    (root / "rebuilt.lmdb").replace(root / "shard-00000.lmdb")
    offsets = array("Q", shard_records(root / "shard-00000.lmdb"))
    assert len(offsets) == len(reader_recs)
    edit_manifest(root, lambda man: man["shards"][0].update(bytes=entry["bytes"],
                                                            sha256=entry["sha256"]))
    man = json.loads((root / "manifest.json").read_text())
    edit_manifest(root, lambda m: m.update(bytes=sum(s["bytes"] for s in m["shards"])))
    retable(root, "offsets", man["offsets"]["path"], offsets)
