"""`packer build SRC s3://...`: shards uploaded as they finish, the manifest last, resumable."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import BUCKET, KEY, SECRET, s3_options
from packer import PackedDataset, build
from packer.cli import main
from packer.demo import make_image_folder
from packer.format.manifest import MANIFEST
from packer.reading.reader import ShardReader
from packer.storage import Destination

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("bsrc") / "src", images=24, classes=3, seed=5)


def flags(options: dict) -> list:
    out = []
    for k, v in options.items():
        out += ["--storage-option", f"{k}={json.dumps(v) if isinstance(v, dict) else v}"]
    return out


def same_as_local(url: str, source: Path, options: dict, tmp: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(source, tmp / "local", workers=0, progress=False, shard_size=1 << 20)
    ds = PackedDataset(url, cache_dir=tmp / "cache", storage_options=options)
    local = ShardReader(tmp / "local")
    assert len(ds) == len(local) > 0
    assert all(ds.reader.read(i) == local.read(i) for i in range(len(local)))
    assert ds.targets == PackedDataset(tmp / "local").targets
    local.close()


def test_build_into_s3_then_nothing_to_do(s3, source, proxy, tmp_path):
    url = f"s3://{BUCKET}/built"
    sent = []
    proxy.hook = lambda method, path: sent.append(path) if method in ("PUT", "POST") else None
    dest = Destination(url, s3_options(proxy.url), work_dir=tmp_path / "work")
    res = build(source, dest, workers=0, progress=False, shard_size=1 << 20)
    assert len(res.manifest["shards"]) >= 2 and dest.uploaded[-1] == MANIFEST
    assert sent[-1].split("?")[0].endswith("/" + MANIFEST)  # the manifest last
    same_as_local(url, source, s3["options"], tmp_path)
    sent.clear()
    again = Destination(url, s3_options(proxy.url), work_dir=tmp_path / "work")
    build(source, again, workers=0, progress=False, shard_size=1 << 20)
    assert again.uploaded == [] and sent == []
    with pytest.raises(Exception, match="already holds a finished dataset"):  # a new work folder
        build(source, Destination(url, s3["options"], tmp_path / "w2"), workers=0, progress=False)


def test_cli_build_killed_mid_upload_resumes(s3, source, proxy, tmp_path):
    url, fs = f"s3://{BUCKET}/killed-build", s3["fs"]
    key = url.split("://")[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "packer", "build", str(source), url, "-j", "0", "-q",
           "--shard-size", "1M"]
    proxy.delay = 0.2
    proc = subprocess.Popen(cmd + flags(s3_options(proxy.url)), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        fs.invalidate_cache()
        if fs.exists(f"{key}/shard-00000.lmdb"):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()
    assert fs.exists(f"{key}/shard-00000.lmdb") and not fs.exists(f"{key}/{MANIFEST}")
    proxy.delay = 0
    done = subprocess.run(cmd + flags(s3["options"]), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr and KEY not in done.stdout + done.stderr
    assert "resumed" in done.stdout and url in done.stdout
    same_as_local(url, source, s3["options"], tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("packer-build-")]
    r = CliRunner().invoke(main, ["build", str(source), url] + flags(s3["options"]))
    assert r.exit_code == 1 and "already holds a finished dataset" in r.output
    assert "--overwrite" in r.output
