"""Platforms (issue 27; README "Platforms"): Linux is the home, and on Linux the tests stand
in for the others.

- The ``spawn`` start method (macOS's and Windows' default): build, PackedDataset, make_loader
  and staging run with every process spawned, ``fork`` made unavailable.
- No ``fcntl`` (Windows) and no ``os.memfd_create`` (macOS): ``import packer`` and the read
  path work; writing a dataset says in one line that it is not supported there.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from helpers import packer_env
from packer import build

SPAWN = textwrap.dedent("""
    import multiprocessing as mp, sys
    from pathlib import Path

    def only_spawn(method=None):  # as where fork does not exist: every process is spawned
        return REAL("spawn")

    if __name__ == "__main__":
        REAL = mp.get_context
        mp.set_start_method("spawn", force=True)
        mp.get_context = only_spawn
        import packer
        src, work = sys.argv[1], Path(sys.argv[2])
        built = packer.build(src, work / "ds", workers=2, progress=False, shard_size=1 << 20)
        assert len(built.manifest["shards"]) > 1
        staged = packer.stage(work / "ds", work / "staged", progress=False).target
        ds = packer.PackedDataset(staged, decode=packer.DecodeCenterCrop(32))
        seen = [int(y) for _, labels in packer.make_loader(ds, batch_size=8, num_workers=2)
                for y in labels]
        assert sorted(seen) == sorted(ds.targets), (len(seen), len(ds))
        packer.unstage(staged)
        print("ok", len(seen))
""")

NO_FCNTL_NO_MEMFD = textwrap.dedent("""
    import os, sys
    sys.modules["fcntl"] = None        # as on Windows: `import fcntl` fails
    del os.memfd_create                # as on macOS
    import packer, packer.cli, packer.info
    from packer.loading.loader import make_loader
    root = sys.argv[1]
    ds = packer.PackedDataset(root, decode=packer.DecodeCenterCrop(32))
    assert sum(len(y) for _, y in make_loader(ds, batch_size=8, num_workers=2)) == len(ds)
    assert packer.verify(root, progress=False).ok and packer.info.info(root)["count"] == len(ds)
    try:
        packer.build(root, sys.argv[2], progress=False)
    except packer.PackerError as e:
        print(e)
""")


def run(script: str, *args) -> str:
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, env=packer_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow
def test_everything_runs_under_spawn(photo_src, tmp_path):
    script = tmp_path / "spawned.py"  # spawned children import the main module from a file
    script.write_text(SPAWN)
    done = subprocess.run([sys.executable, str(script), str(photo_src), str(tmp_path)],
                          capture_output=True, text=True, env=packer_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout == "ok 48\n"


def test_reading_works_without_fcntl_and_memfd(photo_src, tmp_path):
    build(photo_src, tmp_path / "ds", workers=0, progress=False)
    out = run(NO_FCNTL_NO_MEMFD, tmp_path / "ds", tmp_path / "new")
    assert out == ("writing a dataset needs file locks (fcntl), which this platform lacks: "
                   "build, merge, write and stage run on Linux and macOS\n")
    assert not (tmp_path / "new").exists()
