"""Looking never imports torch (issue 27): ``packer --version``, ``--help``, ``info``, ``ls``,
``cat``, ``verify --quick`` and ``doctor`` each run in a fresh interpreter, which must end
without torch (or numpy, which only torch needs here) in ``sys.modules``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import packer_env
from packer import build

RUN = """
import runpy, sys
sys.argv = ["packer"] + sys.argv[1:]
try:
    runpy.run_module("packer", run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "numpy", "torchvision") if m in sys.modules)
print(repr((code, heavy)), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def dataset(photo_src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("inspect") / "ds"
    build(photo_src, dst, workers=0, progress=False)
    return dst


@pytest.mark.parametrize("args", [
    ["--version"], ["--help"], ["info", "DST"], ["info", "DST", "--json"], ["ls", "DST"],
    ["ls", "DST", "--json"], ["cat", "DST", "3", "-o", "OUT"], ["verify", "DST", "--quick"],
    ["verify", "DST", "--quick", "--json"], ["doctor"], ["doctor", "--json"]],
    ids=" ".join)
def test_inspection_does_not_import_torch(dataset, tmp_path, args):
    argv = [str(dataset) if a == "DST" else str(tmp_path / "x.jpg") if a == "OUT" else a
            for a in args]
    done = subprocess.run([sys.executable, "-c", RUN, *argv], capture_output=True, text=True,
                          env=packer_env(), timeout=120)
    code, heavy = eval(done.stderr.strip().splitlines()[-1])
    assert code == 0, done.stderr
    assert heavy == [], f"`packer {' '.join(args)}` imported {heavy}"
    if args[-1] == "--json":
        out = done.stdout.splitlines()[0] if args[0] == "ls" else done.stdout
        assert isinstance(json.loads(out), dict)


def test_a_full_verify_may(dataset):
    """The control: the check fails where torch is needed (the targets of a full verify)."""
    done = subprocess.run([sys.executable, "-c", RUN, "verify", str(dataset), "-q"],
                          capture_output=True, text=True, env=packer_env(), timeout=120)
    code, heavy = eval(done.stderr.strip().splitlines()[-1])
    assert code == 0 and "torch" in heavy
