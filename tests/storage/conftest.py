"""A real S3-compatible server on 127.0.0.1 (moto), started by the tests, holding a real
packed dataset; and a fault-injecting proxy in front of it. Nothing leaves loopback."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from packer import build
from packer.demo import make_image_folder
from packer.storage import upload_dataset
from storage_helpers import FaultProxy

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # never probe a metadata server
KEY, SECRET = "AKIATESTKEYNOTREAL01", "s3cr3t-Test-Value-never-printed"
BUCKET = "packer-test"


def s3_options(endpoint: str, **extra) -> dict:
    """storage_options for the local server: small parts (several per shard), short bounds."""
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET,
            "client_kwargs": {"region_name": "us-west-2"},
            "packer_part_size": 256 << 10, "packer_parallel": 4, "packer_retry_seconds": 20,
            **extra}


@pytest.fixture(scope="session")
def moto_server():
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def s3(moto_server):
    """The server's endpoint and options, with the test bucket made."""
    import fsspec
    opts = s3_options(moto_server)
    fs = fsspec.filesystem("s3", endpoint_url=moto_server, key=KEY, secret=SECRET,
                           client_kwargs={"region_name": "us-west-2"})
    fs.mkdir(BUCKET)
    return {"endpoint": moto_server, "options": opts, "fs": fs}


@pytest.fixture(scope="session")
def local_dataset(tmp_path_factory) -> Path:
    """A real small dataset (48 JPEGs, ~3.5 MB) in several shards."""
    base = tmp_path_factory.mktemp("s3data")
    src = make_image_folder(base / "src", images=48, classes=4, seed=3)
    dst = base / "built"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(src, dst, workers=0, progress=False, shard_size=1 << 20)
    return dst


@pytest.fixture(scope="session")
def remote(s3, local_dataset) -> str:
    """``local_dataset`` uploaded to s3://packer-test/ds (read-only: tests that change
    objects upload their own copy with ``fresh_remote``)."""
    url = f"s3://{BUCKET}/ds"
    upload_dataset(local_dataset, url, s3["options"])
    return url


@pytest.fixture
def fresh_remote(s3, local_dataset, request) -> str:
    """A private copy of the dataset under its own prefix (tests may change its objects)."""
    url = f"s3://{BUCKET}/{request.node.name[:40]}-{os.getpid()}"
    upload_dataset(local_dataset, url, s3["options"])
    return url


@pytest.fixture
def proxy(moto_server):
    host, port = moto_server.rsplit("/", 1)[1].split(":")
    p = FaultProxy((host, int(port)))
    yield p
    p.close()
