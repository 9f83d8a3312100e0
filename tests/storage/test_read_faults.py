"""A bucket that changes or lies under packer, a hostile manifest's ``..`` paths, a full cache
disk and a URL naming no bucket: against the real local S3 server, real files, a real CLI
process."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from packer import PackedDataset
from packer._util.fsio import NotAFile
from packer.errors import FormatError, PackerError
from packer.info import info
from packer.storage import ShardCache
from packer.storage.files import ObjectFile, RemoteFolder
from packer.storage.objects import Grown

from conftest import BUCKET, s3_options

ROOT = Path(__file__).resolve().parents[2]


def test_an_image_replaced_after_the_listing_is_not_cut_to_its_listed_size(s3, local_dataset):
    """A build lists the prefix once, then GETs each image: one replaced meanwhile by a longer
    file (here the same JPEG with bytes appended after its end, which decodes as before) was
    read as its first `listed size` bytes, a file that exists nowhere, and packed. Now it is
    skipped as a changed file, as a local file that grows while read is."""
    prefix = f"{BUCKET}/grown-{os.getpid()}"
    jpeg = next((local_dataset.parent / "src").rglob("*.jpg")).read_bytes()
    s3["fs"].pipe_file(f"{prefix}/a/x.jpg", jpeg)
    s3["fs"].pipe_file(f"{prefix}/a/same.jpg", jpeg)
    folder = RemoteFolder(f"s3://{prefix}", s3["options"])
    assert folder.sizes() == {"a/x.jpg": len(jpeg), "a/same.jpg": len(jpeg)}
    s3["fs"].pipe_file(f"{prefix}/a/x.jpg", jpeg + b"appended after the listing" * 10)
    with pytest.raises(NotAFile, match="more bytes than the .* listed"):
        folder.read("a/x.jpg")
    assert folder.read("a/same.jpg") == jpeg  # an object as listed reads whole, as before


def test_an_annotation_file_replaced_between_head_and_get_is_an_error(s3, proxy):
    """`--meta s3://.../captions.jsonl`: HEAD for the size, then one GET of that many bytes.
    Replaced in between by a longer file, its first bytes came back as the file, cut in the
    middle of a line. Now: the GET asks for one byte more, and a longer object is an error."""
    key = f"{BUCKET}/meta-{os.getpid()}/captions.jsonl"
    s3["fs"].pipe_file(key, b'{"path": "a.jpg", "caption": "old"}\n')
    newer = b"".join(b'{"path": "%d.jpg", "caption": "a longer file"}\n' % i for i in range(50))

    def replace_before_the_get(method, path):
        if method == "GET" and path.split("?")[0].endswith("captions.jsonl"):
            s3["fs"].pipe_file(key, newer)
    proxy.hook = replace_before_the_get
    meta = ObjectFile(f"s3://{key}", s3_options(proxy.url))
    with pytest.raises(Grown, match="changed since"):
        meta.read()
    proxy.hook = None
    assert meta.read() == newer


def test_the_shard_cache_refuses_a_shard_outside_any_dataset(s3, remote, tmp_path):
    """A manifest may name `../PART/NAME` (a merge's part) only where PART is a packer
    dataset: stage and local reads refuse anything else, so a manifest cannot make packer
    read an arbitrary object of the bucket. The shard cache (PackedDataset, ls, cat, verify)
    did not check it and fetched the object."""
    fs, src = s3["fs"], remote.split("://")[1]
    man = json.loads(fs.cat_file(f"{src}/manifest.json"))
    evil, loot = f"{BUCKET}/evil-{os.getpid()}", f"{BUCKET}/loot-{os.getpid()}"
    fs.copy(f"{src}/{man['shards'][0]['path']}", f"{loot}/private.lmdb")  # no manifest there
    for k in fs.ls(src, refresh=True):
        if not k.endswith(("/manifest.json", "/" + man["shards"][0]["path"])):
            fs.copy(k, f"{evil}/{k.rsplit('/', 1)[1]}")
    man["shards"][0]["path"] = f"../{loot.rsplit('/', 1)[1]}/private.lmdb"
    fs.pipe_file(f"{evil}/manifest.json", json.dumps(man).encode())
    with pytest.raises(FormatError, match="not a packer dataset; refusing it"):
        ShardCache(f"s3://{evil}", tmp_path / "c", None, s3["options"])
    with pytest.raises(FormatError, match="not a packer dataset; refusing it"):
        PackedDataset(f"s3://{evil}", cache_dir=tmp_path / "c", storage_options=s3["options"])
    assert not list((tmp_path / "c").rglob("*.lmdb"))


def _no_bigger_files_than(limit: int):
    def apply():  # in the child: writes past `limit` fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_cache_disk_is_one_line_naming_the_folder(s3, remote, tmp_path):
    """`packer cat URL` fetching a shard into a disk that fills up said only
    `Error: [Errno 27] File too large` (or 28, No space left): not which disk, nor what to do.
    Now one line names the cache folder and the object, and no partial file stays."""
    flags = []
    for k, v in s3["options"].items():
        flags += ["--storage-option", f"{k}={json.dumps(v) if isinstance(v, dict) else v}"]
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "packer", "cat", remote, "3", "-o",
                        str(tmp_path / "x.jpg"), "--cache-dir", str(cache)] + flags,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       preexec_fn=_no_bigger_files_than(200 << 10))  # the shards are ~1 MiB
    err = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    (folder,) = cache.iterdir()
    assert err.startswith("Error: ") and f"{folder} filled up while caching" in err, err
    assert "shard-" in err and "cache_dir" in err, err
    assert not list(folder.glob(".*.part")) and not list(folder.glob("*.lmdb"))


def test_a_url_naming_no_bucket_never_reads_a_local_folder(s3, local_dataset, tmp_path,
                                                         monkeypatch):
    """`s3://` lost its slashes on the way to fsspec, which took `s3:` for a folder in the
    working directory and read the dataset there as if from the store."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(local_dataset, tmp_path / "s3:")
    for url in ("s3://", "s3:///"):
        with pytest.raises(PackerError, match="names no bucket"):
            info(url, s3["options"])


def test_a_cache_limit_that_is_no_size_is_a_packer_error():
    """`cache_limit="1.5.0G"` raised Python's `could not convert string to float`, and a
    negative count or `True` passed as a size; each is now the PackerError naming the value."""
    from packer.storage.cache import parse_size
    assert parse_size("1.5T") == 3 << 39 and parse_size(".5G") == 1 << 29 and parse_size(0) == 0
    for bad in ("1.5.0G", ".", "-5G", -5, True):
        with pytest.raises(PackerError, match="is not a size"):
            parse_size(bad)
