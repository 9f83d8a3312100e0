"""The package's shape, checked from its source (ast; nothing is imported): no import cycles,
no private name imported across modules, no function over 80 lines outside Triton kernels,
no module over 400 lines, the module map of docs/architecture.md (every package, what each may import) matches the tree,
and ``packer/__init__.py``'s three lists of the public API agree."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

PKG = Path(__file__).resolve().parents[1] / "packer"
ROOTS = [PKG, PKG.parent / "scripts", PKG.parent / "benchmarks", PKG.parent / "tests"]


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


def architecture_map() -> Dict[str, Set[str]]:
    """docs/architecture.md's module map: each package (or top-level module) of ``packer`` ->
    the ones its row says it may import."""
    text = (PKG.parent / "docs" / "architecture.md").read_text("utf-8")
    rows = re.findall(r"^\| `([\w.]+?)/?` \|.*\| ([^|]*) \|$", text, re.M)
    return {name[:-3] if name.endswith(".py") else name:
            {d.strip() for d in deps.split(",")} - {"", "—"} for name, deps in rows}


def test_architecture_map_matches_the_tree():
    """Every package and top-level module has its row in docs/architecture.md, and imports
    (anywhere) only what that row allows: the dependency direction the page describes."""
    doc = architecture_map()
    tops = {p.stem for p in PKG.glob("*.py")} | {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert set(doc) == tops - {"__init__", "__main__"}

    def top(module: str):
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else None
    bad = [f"{name} imports {dep}" for name, deps in edges(modules()).items()
           for dep in deps if top(name) not in (None, "__main__")
           and top(dep) not in (None, top(name)) and top(dep) not in doc[top(name)]]
    assert bad == []


def test_cycle_finder_finds_one():  # the check above can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_private_names_cross_modules():
    assert private_imports(ROOTS) == []


def test_private_import_finder_finds_one(tmp_path):
    (tmp_path / "m.py").write_text("from packer.reading.reader import _Shard\nfrom .x import __version__\n")
    assert private_imports([tmp_path]) == ["m.py:1 packer.reading.reader._Shard"]


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


def test_modules_have_one_job_each():
    """At most 400 lines a module: a longer one is doing more than one job."""
    sizes = {name: len(path.read_text("utf-8").splitlines()) for name, (path, _) in modules().items()}
    long = {name: n for name, n in sizes.items() if n > 400}
    assert long == {}


def lazy_packages() -> List[Path]:
    return [p for p in sorted(PKG.rglob("__init__.py")) if "_WHERE = " in p.read_text("utf-8")]


@pytest.mark.parametrize("init", lazy_packages(), ids=lambda p: str(p.parent.relative_to(PKG.parent)))
def test_lazy_exports_agree(init):
    """A package's lazy table (``_WHERE``), its ``__all__`` and, where present, its
    TYPE_CHECKING imports (for editors) name the same things, each from the same module."""
    tree = ast.parse(init.read_text("utf-8"))
    typed, where, listed = set(), {}, set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typed = {(a.name, "." * imp.level + imp.module) for imp in node.body for a in imp.names}
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_WHERE":
            where = ast.literal_eval(node.value)
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            listed = set(ast.literal_eval(node.value))
    pairs = {(n, m) for m, names in where.items() for n in names}
    assert {n for n, _ in pairs} >= listed
    assert not typed or typed == {p for p in pairs if p[0] in listed}


def test_public_api_is_small():
    import packer
    assert len(packer.__all__) <= 22


@pytest.mark.parametrize("init", lazy_packages(), ids=lambda p: str(p.parent.relative_to(PKG.parent)))
def test_no_submodule_shadows_an_exported_name(init):
    """``import packer.x.y`` sets the attribute ``y`` of ``packer.x``: a module named like a
    function it exports (``build``, ``merge``, ``stage``...) would replace the function."""
    folder = init.parent
    submodules = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir()
                                                          if p.is_dir()}
    tree = ast.parse(init.read_text("utf-8"))
    listed = next(set(ast.literal_eval(n.value)) for n in tree.body if isinstance(n, ast.Assign)
                  and ast.unparse(n.targets[0]) == "__all__")
    assert sorted(listed & submodules) == []


@pytest.mark.parametrize("name", ["build", "merge", "stage", "unstage", "verify"])
def test_top_level_functions_are_functions(name):
    import importlib
    import packer
    for mod in ("writing.builder", "writing.merger", "staging", "info", "cli"):
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
