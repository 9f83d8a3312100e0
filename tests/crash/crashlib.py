"""Crash points for real: run a packer command under ``strace``, SIGKILL it at its N-th
write-like system call, re-run the same command without the kill, and compare the outcome
with an uninterrupted run (the documented remedy: "re-run the same command").

``strace -e inject=CALL:signal=SIGKILL:when=N`` counts each call per thread, so a crash point
is a (call, N) pair, and the commands run single-process (``--workers 0``); a thread that
writes (LMDB's compacting copy, staging's checker) adds its own points. A scenario is: a ``prepare(folder)`` that lays out the state before the command, the
command's argv, and ``outcome(folder)``: what the command left (file names with hashes,
manifests without their timestamps).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
STRACE = shutil.which("strace")
# Every call by which a command changes the disk (or says something, on its last lines).
SYSCALLS = ("write,writev,pwrite64,pwritev,pwritev2,rename,renameat,renameat2,fsync,"
            "fdatasync,msync,ftruncate,unlink,unlinkat,mkdir,mkdirat,rmdir,flock")


@dataclass
class Scenario:
    name: str
    prepare: Callable[[Path], None]   # the state the command starts from, in the folder
    argv: Callable[[Path], List[str]]  # the command, given the folder
    outcome: Callable[[Path], dict]    # what it left, comparable between runs


def env() -> Dict[str, str]:
    e = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(ROOT))
    e.pop("PYTHONSTARTUP", None)
    return e


def run(argv: List[str], inject: Tuple[str, int] = None, trace: Path = None) -> subprocess.CompletedProcess:
    """``argv`` (a Python command line), SIGKILLed at the N-th call of ``inject = (CALL, N)``."""
    pre = []
    if inject:
        pre = [STRACE, "-f", "-qq", "-o", os.devnull,
               "-e", f"trace={inject[0]}", "-e", f"inject={inject[0]}:signal=SIGKILL:when={inject[1]}"]
    elif trace is not None:
        pre = [STRACE, "-f", "-qq", "-o", str(trace), "-e", f"trace={SYSCALLS}"]
    return subprocess.run(pre + [sys.executable, "-B", *argv], capture_output=True, text=True,
                          env=env(), timeout=120)


def crash_points(s: Scenario, folder: Path) -> List[Tuple[str, int]]:
    """Every (call, N) at which an uninterrupted run (in ``folder``) can be killed: N up to
    the most times one of its threads makes that call."""
    s.prepare(folder)
    log = folder.parent / (folder.name + ".strace")
    proc = run(s.argv(folder), trace=log)
    assert proc.returncode == 0, proc.stderr
    per: Dict[Tuple[str, str], int] = {}
    for line in log.read_text().splitlines():
        pid, _, rest = line.partition(" ")
        call = rest.strip().split("(", 1)[0]
        if pid.isdigit() and call.isidentifier():
            per[pid, call] = per.get((pid, call), 0) + 1
    log.unlink()
    most: Dict[str, int] = {}
    for (_, call), n in per.items():
        most[call] = max(most.get(call, 0), n)
    return [(call, n) for call in sorted(most) for n in range(1, most[call] + 1)]


def crash_and_rerun(s: Scenario, folder: Path, n: Tuple[str, int]) -> dict:
    """Kill at crash point ``n``, re-run; the re-run's outcome (raises with its error if it fails)."""
    s.prepare(folder)
    killed = run(s.argv(folder), inject=n)
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), \
        f"{s.name}: call {n} did not kill it (exit {killed.returncode}): {killed.stderr[-500:]}"
    again = run(s.argv(folder))
    if again.returncode != 0:
        raise AssertionError(f"{s.name}: re-run after a kill at call {n} failed "
                             f"(exit {again.returncode}): {again.stderr.strip()[-800:]}")
    return s.outcome(folder)


def sample(points: list, k: int) -> list:
    """``k`` of ``points`` spread evenly, first and last included."""
    if k >= len(points):
        return list(points)
    return [points[i] for i in sorted({round(i * (len(points) - 1) / (k - 1)) for i in range(k)})]


# -- outcomes --------------------------------------------------------------------------------

TIME_KEYS = ("created", "build_id")  # differ between any two runs


def folder_state(folder: Path) -> dict:
    """Every entry under ``folder``: files by SHA-256 (JSON files without timestamps)."""
    out = {}
    if not folder.exists():
        return {"<missing>": True}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_dir():
            out[rel] = "dir"
        elif p.suffix == ".json" and p.name != ".packer-build.json":  # the journal has lines
            out[rel] = _strip(json.loads(p.read_text("utf-8")))
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in TIME_KEYS}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj
