"""torchvision's ImageFolder layout and ``relative/path<TAB>label`` lists: classification, with
torchvision's class order and walk exactly, so label *i* means the same class."""
from __future__ import annotations

import os
import posixpath
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import PackerError
from .._util.text import is_utf8, printable
from ..storage.files import RemoteFolder, folder, source_file
from ..storage.urls import is_url
from .base import (DEFAULT_MAX_CLASSES, IMG_EXTENSIONS, EmptyClassWarning, ImageList, Source,
                   class_labels, read_text, relative_path, walk_files, walk_order)


class ImageFolder(Source):
    """``root/CLASS/.../IMAGE`` with torchvision's ``ImageFolder`` rules (``extensions`` or
    ``is_valid_file``, not both); an empty class folder is an error unless ``allow_empty``."""

    def __init__(self, root: os.PathLike, extensions: Optional[Sequence[str]] = None,
                 is_valid_file: Optional[Callable[[str], bool]] = None,
                 allow_empty: bool = False, *, storage_options: Optional[dict] = None):
        if isinstance(extensions, str):  # one extension, as torchvision takes it
            extensions = (extensions,)
        self.root, self.extensions = folder(root, storage_options), extensions
        self.is_valid_file, self.allow_empty = is_valid_file, allow_empty

    def read(self) -> ImageList:
        found = scan_folder(self.root, extensions=self.extensions,
                            is_valid_file=self.is_valid_file, allow_empty=self.allow_empty)
        if not found.entries:
            raise PackerError(f"found no images in {self.root} (extensions: "
                              f"{', '.join(self.extensions or IMG_EXTENSIONS)}, any case); "
                              f"nothing to pack")
        return found

    def options(self) -> Dict[str, Any]:
        given = {"allow_empty": self.allow_empty or None,
                 "extensions": ",".join(self.extensions) if self.extensions else None,
                 "is_valid_file": getattr(self.is_valid_file, "__qualname__", None)}
        return {k: v for k, v in given.items() if v is not None}

    def check_destination(self, dst: Path) -> None:
        if isinstance(self.root, RemoteFolder):
            return  # a local DST is never inside a folder in object storage
        dst, root = Path(dst).resolve(), self.root.resolve()
        if dst == root or root in dst.parents:
            raise PackerError(f"DST {dst} is inside the image folder {self.root}: it would "
                              f"become a class of its own source; put the dataset elsewhere")


class FileList(Source):
    """The images ``list_file`` lists, ``relative/path<TAB>label`` lines (``#`` comments skipped;
    labels all integers or all class names), paths relative to ``root`` (default: its folder)."""

    def __init__(self, list_file: os.PathLike, root: Optional[os.PathLike] = None, *,
                 max_classes: int = DEFAULT_MAX_CLASSES, storage_options: Optional[dict] = None):
        self.list_file = source_file(list_file, storage_options)
        if root is None:
            root = posixpath.dirname(list_file) if is_url(list_file) else self.list_file.parent
        self.root, self.max_classes = folder(root, storage_options), max_classes

    def read(self) -> ImageList:
        return read_list(self.root, self.list_file, max_classes=self.max_classes)

    def options(self) -> Dict[str, Any]:
        return {"list": str(self.list_file)}


def find_classes(root: os.PathLike) -> List[str]:
    """Immediate subfolders (symlinks followed), sorted by code point as torchvision does."""
    root = Path(root)
    if not root.is_dir():
        raise PackerError(f"ImageFolder(root): {root} does not exist or is not a folder")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    for c in classes:
        if not is_utf8(c):
            raise PackerError(f"class folder '{printable(c)}' in {root} has a name that is not valid "
                              f"UTF-8, so it cannot be a class name in the manifest: rename it "
                              f"(e.g. `convmv -r -f latin1 -t utf8 --notest {root}`)")
    if not classes:
        raise PackerError(
            f"no class folders in {root}: expected ImageFolder layout ROOT/CLASS/IMAGE "
            f"(or pack a FileList: 'relative/path<TAB>label' lines)")
    return classes


def scan_folder(root: os.PathLike, *, extensions: Optional[Sequence[str]] = None,
                is_valid_file: Optional[Callable[[str], bool]] = None,
                allow_empty: bool = False) -> ImageList:
    """``root`` in ImageFolder order by torchvision's ``make_dataset`` rules (classes sorted, files
    recursive and sorted); a ``RemoteFolder``'s objects as they would lie in folders."""
    root = folder(root)
    if extensions is not None and is_valid_file is not None:
        raise PackerError("ImageFolder(root, extensions, is_valid_file): pass extensions or "
                          "is_valid_file, not both (as torchvision's ImageFolder)")
    if is_valid_file is None:
        exts = (extensions,) if isinstance(extensions, str) else extensions or IMG_EXTENSIONS
        exts = tuple(e.lower() for e in exts)
        is_valid_file = lambda path: path.lower().endswith(exts)  # noqa: E731
    if isinstance(root, RemoteFolder):
        tree = remote_tree(root)
        classes = sorted(tree)
        if not classes:
            raise PackerError(f"ImageFolder(root): no objects in class folders under {root}: "
                              f"expected ROOT/CLASS/IMAGE (a wrong URL or credentials?)")
        listing = lambda cls: [r for r in tree[cls] if is_valid_file(root / f"{cls}/{r}")]  # noqa: E731
    else:
        classes = find_classes(root)
        listing = lambda cls: walk_files(root / cls, is_valid_file)  # noqa: E731
    entries: List[Tuple[str, int]] = []
    empty = []
    for label, cls in enumerate(classes):
        found = listing(cls)
        entries.extend((Path(cls, rel).as_posix(), label) for rel in found)
        if not found:
            empty.append(cls)
            if allow_empty:
                warnings.warn(f"class folder {cls!r} has no images; it keeps label {label} "
                              f"but contributes no samples", EmptyClassWarning, stacklevel=2)
    if empty and not allow_empty:
        shown = ", ".join(printable(c) for c in empty[:10]) + (" ..." if len(empty) > 10 else "")
        raise PackerError(f"found no images in the class folder(s) {shown} of {root} (as "
                          f"torchvision's ImageFolder refuses them); remove them, or keep them as "
                          f"classes without samples: ImageFolder(root, allow_empty=True)")
    return ImageList(root, classes, entries)


def remote_tree(root: RemoteFolder) -> Dict[str, List[str]]:
    """Class -> the paths of the objects below it, in ``walk_files``'s order."""
    tree: Dict[str, List[str]] = {}
    for rel in root.sizes():
        cls, sep, rest = rel.partition("/")
        if sep:
            tree.setdefault(cls, []).append(rest)
    for files in tree.values():
        files.sort(key=walk_order)
    return tree


def read_list(root: os.PathLike, list_file: os.PathLike, *,
              max_classes: int = DEFAULT_MAX_CLASSES) -> ImageList:
    """``relative/path<TAB>label`` lines; labels are all integers or all class names."""
    root = folder(root)
    if not root.is_dir():
        raise PackerError(f"FileList(list_file, root): root {root} does not exist or is not a "
                          f"folder (list_file's paths are relative to it)")
    rows: List[Tuple[str, str, int]] = []
    text = read_text(source_file(list_file), "list_file")
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # as universal newlines read
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.rsplit("\t", 1)
        if len(parts) != 2 or not parts[0] or not parts[1].strip():
            raise PackerError(f"{list_file}:{n}: expected 'relative/path<TAB>label', got {line!r}")
        rel, why = relative_path(parts[0])
        if why:
            raise PackerError(f"{list_file}:{n}: path {printable(parts[0])} {why} ({root})")
        rows.append((rel, parts[1].strip(), n))
    if not rows:
        raise PackerError(f"{list_file} lists no images")
    try:
        labels = [int(lab) for _, lab, _ in rows]
    except ValueError:  # not all integers: class names
        labels = [lab for _, lab, _ in rows]
    else:
        if min(labels) < 0:
            raise PackerError(f"{list_file}: labels must be >= 0")
    labels, classes = class_labels(labels, lambda i: f"{list_file}:{rows[i][2]}", max_classes)
    return ImageList(root, classes, [(p, lab) for (p, _, _), lab in zip(rows, labels)])
