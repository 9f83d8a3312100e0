"""Looking never imports torch (issue 27): ``packer --version``, ``--help``, ``info``, ``ls``,
``cat``, ``verify --quick`` and ``doctor`` run one after another in a fresh interpreter,
which must hold no torch (nor numpy or torchvision, which only torch code needs here) in
``sys.modules`` after each of them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import packer_env
from packer import build

RUN = """
import contextlib, io, json, runpy, sys
out = []
for argv in json.loads(sys.argv[1]):
    sys.argv, text = ["packer"] + argv, io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_module("packer", run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    heavy = sorted(m for m in ("torch", "numpy", "torchvision") if m in sys.modules)
    out.append([argv, code, heavy, text.getvalue()])
print(json.dumps(out))
"""

COMMANDS = [["--version"], ["--help"], ["info", "DST"], ["info", "DST", "--json"],
            ["ls", "DST"], ["ls", "DST", "--json"], ["cat", "DST", "3", "-o", "OUT"],
            ["verify", "DST", "--quick"], ["verify", "DST", "--quick", "--json"], ["doctor"],
            ["doctor", "--json"]]


@pytest.fixture(scope="module")
def dataset(photo_src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("inspect") / "ds"
    build(photo_src, dst, workers=0, progress=False)
    return dst


def run(argvs) -> list:
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(argvs)], capture_output=True,
                          text=True, env=packer_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_inspection_does_not_import_torch(dataset, tmp_path):
    argvs = [[str(dataset) if a == "DST" else str(tmp_path / "x.jpg") if a == "OUT" else a
              for a in cmd] for cmd in COMMANDS]
    for argv, code, heavy, text in run(argvs):
        assert code == 0, (argv, text)
        assert heavy == [], f"`packer {' '.join(argv)}` imported {heavy}"
        if argv[-1] == "--json":
            assert isinstance(json.loads(text.splitlines()[0] if argv[0] == "ls" else text), dict)
    assert (tmp_path / "x.jpg").stat().st_size > 0


def test_a_full_verify_may(dataset):
    """The control: the check fails where torch is needed (the targets of a full verify)."""
    [(_, code, heavy, _)] = run([["verify", str(dataset), "-q"]])
    assert code == 0 and "torch" in heavy
