"""`packer build SRC s3://...`: shards uploaded as they finish, the manifest last, resumable."""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import BUCKET, KEY, SECRET, s3_options
from packer import PackedDataset, build
from packer.cli import main
from packer.errors import PackerError
from packer.format.manifest import MANIFEST
from packer.reading.reader import ShardReader
from packer.storage import Destination
from packer.storage.remote import UPLOAD_MARKER

@pytest.fixture(scope="module")
def source(local_dataset) -> Path:
    """The images of conftest's ``local_dataset`` (built from them with these settings)."""
    return local_dataset.parent / "src"


def flags(options: dict) -> list:
    out = []
    for k, v in options.items():
        out += ["--storage-option", f"{k}={json.dumps(v) if isinstance(v, dict) else v}"]
    return out


@pytest.fixture(scope="module")
def local(local_dataset) -> Path:
    return local_dataset


def same_as_local(url: str, local: Path, options: dict, tmp: Path) -> None:
    ds = PackedDataset(url, cache_dir=tmp / "cache", storage_options=options)
    reader = ShardReader(local)
    assert len(ds) == len(reader) > 0
    assert all(ds.reader.read(i) == reader.read(i) for i in range(len(reader)))
    assert ds.targets == PackedDataset(local).targets
    reader.close()


def test_build_into_s3_then_nothing_to_do(s3, source, local, proxy, tmp_path):
    url = f"s3://{BUCKET}/built"
    sent = []
    proxy.hook = lambda method, path: sent.append(path) if method in ("PUT", "POST") else None
    dest = Destination(url, s3_options(proxy.url), work_dir=tmp_path / "work")
    res = build(source, dest, workers=0, progress=False, shard_size=1 << 20)
    assert len(res.manifest["shards"]) >= 2 and dest.uploaded[-1] == MANIFEST
    assert sent[-1].split("?")[0].endswith("/" + MANIFEST)  # the manifest last
    same_as_local(url, local, s3["options"], tmp_path)
    sent.clear()
    again = Destination(url, s3_options(proxy.url), work_dir=tmp_path / "work")
    build(source, again, workers=0, progress=False, shard_size=1 << 20)
    assert again.uploaded == [] and sent == []
    with pytest.raises(PackerError, match="already holds a finished dataset"):  # a new work folder
        build(source, Destination(url, s3["options"], tmp_path / "w2"), workers=0, progress=False)
    calls = []
    proxy.hook = lambda method, path: calls.append((method, path.split("?")[0].rsplit("/", 1)[1]))
    res = build(source, Destination(url, s3_options(proxy.url), tmp_path / "w2"), workers=0,
                progress=False, shard_size=1 << 20, overwrite=True, shuffle=True)
    writes = [c for c in calls if c[0] in ("PUT", "POST", "DELETE")]
    claim, unclaim = ("PUT", UPLOAD_MARKER), ("DELETE", UPLOAD_MARKER)  # the prefix is packer's
    assert writes[:2] == [claim, ("DELETE", MANIFEST)] and writes[-2:] == [("PUT", MANIFEST), unclaim]
    assert [w for w in writes[2:-2] if MANIFEST in w or UPLOAD_MARKER in w] == []
    got = json.loads(s3["fs"].cat_file(f"{BUCKET}/built/{MANIFEST}"))
    assert got["options"]["shuffle"] and got["build_id"] == res.manifest["build_id"]


def test_cli_build_killed_mid_upload_resumes(s3, source, local, proxy, tmp_path, monkeypatch):
    url, fs = f"s3://{BUCKET}/killed-build", s3["fs"]
    key = url.split("://")[1]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the build works
    args = ["build", str(source), url, "-j", "0", "-q", "--shard-size", "1M"]
    proxy.delay = 0.2
    pid = os.fork()  # the CLI in a process of its own (forked: no interpreter to start)
    if pid == 0:
        os._exit(CliRunner().invoke(main, args + flags(s3_options(proxy.url))).exit_code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG) == (0, 0):
        fs.invalidate_cache()
        if fs.exists(f"{key}/shard-00000.lmdb"):
            break
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    fs.invalidate_cache()
    assert fs.exists(f"{key}/shard-00000.lmdb") and not fs.exists(f"{key}/{MANIFEST}")
    proxy.delay = 0
    done = CliRunner().invoke(main, args + flags(s3["options"]))
    assert done.exit_code == 0, done.output
    assert SECRET not in done.output and KEY not in done.output
    assert "resumed" in done.output and url in done.output
    same_as_local(url, local, s3["options"], tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("packer-build-")]
    r = CliRunner().invoke(main, ["build", str(source), url] + flags(s3["options"]))
    assert r.exit_code == 1 and "already holds a finished dataset" in r.output
    assert "--overwrite" in r.output
