"""Writing only where packer was asked to, and only files it created: every file is created new
(``O_CREAT | O_EXCL | O_NOFOLLOW``) and renamed into place, so a planted symlink is never
written through; ``check_folder`` refuses a wrong folder; ``FolderLock``: one writer."""
from __future__ import annotations

import errno
import json
import os
import stat
from contextlib import suppress
from pathlib import Path
from typing import Any, Iterable, Optional

from ..errors import PackerError

LOCK_NAME = ".packer-lock"  # one per folder packer writes: DST of build/merge, TARGET of stage
SAFE_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)  # no symlink, not inherited
DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def open_new(path: os.PathLike):
    """``path`` created new, for binary writing, never through a symlink (a leftover of that
    name is unlinked first: the link itself, never its target)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | SAFE_FLAGS, 0o644)
    except FileExistsError:
        raise PackerError(f"{path} appeared while packer was creating it: another process is "
                          f"writing in {path.parent}; stop it and re-run") from None
    return os.fdopen(fd, "wb")


def write_new_atomic(path: os.PathLike, data: bytes) -> None:
    """``data`` to ``path`` via a new temp file, fsynced, then renamed: old or new, never half,
    and nothing left behind if writing fails."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open_new(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: os.PathLike, obj: Any) -> None:
    """``obj`` as indented UTF-8 JSON, atomically (see ``write_new_atomic``)."""
    text = json.dumps(obj, indent=1, ensure_ascii=False) + "\n"
    write_new_atomic(path, text.encode("utf-8"))


def append_durably(path: os.PathLike, data: bytes) -> None:
    """``data`` appended to the existing file ``path`` (never through a symlink), fsynced; a
    write that fails part-way (a full disk) is cut off again: the file ends where it did."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | SAFE_FLAGS)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            with suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def fsync_dir(path: os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_own(folder: Path, name: str) -> bool:
    """Delete ``folder/name`` if it is a regular file or a link (the link itself); True if it
    was there. Callers pass only names their own records list."""
    try:
        (folder / name).unlink()
        return True
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        raise PackerError(f"{folder / name} is a folder where packer keeps a file; move it away") from None


def check_folder(folder: os.PathLike, *, marks: Iterable[str], leftovers: Iterable[str] = (),
                 fix: str) -> None:
    """Refuse, before anything is written, a ``folder`` packer must not write into (a file, not
    creatable or writable, or non-empty with none of ``marks`` and more than ``leftovers``);
    ``fix`` ends the message."""
    folder = Path(folder)
    lock_module()
    try:
        names = set(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        if os.path.lexists(folder):
            raise PackerError(f"{folder} is a file, not a folder") from None
        return _check_creatable(folder)
    except OSError as e:
        raise PackerError(f"cannot read the folder {folder}: {e.strerror}") from None
    if names and not names & set(marks) and names - set(leftovers):
        shown = ", ".join(sorted(names)[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise PackerError(f"{folder} is not empty ({shown}) and holds no packer dataset; packer "
                          f"writes only into a new or empty folder or its own dataset, and does "
                          f"not delete files it did not write: {fix}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PackerError(f"cannot write in {folder}: {_why_not_writable(folder)}")


def lock_module():
    """``fcntl``, which packer's writers lock folders with; a PackerError where it is absent."""
    try:
        import fcntl
    except ImportError:  # Windows
        raise PackerError("writing a dataset needs file locks (fcntl), which this platform "
                          "lacks: build, merge, write and stage run on Linux and macOS") from None
    return fcntl


def _check_creatable(folder: Path) -> None:
    """A missing ``folder`` can be made: its first missing level is made and removed again
    (what fails there — a read-only filesystem, /proc, no permission — is the reason)."""
    probe = folder.absolute()
    while not os.path.lexists(probe.parent) and probe.parent != probe:
        probe = probe.parent
    if not probe.parent.is_dir():
        raise PackerError(f"cannot create {folder}: {probe.parent} is a file, not a folder")
    try:
        os.mkdir(probe)
    except FileExistsError:  # made meanwhile (a concurrent run); it is checked when locked
        return
    except OSError as e:
        reason = _why_not_writable(probe.parent) if e.errno in DENIED else \
            f"{e.strerror} (the filesystem of {probe.parent} does not take new folders)"
        raise PackerError(f"cannot create {folder}: {reason}") from None
    with suppress(OSError):  # removed or filled meanwhile by a concurrent run: checked when locked
        os.rmdir(probe)


def _why_not_writable(folder: Path) -> str:
    with suppress(OSError, AttributeError):
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only filesystem"
    return f"permission denied in {folder}"


class FolderLock:
    """One packer writer per folder: an exclusive ``flock`` on ``FOLDER/.packer-lock``, held
    from the first write to the last. A second writer fails at once, naming the holder."""

    def __init__(self, folder: os.PathLike, what: str):
        self.folder, self.what = Path(folder), what
        self.fd: Optional[int] = None

    def __enter__(self) -> "FolderLock":
        self.fcntl = fcntl = lock_module()
        path = self.folder / LOCK_NAME
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | SAFE_FLAGS, 0o644)
            except FileNotFoundError:
                raise PackerError(f"{self.folder} was removed (by a concurrent unstage?) before "
                                  f"packer could lock it; re-run") from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise PackerError(f"{path} is a symlink; packer locks only files it creates. "
                                      f"Remove it (it may have been planted) and re-run") from None
                why = _why_not_writable(self.folder) if e.errno in DENIED else e.strerror
                raise PackerError(f"cannot lock {self.folder} ({path}): {why}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
                os.close(fd)
                raise PackerError(f"{self.folder} is being written by another packer process "
                                  f"({holder}); wait for it to finish, or pick another folder") from None
            if _same_file(fd, path):
                break
            os.close(fd)  # the holder removed the file as it finished: lock the new one
        with suppress(OSError):  # who holds it, for a second writer's message (a full disk: none)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}, {self.what}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            # Removed while still held, so the folder is left as it was found.
            (self.folder / LOCK_NAME).unlink(missing_ok=True)
            self.fcntl.flock(self.fd, self.fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a removed file's lock is no lock)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


NOT_REGULAR = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


class NotAFile(OSError):
    """Why an input file was not read: not a regular file, or over its size limit (an
    OSError, so callers reporting unreadable files report these too)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.strerror = reason


def read_file(path: os.PathLike, limit: Optional[int] = None, limit_name: str = "the limit") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` (``limit_name`` names it). Checked
    on the open descriptor, a FIFO opened non-blocking, so no swapped-in device can hang or
    flood it. Raises ``NotAFile`` saying why, or the ``OSError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = NOT_REGULAR.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise NotAFile(f"{kind}, not a regular file: only regular files are read")
        if limit is not None and st.st_size > limit:
            raise NotAFile(f"{st.st_size:,} bytes, more than {limit_name} ({limit:,})")
        chunks, left = [], st.st_size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 30))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        raise NotAFile("it holds more bytes than its size says (it is growing, or not a "
                       "stored file, e.g. one in /proc)")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
