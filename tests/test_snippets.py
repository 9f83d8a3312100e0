"""Every ```python block in README.md and docs/*.md runs as written.

Each block is a whole program: it makes its own data with ``packer.demo`` (under
``/tmp/packer-docs``), and its GPU parts degrade as the docs say when there is no CUDA. Each
runs in a fresh interpreter whose working directory is an empty temporary folder. A block
that needs an optional package which does not import here (torchvision, torchdata:
``scripts/setup.sh`` installs both) is skipped, saying so; so is a block whose first line is
``# not runnable: <why>``.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
NOT_RUNNABLE = "# not runnable:"
# Optional packages some snippets need (scripts/setup.sh installs both), and what shows it:
# an import, or make_loader(stateful=True), which returns torchdata's StatefulDataLoader.
OPTIONAL = {"torchvision": r"^\s*(import|from)\s+torchvision\b",
            "torchdata": r"^\s*(import|from)\s+torchdata\b|\bstateful=True"}
TIMEOUT = 120
DOCS_DATA = "/tmp/packer-docs"  # where the snippets make their data
STAGED = Path("/dev/shm/packer-docs-train")  # where docs/staging.md's snippets stage


class Snippet(NamedTuple):
    path: Path
    line: int  # of the snippet's first line of code, 1-based
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def python_blocks(path: Path) -> List[Snippet]:
    """The ```python fenced blocks of a Markdown file, dedented by their fence's indent."""
    lines = path.read_text("utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^( *)```python\s*$", lines[i])
        if m is None:
            i += 1
            continue
        indent, start = len(m.group(1)), i + 1
        end = start
        while end < len(lines) and not re.match(r"^ *```\s*$", lines[end]):
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 1}: the ```python block is never closed")
        code = "\n".join(line[indent:] if line[:indent].strip() == "" else line
                         for line in lines[start:end])
        blocks.append(Snippet(path, start + 1, code + "\n"))
        i = end + 1
    return blocks


SNIPPETS = [s for md in MARKDOWN for s in python_blocks(md)]


@functools.lru_cache(maxsize=None)
def importable(module: str) -> bool:
    """Whether ``module`` imports in a fresh interpreter (a broken install counts as absent)."""
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          timeout=TIMEOUT).returncode == 0


def missing_optional(code: str) -> List[str]:
    return [m for m, used in OPTIONAL.items()
            if re.search(used, code, flags=re.M) and not importable(m)]


def snippet_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):  # one process, even when the tests run under a launcher
        env.pop(var, None)
    return env


@pytest.fixture(scope="module", autouse=True)
def free_staged_copy():
    """The staging snippets leave a small copy in /dev/shm as a job would; free the RAM."""
    yield
    if (STAGED / ".packer-stage.json").exists():
        from packer import unstage
        unstage(STAGED)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, tmp_path):
    first = snippet.code.lstrip().splitlines()[0] if snippet.code.strip() else ""
    if first.startswith(NOT_RUNNABLE):
        pytest.skip(first[len(NOT_RUNNABLE):].strip() or "marked not runnable")
    missing = missing_optional(snippet.code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, which does not import here "
                    f"(scripts/setup.sh installs it)")
    script = tmp_path / "snippet.py"
    # The docs write under /tmp/packer-docs; each run gets its own copy of that folder, so
    # two test runs on one machine (or a reader trying the docs meanwhile) never collide.
    script.write_text(snippet.code.replace(DOCS_DATA, str(tmp_path / "packer-docs")), "utf-8")
    work = tmp_path / "cwd"
    work.mkdir()
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=work, env=snippet_env(),
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{snippet.id} ran over {TIMEOUT} s:\n{e.stderr or ''}")
    assert done.returncode == 0, (
        f"{snippet.id} exited with {done.returncode}:\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-6000:]}")


def test_every_doc_with_code_has_runnable_snippets():
    files = {s.path.name for s in SNIPPETS}
    assert {"README.md", "loading.md", "sampling.md", "staging.md", "gpu_decode.md",
            "annotations.md"} <= files
    marked = [s.id for s in SNIPPETS if s.code.lstrip().startswith(NOT_RUNNABLE)]
    assert len(marked) <= 2, f"too many snippets marked not runnable: {marked}"


def test_block_finder_dedents_and_numbers_lines(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("text\n```python\nx = 1\n```\n1. item\n\n   ```python\n   if x:\n       y = 2\n"
                  "   ```\n```bash\nls\n```\n", "utf-8")
    blocks = python_blocks(md)
    assert [(b.line, b.code) for b in blocks] == [(3, "x = 1\n"), (8, "if x:\n    y = 2\n")]
