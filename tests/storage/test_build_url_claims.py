"""Building into object storage (``Destination``): a work folder's finished dataset
never stands in for another build, ``overwrite`` leaves no object of the old dataset, and a
prefix holding objects packer did not write is refused as a non-empty local folder is."""
from __future__ import annotations

import json
import tempfile
import warnings

import pytest
from click.testing import CliRunner

from conftest import BUCKET, s3_options
from packer import build
from packer.cli import main
from packer.demo import make_image_folder
from packer.errors import PackerError
from packer.format.manifest import MANIFEST, read_manifest
from packer.storage import Destination
from test_build_url import flags, same_as_local


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two different image folders (A, B) and B built locally, for comparison."""
    base = tmp_path_factory.mktemp("two")
    a = make_image_folder(base / "a", images=24, classes=2, seed=11)
    b = make_image_folder(base / "b", images=12, classes=3, seed=12)
    quiet(b, base / "b-local")
    return a, b, base / "b-local"


def quiet(source, dst, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(source, dst, workers=0, progress=False, shard_size=1 << 20, **kw)


def no_manifest_put(method: str, path: str) -> None:
    """The proxy's hook: the network goes away whenever the manifest is PUT."""
    if method == "PUT" and path.split("?")[0].endswith("/" + MANIFEST):
        raise ConnectionResetError("the network went away")


def failing(proxy) -> dict:
    """Options through ``proxy``, giving up after a second (one client attempt per try)."""
    return s3_options(proxy.url, packer_retry_seconds=1,
                      config_kwargs={"retries": {"max_attempts": 1}})


def stored(s3, url: str):
    """The names directly under ``url`` and its manifest (None if absent)."""
    fs, key = s3["fs"], url.split("://", 1)[1]
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(key, detail=False)) if fs.exists(key) else []
    man = json.loads(fs.cat_file(f"{key}/{MANIFEST}")) if MANIFEST in names else None
    return names, man


def test_kept_work_folder_never_stands_in_for_another_source(s3, two, tmp_path):
    a, b, _ = two
    url = f"s3://{BUCKET}/claims-kept"
    quiet(a, Destination(url, s3["options"], tmp_path / "work"))
    with pytest.raises(PackerError, match="already holds a finished dataset"):
        quiet(b, Destination(url, s3["options"], tmp_path / "work"))  # as a local folder does
    assert stored(s3, url)[1]["source"] == str(a.resolve())


def test_unuploaded_build_is_not_uploaded_for_another_source(s3, two, proxy, tmp_path, monkeypatch):
    """A's build finished locally but its manifest never went up; building B into the same URL
    must not publish A (it did, as B's result), and with overwrite gives exactly B."""
    a, b, b_local = two
    url = f"s3://{BUCKET}/claims-stale"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default work folder's home
    proxy.hook = no_manifest_put
    with pytest.raises(PackerError, match="kept failing"):
        quiet(a, Destination(url, failing(proxy)))
    assert stored(s3, url)[1] is None
    proxy.hook = None
    with pytest.raises(PackerError, match="already holds a finished dataset.*overwrite"):
        quiet(b, Destination(url, s3["options"]))  # A was published as B's build
    assert stored(s3, url)[1] is None
    r = CliRunner().invoke(main, ["build", str(b), url, "-q", "-j", "0", "--shard-size", "1M",
                                  "--overwrite"] + flags(s3["options"]))
    assert r.exit_code == 0, r.output
    same_as_local(url, b_local, s3["options"], tmp_path)


def test_overwrite_leaves_no_object_of_the_old_dataset(s3, two, tmp_path):
    """As a local overwrite removes the old dataset's files, so must one in object storage:
    the old shards the new build has no counterpart for stayed there for good."""
    a, b, b_local = two
    url = f"s3://{BUCKET}/claims-overwrite"
    old = quiet(a, Destination(url, s3["options"], tmp_path / "wa")).manifest
    quiet(b, Destination(url, s3["options"], tmp_path / "wb"), overwrite=True)
    new = read_manifest(b_local)
    assert len(old["shards"]) > len(new["shards"])
    names, man = stored(s3, url)
    assert names == sorted(p.name for p in b_local.iterdir() if not p.name.startswith("."))
    assert man["source"] == str(b.resolve())
    same_as_local(url, b_local, s3["options"], tmp_path)


def test_a_prefix_holding_objects_packer_did_not_write_is_refused(s3, two, proxy, tmp_path,
                                                                  monkeypatch):
    """As a non-empty local folder is: the build replaced a stranger's shard-00000.lmdb. Its
    own leftovers (an interrupted build, its work folder gone) are not strangers."""
    a, b, b_local = two
    url, fs = f"s3://{BUCKET}/claims-stray", s3["fs"]
    key = url.split("://", 1)[1]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t1"))
    (tmp_path / "t1").mkdir()
    fs.pipe_file(f"{key}/shard-00000.lmdb", b"someone else's")
    r = CliRunner().invoke(main, ["build", str(b), url, "-q", "-j", "0", "--overwrite"]
                           + flags(s3["options"]))
    assert r.exit_code == 1 and "did not write" in r.output and "shard-00000.lmdb" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    fs.invalidate_cache()
    assert fs.cat_file(f"{key}/shard-00000.lmdb") == b"someone else's"
    assert stored(s3, url)[0] == ["shard-00000.lmdb"]
    fs.pipe_file(f"{BUCKET}/claims-folder/", b"")  # a console's "Create folder": not a stranger
    quiet(b, Destination(f"s3://{BUCKET}/claims-folder", s3["options"]))

    url = f"s3://{BUCKET}/claims-leftovers"
    proxy.hook = no_manifest_put
    with pytest.raises(PackerError, match="kept failing"):
        quiet(b, Destination(url, failing(proxy)))
    assert "shard-00000.lmdb" in stored(s3, url)[0]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t2"))  # the work folder is gone
    (tmp_path / "t2").mkdir()
    quiet(b, Destination(url, s3["options"]))
    assert stored(s3, url)[0] == sorted(p.name for p in b_local.iterdir()
                                        if not p.name.startswith("."))
    same_as_local(url, b_local, s3["options"], tmp_path)


def test_a_bucket_that_cannot_be_written_stops_the_build_before_it_starts(s3, two, tmp_path,
                                                                         monkeypatch):
    """A missing (or write-protected) bucket was found only when the first shard, built for
    minutes, went up; now the first write is before any: one line, no work folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = CliRunner().invoke(main, ["build", str(two[1]), "s3://no-such-bucket-claims/ds", "-q",
                                  "-j", "0"] + flags(s3["options"]))
    assert r.exit_code == 1 and r.output.startswith("Error: ") and "no such bucket" in r.output
    assert "upload finished" not in r.output  # a write to a missing bucket: not "no such object"
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("packer-build-")]


def test_a_missing_object_in_a_bucket_named_bucket_is_not_a_missing_bucket():
    from packer.storage.objects import advice
    assert "no such object" in advice(FileNotFoundError("my-bucket/ds/manifest.json"))
    assert "no such bucket" in advice(FileNotFoundError("The specified bucket does not exist"))
