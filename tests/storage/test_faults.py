"""Resets, 503s, truncated bodies and stalls between packer and the store: retried within a
bounded time, then a clear error; never a wrong byte."""
from __future__ import annotations

import time

import pytest

from conftest import s3_options
from packer.errors import PackerError
from packer.format.manifest import MANIFEST
from packer.reading.reader import ShardReader
from packer.staging import stage
from packer.storage import Store
from packer.storage.objects import transient

FAST = {"config_kwargs": {"read_timeout": 1, "connect_timeout": 2, "retries": {"max_attempts": 1}}}


def test_stage_through_resets_503s_truncation_and_stalls(remote, proxy, local_dataset, tmp_path):
    proxy.faults = ["reset", "503", "truncate", "slow", "reset", "truncate", "503"]
    proxy.slow_seconds = 2.5  # past the 1 s read timeout: the request is abandoned and retried
    target = tmp_path / "t"
    res = stage(remote, target, progress=False, storage_options=s3_options(proxy.url, **FAST))
    assert res.wrote_manifest and proxy.faults == []
    a, b = ShardReader(local_dataset), ShardReader(target)
    assert [a.read(i) for i in range(len(a))] == [b.read(i) for i in range(len(b))]


def test_persistent_failure_is_a_clear_error_in_bounded_time(remote, proxy, tmp_path):
    proxy.faults = ["503"] * 10_000
    opts = s3_options(proxy.url, packer_retry_seconds=2, **FAST)
    t0 = time.monotonic()
    with pytest.raises(PackerError, match="kept failing for") as e:
        stage(remote, tmp_path / "t", progress=False, storage_options=opts)
    assert time.monotonic() - t0 < 30
    assert "packer_retry_seconds" in str(e.value)
    assert not (tmp_path / "t" / MANIFEST).exists()


def test_short_body_is_retried_then_refused(remote, s3):
    store = Store(remote, dict(s3["options"], packer_retry_seconds=0.5))
    n = len(store.read_bytes(MANIFEST))
    t0 = time.monotonic()
    with pytest.raises(PackerError, match="kept failing.*ShortBody"):  # past the end: always short
        store.get_range(MANIFEST, 0, n + 10)
    assert time.monotonic() - t0 < 5


def test_transient_classification():
    assert transient(ConnectionResetError()) and transient(TimeoutError())
    assert transient(OSError(16, "Please reduce your request rate."))  # s3fs: SlowDown -> EBUSY
    assert not transient(FileNotFoundError("no such key"))
    assert not transient(PermissionError("denied"))
    assert not transient(ValueError("bad bucket name"))
