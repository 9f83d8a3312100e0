"""Finding images and their labels: torchvision's ImageFolder rule, ``--list`` files, parts.

Label *i* must mean the same class here as in ``torchvision.datasets.ImageFolder`` over the
same folder, so the class order and the file walk copy its rules exactly (see
``find_classes`` and ``make_dataset`` in torchvision/datasets/folder.py).
"""
from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import PackerError
from .._util.text import is_utf8, printable

# torchvision.datasets.folder.IMG_EXTENSIONS, matched case-insensitively as there.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class EmptyClassWarning(UserWarning):
    """A class folder holds no image: it keeps its label (as in ImageFolder) but has no samples."""


class SymlinkLoopWarning(UserWarning):
    """A folder links back to one of its ancestors; walking it would never end."""


@dataclass(frozen=True)
class Annotations:
    """Typed fields beyond the class label, one row per entry of an ``ImageList``.

    ``schema``: the fields in record order, ``{"name", "type"[, "dtype", "shape"]}`` (see
    ``packer.format.fields``). ``rows[i]``: entry *i*'s annotation, before ``fit`` (plain
    data, or the source's own picklable objects). ``fit(row, width, height) -> (values,
    reasons)``: a module-level function (it is called in the build's workers once the
    image's size is known) that turns a row into the stored values (e.g. normalized YOLO
    boxes into pixels, boxes clipped to the image) and says why any object was dropped.
    ``task``: "detection" or "generic". ``extra``: keys added to the manifest (e.g. COCO
    ``categories``). ``dropped``: annotations the parser could not use, ``{"path",
    "reason"}``. ``digest``: a hash of the input the rows were read from; when given, the
    build's fingerprint uses it instead of hashing every row.
    """
    schema: List[Dict[str, Any]]
    rows: List[Any]
    fit: Optional[Callable[[Any, int, int], Tuple[Dict[str, Any], List[str]]]] = None
    task: str = "generic"
    extra: Dict[str, Any] = field(default_factory=dict)
    dropped: List[Dict[str, str]] = field(default_factory=list)
    digest: Optional[str] = None


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


def find_classes(root: os.PathLike) -> List[str]:
    """Immediate subfolders (symlinks followed), sorted by code point as torchvision does."""
    root = Path(root)
    if not root.is_dir():
        raise PackerError(f"source folder {root} does not exist or is not a folder")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    for c in classes:
        if not is_utf8(c):
            raise PackerError(f"class folder '{printable(c)}' in {root} has a name that is not valid "
                              f"UTF-8, so it cannot be a class name in the manifest: rename it "
                              f"(e.g. `convmv -r -f latin1 -t utf8 --notest {root}`)")
    if not classes:
        raise PackerError(
            f"no class folders in {root}: expected ImageFolder layout ROOT/CLASS/IMAGE "
            f"(or pass list_file / --list FILE with 'relative/path<TAB>label' lines)")
    return classes


def is_image_file(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def scan_folder(root: os.PathLike, *, extensions: Optional[Sequence[str]] = None,
                is_valid_file: Optional[Callable[[str], bool]] = None,
                allow_empty: bool = False) -> ImageList:
    """Walk ``root`` in ImageFolder order: classes sorted, files found recursively and sorted.

    torchvision's ``make_dataset`` rules: files whose lower-cased name ends with one of
    ``extensions`` (default ``IMG_EXTENSIONS``), or for which ``is_valid_file(full path)`` is
    true (not both); a class folder with no such file is an error unless ``allow_empty``
    (then it keeps its label, with a warning, and has no samples).
    """
    root = Path(root)
    if extensions is not None and is_valid_file is not None:
        raise PackerError("pass extensions or is_valid_file, not both (as torchvision's ImageFolder)")
    if is_valid_file is None:
        exts = tuple(e.lower() for e in (extensions or IMG_EXTENSIONS))
        is_valid_file = lambda path: path.lower().endswith(exts)  # noqa: E731
    classes = find_classes(root)
    entries: List[Tuple[str, int]] = []
    empty = []
    for label, cls in enumerate(classes):
        before = len(entries)
        for dirpath, _, fnames in sorted(walk(root / cls)):
            rel_dir = os.path.relpath(dirpath, root)
            for fname in sorted(fnames):
                if is_valid_file(os.path.join(dirpath, fname)):
                    entries.append((Path(rel_dir, fname).as_posix(), label))
        if len(entries) == before:
            empty.append(cls)
            if allow_empty:
                warnings.warn(f"class folder {cls!r} has no images; it keeps label {label} "
                              f"but contributes no samples", EmptyClassWarning, stacklevel=2)
    if empty and not allow_empty:
        shown = ", ".join(printable(c) for c in empty[:10]) + (" ..." if len(empty) > 10 else "")
        raise PackerError(f"found no images in the class folder(s) {shown} of {root} (as "
                          f"torchvision's ImageFolder refuses them); remove them, or keep them as "
                          f"classes without samples with --allow-empty (allow_empty=True)")
    return ImageList(root, classes, entries)


def walk(top: Path):
    """``os.walk(top, followlinks=True)`` (ImageFolder's walk), minus symlink loops.

    A link back to a folder's own ancestor would make os.walk descend until paths grow too
    long, packing the same images hundreds of times; such links are skipped with a warning.
    """
    for dirpath, dirnames, fnames in os.walk(top, followlinks=True):
        here = os.path.realpath(dirpath)
        for d in list(dirnames):
            there = os.path.realpath(os.path.join(dirpath, d))
            if here == there or here.startswith(there.rstrip(os.sep) + os.sep):
                dirnames.remove(d)
                warnings.warn(f"skipping {printable(os.path.join(dirpath, d))}: a symlink back "
                              f"to its own ancestor {printable(there)} (a loop)",
                              SymlinkLoopWarning, stacklevel=3)
        yield dirpath, dirnames, fnames


def read_list(root: os.PathLike, list_file: os.PathLike) -> ImageList:
    """``relative/path<TAB>label`` lines; labels are all integers or all class names."""
    root = Path(root)
    if not root.is_dir():
        raise PackerError(f"source folder {root} does not exist or is not a folder "
                          f"(list_file paths are relative to it)")
    rows: List[Tuple[str, str]] = []
    try:
        text = Path(list_file).read_text(encoding="utf-8")  # newlines: \n, \r\n or \r
    except UnicodeDecodeError as e:
        raise PackerError(f"{list_file} is not UTF-8 text ({e.reason} at byte {e.start}); "
                          f"save it as UTF-8") from None
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.rsplit("\t", 1)
        if len(parts) != 2 or not parts[0] or not parts[1].strip():
            raise PackerError(f"{list_file}:{n}: expected 'relative/path<TAB>label', got {line!r}")
        rel = parts[0]
        if os.path.isabs(rel) or ".." in Path(rel).parts:
            raise PackerError(f"{list_file}:{n}: path {rel!r} must be relative to {root} "
                              f"and stay inside it")
        rows.append((Path(rel).as_posix(), parts[1].strip()))
    if not rows:
        raise PackerError(f"{list_file} lists no images")
    labels = [lab for _, lab in rows]
    if all(_is_int(lab) for lab in labels):
        ints = [int(lab) for lab in labels]
        if min(ints) < 0:
            raise PackerError(f"{list_file}: labels must be >= 0")
        classes = [str(i) for i in range(max(ints) + 1)]
        return ImageList(root, classes, [(p, i) for (p, _), i in zip(rows, ints)])
    classes = sorted(set(labels))
    idx = {c: i for i, c in enumerate(classes)}
    return ImageList(root, classes, [(p, idx[lab]) for p, lab in rows])


def _is_int(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


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
    """Take one strided part (balanced across classes) and/or shuffle, reproducibly; the
    annotation rows follow their entries."""
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
