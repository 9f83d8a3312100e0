"""Every crash point of every writing command is re-runnable (docs/security.md): the command
is SIGKILLed at its N-th write-like system call (``strace`` injection, N over all of a clean
run's calls, sampled evenly by default; ``-m slow`` sweeps all), then re-run unchanged; the
re-run must exit 0 and leave exactly what an uninterrupted run leaves."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from crashlib import STRACE, Scenario, crash_points, crash_and_rerun, folder_state, run, sample
from packer import verify
from packer.demo import make_image_folder

pytestmark = pytest.mark.skipif(STRACE is None, reason="strace (a system package) is not installed")
HERE = Path(__file__).parent
PACKER = ["-m", "packer"]
DEFAULT_POINTS = 3  # per command by default (first, middle, last); the slow sweep takes all


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("crash"))


def make_inputs(t: Path) -> Path:
    """Read-only inputs: two tiny sources, the parts of one, a built and a staged dataset."""
    make_image_folder(t / "src", images=4, classes=2, seed=1)
    make_image_folder(t / "other", images=3, classes=2, seed=2)
    for argv in (["build", t / "src", t / "p1", "--part", "0/2"],
                 ["build", t / "src", t / "p2", "--part", "1/2"],
                 ["build", t / "src", t / "built"],
                 ["build", t / "other", t / "old"],
                 ["merge", t / "p1", t / "oldmerge"],
                 ["stage", t / "built", t / "staged"]):
        proc = run(PACKER + [str(a) for a in argv] 
                   + {"build": ["-q", "--workers", "0"], "stage": ["-q"]}.get(argv[0], []))
        assert proc.returncode == 0, proc.stderr
    return t


def scenarios(t: Path):
    """name -> Scenario; each command works in ``folder`` (a fresh one per crash point, two
    levels below ``t`` so that merged datasets' relative part paths are the same)."""
    def copy(name, to="dst"):
        return lambda f: (f.mkdir(parents=True), shutil.copytree(t / name, f / to, symlinks=True))
    fresh = lambda f: f.mkdir(parents=True)
    build = lambda *extra: lambda f: PACKER + ["build", str(t / "src"), str(f / "dst"), "-q",
                                               "--workers", "0", *extra]
    merge = lambda *extra: lambda f: PACKER + ["merge", str(t / "p1"), str(t / "p2"), str(f / "dst"),
                                               *extra]
    dst = lambda f: folder_state(f / "dst")
    whole = lambda f: folder_state(f)
    return {s.name: s for s in [
        Scenario("build", fresh, build(), dst),
        Scenario("build --overwrite", copy("old"), build("--overwrite"), dst),
        Scenario("merge", fresh, merge(), dst),
        Scenario("merge --overwrite", copy("oldmerge"), merge("--overwrite"), dst),
        Scenario("write", fresh, lambda f: [str(HERE / "write_samples.py"), str(t / "src"), str(f / "dst")], dst),
        Scenario("stage", fresh, lambda f: PACKER + ["stage", str(t / "built"), str(f / "dst"), "-q"], dst),
        Scenario("unstage", copy("staged"), lambda f: PACKER + ["unstage", str(f / "dst")], whole),
    ]}


NAMES = ["build", "build --overwrite", "merge", "merge --overwrite", "write", "stage", "unstage"]


def sweep(made, tmp_path, name, k):
    s = scenarios(made)[name]
    ref = tmp_path / "ref" / "x"
    points = crash_points(s, ref)
    want = s.outcome(ref)
    if name != "unstage":
        assert verify(ref / "dst", progress=False).ok
    for n in sample(points, k):
        folder = tmp_path / f"{n[0]}{n[1]}" / "x"
        assert crash_and_rerun(s, folder, n) == want, f"{name}: kill at {n} of {len(points)} points"
        shutil.rmtree(folder.parent)


@pytest.mark.parametrize("name", NAMES)
def test_crash_points_rerun(made, tmp_path, name):
    sweep(made, tmp_path, name, DEFAULT_POINTS)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PACKER_CRASH_SWEEP"),
                    reason="every crash point takes ~10 minutes: set PACKER_CRASH_SWEEP=1")
@pytest.mark.parametrize("name", NAMES)
def test_every_crash_point_rerun(made, tmp_path, name):
    sweep(made, tmp_path, name, 10 ** 6)
