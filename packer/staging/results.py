"""What ``stage`` and ``unstage`` did, and the message that tells the user what to do next."""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from .._util.system import human_size
from .copy import tmpfs_advice

RAM_FS = frozenset({"tmpfs", "ramfs"})


@dataclass
class StageResult:
    """What ``stage`` did. ``message()`` says where the data is and how to train from it."""
    source: Path
    target: Path
    copied: List[str] = field(default_factory=list)    # names written in TARGET by this run
    kept: List[str] = field(default_factory=list)      # names already there and verified
    removed: List[str] = field(default_factory=list)   # stale or damaged files deleted first
    bytes_copied: int = 0
    bytes_total: int = 0                               # every file of the staged dataset
    seconds: float = 0.0
    fstype: str = ""
    swap: bool = False                                 # the machine has swap enabled
    waited: bool = False                               # another rank staged; this one waited
    wrote_manifest: bool = False                       # manifest written last by this run

    @property
    def changed(self) -> bool:
        return bool(self.copied or self.removed or self.wrote_manifest)

    def message(self) -> str:
        t = os.path.abspath(self.target)
        n = len(self.copied) + len(self.kept)
        if self.waited:
            head = f"{t} was staged by this node's local rank 0 ({human_size(self.bytes_total)})"
        elif not self.changed:
            head = (f"{t} already holds a complete copy of {self.source} "
                    f"({n} files + manifest, {human_size(self.bytes_total)}, checked): nothing to do")
        else:
            rate = self.bytes_copied / max(self.seconds, 1e-9)
            head = (f"staged {self.source} -> {t}: copied {len(self.copied)} file(s) + manifest, "
                    f"{human_size(self.bytes_copied)} in {self.seconds:.1f} s ({human_size(rate)}/s)"
                    + (f", kept {len(self.kept)} already there" if self.kept else "")
                    + (f", replaced {len(self.removed)} damaged or stale" if self.removed else ""))
        lines = [head]
        if self.fstype in RAM_FS:
            lines.append(f"The data is in RAM ({self.fstype}).")
            if self.swap:
                lines.append("Note: this machine has swap, and tmpfs pages can be swapped out under "
                             "memory pressure; check `vmstat 1` (si/so) stays at 0 while training "
                             "(docs/staging.md).")
        elif self.fstype:
            lines.append(f"Note: {t} is on {self.fstype}, not in RAM; stage to /dev/shm or a "
                         f"tmpfs mount ({tmpfs_advice(self.bytes_total)}) to read from memory.")
        lines.append(f"Train from it with no other change: PackedDataset({t!r})")
        lines.append(f"Free the space when done: packer unstage {shlex.quote(t)}")
        return "\n".join(lines)


@dataclass
class UnstageResult:
    target: Path
    removed: List[str]
    bytes_freed: int
    removed_dir: bool

    def message(self) -> str:
        if not self.removed and not self.removed_dir and not os.path.lexists(self.target):
            return f"nothing to unstage: {self.target} does not exist (removed already?)"
        where = "and the folder" if self.removed_dir else "(the folder holds other files: kept)"
        return (f"removed {len(self.removed)} staged file(s) from {self.target} {where}; "
                f"freed {human_size(self.bytes_freed)}")
