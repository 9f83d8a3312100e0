"""URLs shown without credentials; options split; uploads put the manifest last and resume."""
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

from conftest import BUCKET, s3_options
from packer import build, merge
from packer.demo import make_image_folder
from packer.errors import PackerError
from packer.format.manifest import MANIFEST
from packer.staging import stage
from packer.storage import Transfer, is_url, redact, redact_text, upload_dataset
from packer.storage.remote import UPLOAD_MARKER
from packer.storage.urls import secret_values, split_options, url_secrets

ROOT = Path(__file__).resolve().parents[2]


def test_is_url_and_redact():
    assert is_url("s3://b/k") and is_url("gs://b") and is_url("az://c/p") and is_url("file:///x")
    assert not is_url("/data/ds") and not is_url("relative/s3:/x") and not is_url(b"s3://b")
    assert redact("s3://b/ds") == "s3://b/ds"
    assert redact("https://me:pw@host:9000/b/ds?sig=abc&se=1#frag") == "https://***@host:9000/b/ds?***#***"
    text = "failed: GET https://u:p@h/x?X-Amz-Signature=zzz (token tok-123456)"
    out = redact_text(text, ["tok-123456"])
    assert "zzz" not in out and "u:p" not in out and "tok-123456" not in out
    assert set(url_secrets("s3://ak:sk-long@b/k?sig=abcd")) >= {"ak:sk-long", "sk-long", "abcd"}
    assert secret_values({"key": "AK", "client_kwargs": {"aws_secret_access_key": "S"},
                          "endpoint_url": "http://x"}) == ("AK", "S")


def test_split_options():
    opts, t = split_options({"endpoint_url": "http://x", "packer_parallel": 3})
    assert opts == {"endpoint_url": "http://x"} and t == Transfer(parallel=3)
    with pytest.raises(PackerError, match="packer_nope"):
        split_options({"packer_nope": 1})
    with pytest.raises(PackerError, match=">= 1"):
        split_options({"packer_part_size": 0})
    # From --storage-option KEY=VALUE text, or NaN (which JSON parsing lets through): a clear
    # error, not a TypeError later or retries without end.
    for bad in ({"packer_part_size": "8M"}, {"packer_parallel": 2.5}, {"packer_parallel": True},
                {"packer_retry_seconds": float("nan")}, {"packer_retry_seconds": float("inf")},
                {"packer_retry_seconds": "5"}):
        with pytest.raises(PackerError, match="whole numbers >= 1"):
            split_options(bad)
    assert split_options({"packer_retry_seconds": 0.5})[1].retry_seconds == 0.5
    import numpy as np
    assert split_options({"packer_parallel": np.int64(4)})[1].parallel == 4


def test_upload_puts_the_manifest_last_and_resumes(s3, local_dataset, proxy, tmp_path):
    url = f"s3://{BUCKET}/uploaded"
    puts = []
    proxy.hook = lambda method, path: puts.append(path.split("?")[0].rsplit("/", 1)[-1]) \
        if method in ("PUT", "POST", "DELETE") else None
    opts = s3_options(proxy.url)
    sent = upload_dataset(local_dataset, url, opts)
    assert sent[-1] == MANIFEST and puts[0] == UPLOAD_MARKER
    assert puts.index(MANIFEST) == len(puts) - 2 and puts[-1] == UPLOAD_MARKER  # then the marker goes
    assert upload_dataset(local_dataset, url, opts) == []  # already there


def test_upload_refuses_a_merged_dataset_whose_shards_live_in_its_parts(s3, tmp_path):
    """A merged dataset's shards are ``../pK/NAME``: uploaded as they are, they would land
    beside the dataset's prefix (over whatever is there), outside what was asked for."""
    src = make_image_folder(tmp_path / "src", images=6, classes=2)
    parts = [tmp_path / f"p{k}" for k in range(2)]
    for k, part in enumerate(parts):
        build(src, part, part=f"{k}/2", workers=0, progress=False)
    merge(parts, tmp_path / "m")
    with pytest.raises(PackerError, match="merged dataset whose shards live in its parts"):
        upload_dataset(tmp_path / "m", f"s3://{BUCKET}/merged-upload/m", s3["options"])
    s3["fs"].invalidate_cache()
    assert s3["fs"].find(f"{BUCKET}/merged-upload") == []


def test_upload_killed_midway_resumes(s3, local_dataset, proxy, tmp_path):
    """kill -9 during an upload: no manifest there (not a dataset); the re-run sends the rest."""
    url, fs = f"s3://{BUCKET}/killed", s3["fs"]
    key = url.split("://")[1]
    script = textwrap.dedent(f"""
        import json, sys
        from packer.storage import upload_dataset
        upload_dataset({str(local_dataset)!r}, {url!r}, json.loads(sys.argv[1]), workers=1)
    """)
    proxy.delay = 0.3
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(s3_options(proxy.url))],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if fs.exists(f"{key}/shard-00000.lmdb") and (fs.invalidate_cache() or True):
            break
        fs.invalidate_cache()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()
    assert not fs.exists(f"{key}/{MANIFEST}") and fs.exists(f"{key}/{UPLOAD_MARKER}")
    with pytest.raises(PackerError, match="not a packer dataset"):
        stage(url, tmp_path / "t", progress=False, storage_options=s3["options"])
    sent = upload_dataset(local_dataset, url, s3["options"])
    assert "shard-00000.lmdb" not in sent and sent[-1] == MANIFEST
    fs.invalidate_cache()
    assert not fs.exists(f"{key}/{UPLOAD_MARKER}")
    assert stage(url, tmp_path / "t", progress=False, storage_options=s3["options"]).wrote_manifest
