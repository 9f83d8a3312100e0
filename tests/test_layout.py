"""The package's shape, checked from its source (ast; nothing is imported): no import cycles,
no private name imported across modules, no function over 80 lines outside Triton kernels,
and ``packer/__init__.py``'s three lists of the public API agree."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

PKG = Path(__file__).resolve().parents[1] / "packer"
ROOTS = [PKG, PKG.parent / "scripts", PKG.parent / "tests"]


def modules() -> Dict[str, Tuple[Path, ast.AST]]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (path, ast.parse(path.read_text("utf-8"), str(path)))
    return out


def imported(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in module ``name`` reads from."""
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(mods) -> Dict[str, Set[str]]:
    """Module -> the packer modules it imports (anywhere: top level, functions, TYPE_CHECKING),
    leaving out a package importing its own submodules and the reverse (not cycles)."""
    out: Dict[str, Set[str]] = {}
    for name, (path, tree) in mods.items():
        deps = out.setdefault(name, set())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = imported(name, path, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in mods and t != name and not t.startswith(name + ".") \
                        and not name.startswith(t + "."):
                    deps.add(t)
    return out


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def private_imports(roots) -> List[str]:
    """``from packer.x import _y`` anywhere in the package, scripts or tests (a module's own
    names and dunders excepted)."""
    bad = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text("utf-8"), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom):
                    continue
                source = node.module or ""
                if not (node.level > 0 or source == "packer" or source.startswith("packer.")):
                    continue
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{path.name}:{node.lineno} {source}.{a.name}")
    return bad


def test_no_import_cycles():
    assert find_cycle(edges(modules())) == []


def test_cycle_finder_finds_one():  # the check above can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_private_names_cross_modules():
    assert private_imports(ROOTS) == []


def test_private_import_finder_finds_one(tmp_path):
    (tmp_path / "m.py").write_text("from packer.reader import _Shard\nfrom .x import __version__\n")
    assert private_imports([tmp_path]) == ["m.py:1 packer.reader._Shard"]


def test_functions_fit_on_a_screen():
    long = []
    for name, (path, tree) in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
                size = node.end_lineno - node.lineno + 1
                if size > 80 and not jit:
                    long.append(f"{name}.{node.name}: {size} lines")
    assert long == []


def test_public_api_lists_agree():
    """TYPE_CHECKING imports (for editors), the lazy table and __all__ name the same things."""
    tree = ast.parse((PKG / "__init__.py").read_text("utf-8"))
    typed, lazy, listed = set(), {}, set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for imp in node.body:
                for a in imp.names:
                    typed.add(a.name)
                    lazy_module = imp.module
                    typed.add(f"{a.name}@{lazy_module}")
        elif isinstance(node, ast.Assign) and node.targets[0].id == "_LAZY":
            lazy = ast.literal_eval(node.value)
        elif isinstance(node, ast.Assign) and node.targets[0].id == "__all__":
            listed = set(ast.literal_eval(node.value))
    names = {n for n in typed if "@" not in n}
    assert names == set(lazy) == listed - {"__version__"}
    assert {f"{n}@{m}" for n, m in lazy.items()} == {n for n in typed if "@" in n}


def test_no_submodule_shadows_an_exported_function():
    """``import packer.x`` sets the attribute ``packer.x``: a module named like an exported
    function (``build``, ``merge``, ``stage``...) would replace the function."""
    import packer
    submodules = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if p.is_dir()}
    assert sorted(set(packer.__all__) & submodules) == []


@pytest.mark.parametrize("name", ["build", "merge", "stage", "unstage", "verify"])
def test_top_level_functions_are_functions(name):
    import importlib
    import packer
    for mod in ("builder", "merging", "staging", "info", "cli"):
        importlib.import_module(f"packer.{mod}")  # importing every module must not shadow them
    assert callable(getattr(packer, name)) and not isinstance(getattr(packer, name), type(packer))


def test_importing_packer_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, packer, packer.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_importing_gpu_does_not_touch_the_environment():
    import subprocess
    import sys
    code = ("import os; os.environ.pop('CUDA_DEVICE_MAX_CONNECTIONS', None); import packer.gpu; "
            "print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_no_scripts_path_in_library_messages():
    """Library text never sends a pip user to files only the repository has."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if "bench" in path.relative_to(PKG).parts:
            continue  # benchmark machinery: run from the repository by definition
        for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            if re.search(r"scripts/\w+\.(sh|py)", line):
                bad.append(f"{path.relative_to(PKG.parent)}:{n}")
    assert bad == []
