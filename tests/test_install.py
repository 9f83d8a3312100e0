"""A plain ``pip install`` gives a working tool (issue 27): the project installed without extras
into a fresh virtual environment that already has torch (and nothing else), then the
commands a new user runs first.

torch comes from this environment through a ``.pth`` file naming a folder of links to torch
and the packages it requires (no copy of gigabytes, no other package of this environment):
so torchvision, torchdata and matplotlib are missing there, as after ``pip install
packer-lmdb``. pip fetches packer's own requirements (Pillow, numpy, lmdb, ...) from the
package index, as a user's would (this environment's pip installs into the new one,
``pip --python``: making a venv with its own pip takes longer than the test).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_LINKED = {"..", "__pycache__", "_distutils_hack", "setuptools", "pkg_resources"}

pytestmark = pytest.mark.slow


def torch_closure() -> list:
    """torch's distribution and those it requires, recursively (markers evaluated here)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    seen, todo = {}, ["torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name == "setuptools":
            continue
        try:
            seen[name] = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for text in seen[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def link_torch(folder: Path) -> None:
    folder.mkdir()
    for dist in torch_closure():
        site = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or []} - NOT_LINKED:
            if not top.endswith(".pth") and not (folder / top).exists():
                (folder / top).symlink_to(site / top)


def run(*cmd, env=None, timeout=600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd="/")  # not the checkout: `python -c` imports from cwd
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("install")
    src = base / "src"  # a copy: pip builds in-tree, and must not write into the checkout
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".pytest_cache"))
    run(sys.executable, "-m", "venv", "--without-pip", base / "venv")
    link_torch(base / "torch")
    py = base / "venv" / "bin" / "python"
    purelib = run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(purelib, "torch-from-the-test.pth").write_text(f"{base / 'torch'}\n")
    run(sys.executable, "-m", "pip", "--python", py, "install", "-q", src)
    return base / "venv"


def env_of(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_installed_packer_is_this_one_with_stock_pillow(venv):
    code = ("import packer, PIL, numpy, sys; from importlib import metadata as m; "
            "print(packer.__file__); print(PIL.__file__); print(m.version('packer-lmdb')); "
            "print(m.version('pillow'))")
    lines = run(venv / "bin" / "python", "-c", code, env=env_of(venv)).stdout.splitlines()
    assert all(line.startswith(str(venv)) for line in lines[:2]), lines
    import packer
    assert lines[2] == packer.__version__ and lines[3]
    for missing in ("torchvision", "torchdata", "matplotlib"):
        done = subprocess.run([venv / "bin" / "python", "-c", f"import {missing}"],
                              capture_output=True, env=env_of(venv), cwd="/")
        assert done.returncode != 0, f"{missing} should not be in the fresh environment"


def test_packer_demo_doctor_build_info(venv, photo_src, tmp_path):
    env = env_of(venv)
    assert run(venv / "bin" / "packer", "--version", env=env).stdout.startswith("packer ")
    assert run(venv / "bin" / "python", "-m", "packer", "--version", env=env).stdout.startswith("packer ")
    doctor = run("packer", "doctor", env=env).stdout.splitlines()
    assert "torchvision not installed: pip install torchvision (for GPU decoding with nvJPEG, " \
           "tv_tensors detection targets, bench --model)" in doctor
    demo = run("packer", "demo", "--images", "48", "--classes", "4", "-j", "1", "-b", "8", "-q",
               env=env)
    assert "packed loader" in demo.stdout and "NumPy" not in demo.stderr, demo.stderr
    run("packer", "build", photo_src, tmp_path / "d", "-q", env=env)
    assert run("packer", "info", tmp_path / "d", env=env).stdout.startswith(f"{tmp_path / 'd'}: 48 images")
    done = subprocess.run(["packer", "bench", tmp_path / "d", "--plot", tmp_path / "p.png"],
                          capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert done.returncode == 1 and done.stderr.startswith(
        "Error: --plot needs matplotlib: pip install matplotlib"), done.stderr
    assert len(done.stderr.splitlines()) == 1
