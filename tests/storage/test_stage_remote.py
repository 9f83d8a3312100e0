"""`packer stage s3://...`: a verified, resumable copy from a real S3 server on loopback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import BUCKET, KEY, SECRET, s3_options
from packer import verify
from packer.cli import main
from packer.errors import FormatError, PackerError
from packer.format.manifest import MANIFEST, read_manifest
from packer.reading.reader import ShardReader
from packer.staging import STAGE_MARKER, TMP_SUFFIX, stage

ROOT = Path(__file__).resolve().parents[2]


def same_records(a: Path, b: Path) -> None:
    ra, rb = ShardReader(a), ShardReader(b)
    assert len(ra) == len(rb) > 0
    assert all(ra.read(i) == rb.read(i) for i in range(len(ra)))
    ra.close()
    rb.close()


def no_leftovers(target: Path) -> None:
    assert not list(target.glob("*" + TMP_SUFFIX)), sorted(os.listdir(target))


def test_stage_from_s3_is_a_verified_copy(s3, remote, local_dataset, tmp_path):
    target = tmp_path / "staged"
    res = stage(remote, target, progress=False, storage_options=s3["options"])
    assert res.wrote_manifest and len(res.copied) == len(os.listdir(local_dataset)) - 1
    assert str(res.source) == remote and read_manifest(target)["staged"]["from"] == remote
    same_records(local_dataset, target)
    assert verify(target, progress=False).problems == []
    no_leftovers(target)
    again = stage(remote, target, progress=False, storage_options=s3["options"])
    assert not again.changed and len(again.kept) == len(res.copied)


def test_cli_stage_url_with_environment_credentials(s3, remote, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["endpoint"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    r = CliRunner().invoke(main, ["stage", remote, str(tmp_path / "t"), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["source"] == remote and out["wrote_manifest"]
    assert SECRET not in r.output and KEY not in r.output
    r = CliRunner().invoke(main, ["stage", f"s3://{BUCKET}/nothing-here", str(tmp_path / "u")])
    assert r.exit_code == 1 and r.output.startswith("Error: ") and "not a packer dataset" in r.output
    assert not (tmp_path / "u").exists()


def test_credentials_never_shown(s3, remote, tmp_path):
    target = tmp_path / "t"
    stage(remote, target, progress=False, storage_options=s3["options"])
    written = "".join(p.read_text("utf-8") for p in (target / MANIFEST, target / STAGE_MARKER))
    assert SECRET not in written and KEY not in written
    url = f"s3://user:pw-Hunter2x@{BUCKET}/ds?X-Amz-Signature=sig-Hunter3y"
    with pytest.raises(PackerError) as e:  # the bucket name is not valid: an error quoting the URL
        stage(url, tmp_path / "u", progress=False, storage_options=s3["options"])
    assert "Hunter2x" not in str(e.value) and "Hunter3y" not in str(e.value)
    dead = s3_options("http://127.0.0.1:9", packer_retry_seconds=0,
                      config_kwargs={"retries": {"max_attempts": 1}})
    with pytest.raises(PackerError) as e:  # nothing listens on port 9: connection refused
        stage(remote, tmp_path / "v", progress=False, storage_options=dead)
    assert SECRET not in str(e.value) and KEY not in str(e.value)


def test_resume_after_kill_9(s3, remote, proxy, local_dataset, tmp_path):
    """A real process killed mid-stage; the re-run keeps what was finished and checked."""
    target = tmp_path / "t"
    proxy.delay = 0.15
    script = textwrap.dedent(f"""
        import json, sys
        from packer import stage
        stage({remote!r}, {str(target)!r}, progress=False, storage_options=json.loads(sys.argv[1]))
    """)
    opts = s3_options(proxy.url)
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(opts)],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 60
    while not any(p.suffix == ".lmdb" for p in target.glob("*")) and time.monotonic() < deadline:
        assert proc.poll() is None, "staging ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (target / MANIFEST).exists()
    with pytest.raises(FormatError):
        read_manifest(target)
    res = stage(remote, target, progress=False, storage_options=s3["options"])
    assert res.kept and res.copied and res.wrote_manifest
    same_records(local_dataset, target)
    no_leftovers(target)


def test_object_changed_mid_stage(s3, fresh_remote, tmp_path):
    """The second shard is rewritten as staging reads it: a clear error, nothing half-staged."""
    fs = s3["fs"]
    key = fresh_remote.split("://", 1)[1] + "/shard-00001.lmdb"
    original = fs.cat_file(key)
    changed = bytes(b ^ 0xFF for b in original[:4096]) + original[4096:]

    def rewrite(method, path):
        if method == "GET" and "shard-00001.lmdb" in path and fs.cat_file(key) == original:
            fs.pipe_file(key, changed)  # same size, other bytes: a new ETag
    from storage_helpers import FaultProxy
    host, port = s3["endpoint"].rsplit("/", 1)[1].split(":")
    p = FaultProxy((host, int(port)))
    p.hook = rewrite
    target = tmp_path / "t"
    try:
        with pytest.raises(PackerError, match="changed while packer read it"):
            stage(fresh_remote, target, progress=False, storage_options=s3_options(p.url))
    finally:
        p.close()
    assert not (target / MANIFEST).exists()
    no_leftovers(target)
    # Now consistently different from its manifest: damaged, never staged.
    with pytest.raises(FormatError, match="does not match its manifest entry"):
        stage(fresh_remote, target, progress=False, storage_options=s3["options"])
    assert not (target / MANIFEST).exists()
    no_leftovers(target)


def test_missing_client_and_unknown_protocol(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "adlfs", None)  # as where the cloud extra is not installed
    with pytest.raises(PackerError, match=r'pip install "packer-lmdb\[cloud\]"'):
        stage("az://container/ds", tmp_path / "t", progress=False)
    with pytest.raises(PackerError, match="nosuchproto"):
        stage("nosuchproto://x/ds", tmp_path / "t", progress=False)
    assert not (tmp_path / "t").exists()


def test_files_at_once_keeps_the_ranged_gets_busy_without_growing_memory(tmp_path):
    from packer.staging.copy import StagedFile
    from packer.staging.stager import files_at_once
    from packer.storage import RemoteDataset

    ds = RemoteDataset("s3://bucket/ds", {"packer_part_size": 8 << 20, "packer_parallel": 16,
                                          "anon": True})
    remote = lambda mib: StagedFile("x", ds / "x", mib << 20, None, "shard")  # noqa: E731
    assert files_at_once([remote(64), remote(64)]) == 3      # 8 parts each: two files fill 16, one waits
    assert files_at_once([remote(4)] * 20) == 8               # one part each: at most 8 files
    assert files_at_once([remote(128), remote(128)]) == 2     # 16 parts: one file and the next
    assert files_at_once([remote(136), remote(8)]) == 2       # 17 parts: still the next one waiting
    assert files_at_once([remote(1024), remote(8)]) == 2      # the largest file sets it
    assert files_at_once([StagedFile("x", tmp_path / "x", 1 << 20, None, "shard")]) == 1


def test_ranged_gets_share_one_pool_per_process(s3, remote, tmp_path):
    """Every file's GETs go through one pool of packer_parallel threads (the next file starts
    while a file's last parts arrive); a forked child makes its own and still downloads."""
    from packer.storage import RemoteDataset

    store = RemoteDataset(remote, s3_options(s3["endpoint"], packer_parallel=3)).store
    pool = store.pool()
    assert store.pool() is pool and pool._max_workers == 3
    shard = json.loads(store.read_bytes(MANIFEST))["shards"][0]
    name, size, sha = shard["path"], shard["bytes"], shard["sha256"]
    store.download(name, tmp_path / "a", size, sha)
    assert store.pool() is pool
    pid = os.fork()
    if pid == 0:  # the parent's pool threads do not exist here: a pool of its own must be made
        code = 1
        try:
            if store.pool() is pool:
                code = 2
            else:
                store.download(name, tmp_path / "b", size, sha)
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120  # the parent's pool in the child would wait forever
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    if status[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's download hung")
    assert os.waitstatus_to_exitcode(status[1]) == 0
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
