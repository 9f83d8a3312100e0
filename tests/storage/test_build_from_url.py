"""Building FROM object storage: an ImageFolder under a prefix, and --list/--coco/--meta files
named by URL, give the same shards as the same files on disk; faults are retried or stop the
build clearly, and a re-run resumes."""
from __future__ import annotations

import json
import warnings

import pytest
from click.testing import CliRunner

from conftest import BUCKET, SECRET, s3_options
from packer import build
from packer.cli import main
from packer.demo import make_image_folder
from packer.demo.scenes import make_detection_folder
from packer.errors import PackerError
from packer.format.manifest import read_manifest
from packer.sources import Coco, FileList, ImageFolder, Table, Yolo


def shards(dst):
    man = read_manifest(dst)
    return [s["sha256"] for s in man["shards"]], man["count"], man.get("skipped", [])


def quiet_build(source, dst, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(source, dst, progress=False, shard_size=1 << 20, **kw)


@pytest.fixture(scope="module")
def photos(tmp_path_factory, s3):
    """A local ImageFolder (with a broken file) and its copy under s3://BUCKET/photos."""
    src = make_image_folder(tmp_path_factory.mktemp("photos") / "src", images=30, classes=3,
                            seed=4)
    (src / "class_01" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a whole JPEG")
    s3["fs"].put(str(src) + "/", f"{BUCKET}/photos/", recursive=True)
    return src, f"s3://{BUCKET}/photos"


@pytest.fixture(scope="module")
def scenes(tmp_path_factory, s3):
    """A COCO detection folder and its copy under s3://BUCKET/scenes."""
    src = make_detection_folder(tmp_path_factory.mktemp("scenes") / "src", images=24, seed=2,
                                workers=1)
    rows = [{"path": f"{i:06d}.jpg", "caption": f"scene {i}", "score": i / 10}
            for i in range(24)]
    (src / "meta.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = sorted((src / "labels").glob("*.txt"))[0]  # an invalid line: the image is left out
    first.write_text(first.read_text() + "0 0.5 0.5 2.5 0.1\n")
    s3["fs"].put(str(src) + "/", f"{BUCKET}/scenes/", recursive=True)
    return src, f"s3://{BUCKET}/scenes"


def test_imagefolder_under_a_prefix_equals_the_local_build(photos, s3, tmp_path):
    src, url = photos
    quiet_build(src, tmp_path / "local", workers=2)
    res = CliRunner().invoke(main, ["build", url, str(tmp_path / "remote"), "-q", "-j", "2",
                                    "--shard-size", "1M", *opts_flags(s3["options"])])
    assert res.exit_code == 0, res.output
    assert SECRET not in res.output
    assert shards(tmp_path / "remote") == shards(tmp_path / "local")
    man = read_manifest(tmp_path / "remote")
    assert man["source"] == url and man["classes"] == ["class_00", "class_01", "class_02"]
    assert [s["path"] for s in man["skipped"]] == ["class_01/broken.jpg"]


def test_coco_table_and_list_by_url_equal_the_local_builds(scenes, s3, tmp_path):
    src, url = scenes
    opts = s3["options"]
    images = str(src / "images")
    quiet_build(Coco(images, src / "annotations.json"), tmp_path / "coco-local", workers=0)
    quiet_build(Coco(f"{url}/images", f"{url}/annotations.json", storage_options=opts),
                tmp_path / "coco-url", workers=2)
    assert shards(tmp_path / "coco-url") == shards(tmp_path / "coco-local")
    quiet_build(Table(images, src / "meta.jsonl"), tmp_path / "meta-local", workers=0)
    quiet_build(Table(f"{url}/images", f"{url}/meta.jsonl", storage_options=opts),
                tmp_path / "meta-url", workers=1)
    assert shards(tmp_path / "meta-url") == shards(tmp_path / "meta-local")
    lines = "".join(f"{i:06d}.jpg\t{i % 3}\n" for i in range(0, 24, 2))
    (src / "list.txt").write_text(lines)
    s3["fs"].pipe(f"{BUCKET}/scenes/images/list.txt", lines.encode())
    quiet_build(FileList(src / "list.txt", root=images), tmp_path / "list-local", workers=0)
    quiet_build(FileList(f"{url}/images/list.txt", storage_options=opts),  # root: the list's
                tmp_path / "list-url", workers=0)
    assert shards(tmp_path / "list-url") == shards(tmp_path / "list-local")


def test_yolo_by_url_equals_the_local_build(scenes, s3, tmp_path):
    src, url = scenes
    quiet_build(Yolo(src / "images", src / "labels", src / "data.yaml"), tmp_path / "local",
                workers=0)
    res = CliRunner().invoke(main, ["build", f"{url}/images", str(tmp_path / "url"), "-q",
                                    "--yolo", f"{url}/labels", "--names", f"{url}/data.yaml",
                                    "--shard-size", "1M", *opts_flags(s3["options"])])
    assert res.exit_code == 0, res.output
    assert shards(tmp_path / "url") == shards(tmp_path / "local")
    skipped = shards(tmp_path / "url")[2]
    assert len(skipped) == 1 and skipped[0]["reason"].startswith("annotation: labels/000000.txt:")


def test_limits_and_missing_objects_are_skipped_as_on_disk(scenes, s3, tmp_path):
    src, url = scenes
    ann = json.loads((src / "annotations.json").read_text())
    ann["images"].append(dict(ann["images"][0], id=999, file_name="gone.jpg"))
    s3["fs"].pipe(f"{BUCKET}/scenes/more.json", json.dumps(ann).encode())
    quiet_build(Coco(f"{url}/images", f"{url}/more.json", storage_options=s3["options"]),
                tmp_path / "d", workers=0, checks=__import__("packer").Checks(
                    max_image_bytes=60_000))
    reasons = {s["path"]: s["reason"] for s in read_manifest(tmp_path / "d")["skipped"]}
    assert reasons.pop("gone.jpg") == "unreadable: not found"
    assert reasons and all("more than max_image_bytes (60,000)" in r for r in reasons.values())


def test_faults_are_retried_and_a_dead_store_stops_the_build_which_resumes(
        photos, proxy, s3, tmp_path):
    src, url = photos
    quiet_build(src, tmp_path / "local", workers=0)
    proxy.faults = ["reset", "503", "truncate", "503", "reset"]
    quiet_build(ImageFolder(url, storage_options=s3_options(proxy.url)), tmp_path / "a",
                workers=0)
    assert proxy.faults == [] and shards(tmp_path / "a") == shards(tmp_path / "local")

    folder = ImageFolder(url, storage_options=s3_options(
        proxy.url, packer_retry_seconds=1,
        config_kwargs={"read_timeout": 1, "connect_timeout": 2, "retries": {"max_attempts": 1}}))
    folder.root.sizes()  # listed while the store is up; then the last class's objects fail

    def down(method, path):
        if "class_02" in path:
            raise ConnectionResetError("the store went away")
    proxy.hook = down
    with pytest.raises(PackerError, match="kept failing"):
        quiet_build(folder, tmp_path / "b", workers=0)
    assert not (tmp_path / "b" / "manifest.json").exists()
    proxy.hook = None
    res = quiet_build(ImageFolder(url, storage_options=s3_options(proxy.url)), tmp_path / "b",
                      workers=0)
    assert res.resumed_shards >= 1 and shards(tmp_path / "b") == shards(tmp_path / "local")


def test_clear_errors_for_what_cannot_be_read(s3):
    with pytest.raises(PackerError, match="no objects in class folders under"):
        ImageFolder(f"s3://{BUCKET}/nothing-here", storage_options=s3["options"]).read()
    with pytest.raises(PackerError, match="does not exist"):
        Coco(f"s3://{BUCKET}/scenes/images", f"s3://{BUCKET}/scenes/none.json",
             storage_options=s3["options"]).read()


def opts_flags(options: dict):
    out = []
    for k, v in options.items():
        out += ["--storage-option", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return out


def test_keys_that_are_no_plain_path_are_left_out(photos, s3, tmp_path):
    """S3 keys are any strings: ``x/../class_00/NAME`` would be read as class_00/NAME (another
    object) and add a class "x"; such keys are left out with a warning."""
    import boto3
    src, _ = photos
    s3["fs"].put(str(src) + "/", f"{BUCKET}/dotted/", recursive=True)
    name = sorted(p.name for p in (src / "class_00").iterdir())[0]
    client = boto3.client("s3", endpoint_url=s3["endpoint"], aws_access_key_id=s3["options"]["key"],
                          aws_secret_access_key=SECRET, region_name="us-west-2")
    for key in (f"dotted/x/../class_00/{name}", f"dotted/class_02//{name}"):
        client.put_object(Bucket=BUCKET, Key=key, Body=(src / "class_00" / name).read_bytes())
    quiet_build(src, tmp_path / "local", workers=0)
    with pytest.warns(UserWarning, match=r"2 object\(s\) under .*dotted have keys that are no plain path"):
        build(ImageFolder(f"s3://{BUCKET}/dotted", storage_options=s3["options"]),
              tmp_path / "remote", workers=0, progress=False, shard_size=1 << 20)
    assert shards(tmp_path / "remote") == shards(tmp_path / "local")
