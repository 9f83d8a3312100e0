"""What every source shares: ``ImageList``, the ``Source`` base, the walk and file helpers,
and the build's part/shuffle selection."""
from __future__ import annotations

import os
import posixpath
import random
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import PackerError
from .._util.fsio import read_file
from .._util.text import is_utf8, printable
from ..storage.files import ObjectFile, RemoteFolder, folder

# torchvision.datasets.folder.IMG_EXTENSIONS, matched case-insensitively as there.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# ASCII names joined by single slashes, no part starting with ".": already safe and normal.
PLAIN_PATH = re.compile(r"(?:[\w-][\w.-]*/)*[\w-][\w.-]*\Z", re.ASCII)


# Integer labels make classes "0".."max" (a label of 10**11: that many names); stop above this.
DEFAULT_MAX_CLASSES = 1_000_000
FLOAT32_MAX = 3.4028234663852886e38  # what a float32 field can hold
INT32_MAX = 2 ** 31 - 1  # labels.i32 holds 32-bit labels


def class_labels(values: List[Any], where: Callable[[int], str],
                 max_classes: int) -> Tuple[List[int], List[str]]:
    """``(labels, classes)``: text labels name classes (sorted); integer labels (>= 0) make
    classes "0".."max", at most ``max_classes``, else a PackerError naming ``where(i)``."""
    if not all(isinstance(v, int) for v in values):
        classes = sorted(set(values))
        idx = {c: i for i, c in enumerate(classes)}
        return [idx[v] for v in values], classes
    i = max(range(len(values)), key=values.__getitem__)
    top = values[i]
    if top > INT32_MAX:
        raise PackerError(f"{where(i)}: label {top} is beyond the 32-bit labels a dataset "
                          f"stores (at most {INT32_MAX:,})")
    if top >= max_classes:
        raise PackerError(f"{where(i)}: label {top} would make {top + 1:,} classes (0..{top}), "
                          f"more than max_classes ({max_classes:,}); if the labels are right, "
                          f"raise max_classes")
    return values, [str(k) for k in range(top + 1)]


class EmptyClassWarning(UserWarning):
    """A class folder holds no image: it keeps its label (as in ImageFolder) but has no samples."""


class SymlinkLoopWarning(UserWarning):
    """A symlink leads to a folder already walked (a loop, or another path to it): skipped."""


@dataclass(frozen=True)
class Annotations:
    """Typed fields beyond the class label, one row per entry of an ``ImageList``.

    ``schema``: the fields in record order (``packer.format.fields``); ``rows[i]``: entry *i*'s
    before ``fit(row, width, height[, orientation]) -> (values, reasons)``, a module-level
    function the workers call once the size is known (``ValueError(reason)`` leaves the image
    out). ``extra``: manifest keys; ``dropped``: ``{"path", "reason"}`` of unusable annotations;
    ``digest``: the input's hash, fingerprinted instead of the rows; ``stored``: ``fit`` gives
    encoded values; ``upright``: rows describe the image as shown, so ``fit`` takes the EXIF
    orientation too."""
    schema: List[Dict[str, Any]]
    rows: List[Any]
    fit: Optional[Callable[[Any, int, int], Tuple[Dict[str, Any], List[str]]]] = None
    task: str = "generic"
    extra: Dict[str, Any] = field(default_factory=dict)
    dropped: List[Dict[str, str]] = field(default_factory=list)
    digest: Optional[str] = None
    stored: bool = False
    upright: bool = False


@dataclass(frozen=True)
class ImageList:
    """What to pack: ``entries`` are ``(path relative to root, label)`` in build order
    (label -1 where the dataset has no class label), and any further typed fields."""
    root: Path
    classes: List[str]
    entries: List[Tuple[str, int]]
    annotations: Optional[Annotations] = None

    @property
    def class_to_idx(self) -> Dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}


class Source:
    """Base of the objects ``packer.build`` packs: a subclass sets ``root`` and defines ``read``."""
    root: Path

    def read(self) -> ImageList:
        raise NotImplementedError

    def options(self) -> Dict[str, Any]:
        return {}

    def check_destination(self, dst: Path) -> None:
        pass


def walk(top: Path):
    """``os.walk(top, followlinks=True)`` (ImageFolder's), folders sorted, each real folder once
    (by ``(st_dev, st_ino)``: one seen again, as in a loop, is skipped with a warning)."""
    seen = {_identity(top)}
    for dirpath, dirnames, fnames in os.walk(top, followlinks=True):
        dirnames.sort()
        for d in list(dirnames):
            path = os.path.join(dirpath, d)
            key = _identity(path)
            if key in seen:
                dirnames.remove(d)
                warnings.warn(f"skipping {printable(path)}: {_again(dirpath, path)}",
                              SymlinkLoopWarning, stacklevel=3)
            seen.add(key)
        yield dirpath, dirnames, fnames


def _again(dirpath: str, path: str) -> str:
    here, there = os.path.realpath(dirpath), os.path.realpath(path)
    if here == there or here.startswith(there.rstrip(os.sep) + os.sep):
        return f"a symlink back to its own ancestor {printable(there)} (a loop)"
    return f"the folder {printable(there)} again, through a symlink (each folder is walked once)"


def _identity(path) -> tuple:
    try:
        st = os.stat(path)
    except OSError:  # gone meanwhile, or a dangling link: os.walk skips what it cannot list
        return ("missing", os.fspath(path))
    return st.st_dev, st.st_ino


def show(text: Any) -> str:
    """Dataset text made safe for a message: control characters and bad bytes escaped."""
    try:
        return printable(str(text))
    except UnicodeError:  # a lone surrogate from a JSON "\\ud800" escape
        return ascii(str(text))


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of ``path`` (a BOM allowed), or a PackerError saying what to fix."""
    return utf8_text(read_data(path, what), path, what)


def read_data(path: Path, what: str) -> bytes:
    """The bytes of the regular file ``path`` (never a FIFO or device: they may never end)."""
    try:
        return path.read() if isinstance(path, ObjectFile) else read_file(path)
    except FileNotFoundError:
        raise PackerError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise PackerError(f"cannot read {what} {path}: {e.strerror or e}") from None


def utf8_text(data: bytes, path: Path, what: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PackerError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                          f"save it as UTF-8") from None


def image_root(images: os.PathLike, who: str, what: str = "images"):
    """``images`` as a folder (a ``RemoteFolder`` for a URL), else a PackerError naming both."""
    root = folder(images)
    if not root.is_dir():
        raise PackerError(f"{who}: {what} {root} does not exist or is not a folder")
    return root


def relative_path(rel: Any) -> Tuple[str, str]:
    """``(normalized posix path, "")`` for a safe path inside IMAGES, else ``("", why not)``:
    a path from a dataset file must never reach outside the folder it names."""
    if not isinstance(rel, str):
        return "", f"must be a string, not {type(rel).__name__}"
    if PLAIN_PATH.match(rel):  # the common case, already normal: no parsing needed
        return rel, ""
    if not is_utf8(rel):
        return "", "is not valid UTF-8 text"
    if "\0" in rel:
        return "", "contains a NUL character"
    p = PurePosixPath(rel)
    if p.is_absolute():
        return "", "is absolute; give it relative to the image folder"
    if ".." in p.parts:
        return "", "contains '..'; it must stay inside the image folder"
    if str(p) in ("", "."):
        return "", "is empty"
    return p.as_posix(), ""


def walk_files(root: Path, want) -> List[str]:
    """Relative posix paths of the files ``want`` accepts (by full path), in ImageFolder's walk
    order (``sorted(walk(root))``); a ``RemoteFolder``'s objects in the same order."""
    if isinstance(root, RemoteFolder):
        return sorted((r for r in root.sizes() if want(root / r)), key=walk_order)
    found = []
    for dirpath, dirnames, fnames in sorted(walk(root)):
        rel_dir = os.path.relpath(dirpath, root)
        found.extend(Path(rel_dir, f).as_posix() for f in sorted(fnames)
                     if want(os.path.join(dirpath, f)))
    return found


def walk_order(rel: str) -> Tuple[str, str]:
    """Where ``walk_files`` puts the file ``rel``: by its folder, then by its name."""
    return posixpath.dirname(rel), posixpath.basename(rel)


def parse_part(part: Optional[str]) -> Optional[Tuple[int, int]]:
    """``"K/N"`` -> (K, N), 0-based like SLURM_ARRAY_TASK_ID and torch ranks."""
    if part is None:
        return None
    try:
        k, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise PackerError(f"part must look like K/N (e.g. 0/4), got {part!r}") from None
    if n < 1 or not 0 <= k < n:
        raise PackerError(f"part {part}: K must be in 0..N-1 (parts are numbered from 0)")
    return k, n


def select(source: ImageList, *, part: Optional[Tuple[int, int]] = None,
           shuffle: bool = False, seed: int = 0) -> ImageList:
    """One strided part (balanced over classes) and/or a seeded shuffle; annotation rows follow."""
    order: Sequence[int] = range(len(source.entries))
    if shuffle:
        order = list(order)
        random.Random(seed).shuffle(order)
    if part is not None:
        k, n = part
        order = order[k::n]
    ann = source.annotations
    if ann is not None:
        ann = replace(ann, rows=[ann.rows[i] for i in order])
    return ImageList(source.root, source.classes, [source.entries[i] for i in order], ann)
