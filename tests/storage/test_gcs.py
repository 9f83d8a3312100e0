"""Staging and the shard cache from GCS, through the GCS emulator on loopback."""
from __future__ import annotations

import os

import pytest

from packer.reading.reader import ShardReader
from packer.staging import stage
from packer.storage import ShardCache, upload_dataset

# gcsfs probes a bucket's type over gRPC first (the emulator has no gRPC): plain JSON API only.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
os.environ.setdefault("NO_GCE_CHECK", "True")  # never look for a metadata server


@pytest.fixture(scope="module")
def gcs(local_dataset):
    from gcp_storage_emulator.server import create_server
    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket="packer-gcs")
    server.start()
    port = server._api._httpd.socket.getsockname()[1]
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon", "project": "test",
            "packer_part_size": 256 << 10, "packer_retry_seconds": 10}
    url = "gs://packer-gcs/ds"
    upload_dataset(local_dataset, url, opts)
    yield url, opts
    server.stop()


def test_stage_and_cache_from_gcs(gcs, local_dataset, tmp_path):
    url, opts = gcs
    res = stage(url, tmp_path / "t", progress=False, storage_options=opts)
    assert res.wrote_manifest and str(res.source) == url
    local = ShardReader(local_dataset)
    expected = [local.read(i) for i in range(len(local))]
    staged = ShardReader(tmp_path / "t")
    assert [staged.read(i) for i in range(len(staged))] == expected
    cache = ShardCache(url, tmp_path / "cache", None, opts)
    for k in range(len(cache)):
        cache.shard_path(k)
    cached = ShardReader(cache.root, cache.manifest)
    assert [cached.read(i) for i in range(len(cached))] == expected


def test_gcs_requests_have_a_time_limit_unless_one_is_given():
    """gcsfs waits for ever by default: a stalled read must fail, to be retried."""
    from packer.storage.urls import GCS_REQUEST_SECONDS, filesystem
    opts = {"token": "anon", "project": "test", "endpoint_url": "http://127.0.0.1:9"}
    assert filesystem("gs://packer-gcs/ds", opts)[0].requests_timeout == GCS_REQUEST_SECONDS
    assert filesystem("gs://packer-gcs/ds", dict(opts, requests_timeout=5))[0].requests_timeout == 5


def test_a_stalled_gcs_read_times_out_and_is_retried(gcs, tmp_path):
    """A read held for 30 s ends at the request limit and is tried again, well before."""
    import time
    from storage_helpers import FaultProxy
    url, opts = gcs
    proxy = FaultProxy(("127.0.0.1", int(opts["endpoint_url"].rsplit(":", 1)[1])))
    try:
        proxy.faults, proxy.slow_seconds = ["slow"], 30
        cache = ShardCache(url, tmp_path / "cache", None,
                           dict(opts, endpoint_url=proxy.url, requests_timeout=1))
        start = time.monotonic()
        path = cache.shard_path(0)  # its SHA-256 checked on the way in
        assert time.monotonic() - start < 20 and not proxy.faults
        assert path.stat().st_size == cache.manifest["shards"][0]["bytes"]
    finally:
        proxy.close()
