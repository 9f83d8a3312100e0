"""`packer merge` of parts in object storage: into the same bucket (no shard copied) or a local DST."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import BUCKET
from packer import PackedDataset, build, merge, verify
from packer.cli import main
from packer.demo import make_image_folder
from packer.errors import PackerError
from packer.format.manifest import MANIFEST
from packer.reading.reader import ShardReader
from packer.storage import Destination
from test_build_url import flags


@pytest.fixture(scope="module")
def parts(s3, tmp_path_factory):
    """Two parts of one source, built locally and into s3://BUCKET/mparts/p0, p1."""
    base = tmp_path_factory.mktemp("mparts")
    src = make_image_folder(base / "src", images=16, classes=2, seed=7)
    urls, local = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in range(2):
            urls.append(f"s3://{BUCKET}/mparts/p{k}")
            local.append(base / f"p{k}")
            build(src, local[-1], workers=0, progress=False, part=f"{k}/2")
            build(src, Destination(urls[-1], s3["options"]), workers=0, progress=False, part=f"{k}/2")
    merge(local, base / "merged")
    return urls, base / "merged"


def same_records(ds: PackedDataset, local: Path) -> None:
    reader = ShardReader(local)
    assert len(ds) == len(reader) > 0
    assert all(ds.reader.read(i) == reader.read(i) for i in range(len(reader)))
    reader.close()


def test_merge_in_the_bucket_copies_no_shard(s3, parts, tmp_path):
    urls, local = parts
    dst = f"s3://{BUCKET}/mparts/merged"
    m = merge(urls, dst, storage_options=s3["options"])
    assert [s["path"] for s in m["shards"]][0].startswith("../p0/")
    assert m["options"]["merged_from"] == urls
    names = {k.rsplit("/", 1)[1] for k in s3["fs"].ls(dst.split("://")[1], refresh=True)}
    assert MANIFEST in names and not [n for n in names if n.endswith(".lmdb")]
    same_records(PackedDataset(dst, cache_dir=tmp_path / "c", storage_options=s3["options"]), local)
    r = CliRunner().invoke(main, ["merge", *urls, dst] + flags(s3["options"]))
    assert r.exit_code == 1 and "already holds a finished dataset" in r.output


def test_cli_merge_urls_into_a_local_folder(s3, parts, tmp_path):
    urls, local = parts
    r = CliRunner().invoke(main, ["merge", *urls, str(tmp_path / "m")] + flags(s3["options"]))
    assert r.exit_code == 0, r.output
    assert "merged 2 parts" in r.output
    same_records(PackedDataset(tmp_path / "m"), local)
    assert verify(tmp_path / "m", quick=True, progress=False).ok
    assert (tmp_path / "m.parts" / "p0" / MANIFEST).is_file()  # the parts, fetched beside it


def test_merge_into_a_url_outside_the_parts_bucket_is_refused(s3, parts):
    urls, local = parts
    with pytest.raises(PackerError, match="needs every part in its bucket"):
        merge([local.parent / "p0", urls[1]], f"s3://{BUCKET}/mixed", storage_options=s3["options"])
    assert not s3["fs"].exists(f"{BUCKET}/mixed")


def test_merge_into_one_of_its_parts_is_refused_and_the_part_kept(s3, parts):
    """--overwrite would unmake DST (its manifest, then its shards) before the parts are
    fetched: a DST that is a part is refused first, as a local merge refuses it."""
    urls, _ = parts
    before = sorted(s3["fs"].ls(urls[0].split("://")[1], refresh=True))
    r = CliRunner().invoke(main, ["merge", *urls, urls[0] + "/", "--overwrite"] + flags(s3["options"]))
    assert r.exit_code == 1 and "is one of the parts" in r.output, r.output
    assert sorted(s3["fs"].ls(urls[0].split("://")[1], refresh=True)) == before
