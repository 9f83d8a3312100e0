"""packer/merging.py: merged parts hold exactly the whole build's records.

tests/test_builder.py covers the rest (no shard copied, relative shard paths, ImageFolder order
of the parts, verify, the same folder given twice, a folder that is not a dataset)."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

import packer
from packer import merge
from packer.reading import ShardReader
from packer.demo import make_image_folder
from packer.errors import FormatError, PackerError
from packer.format.tables import read_labels, read_offsets


def build(src, dst, **kw) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packer.build(src, dst, progress=False, workers=0, **kw)
    return Path(dst)


def contents(root):
    """{source path: (label from labels.i32, record bytes)} of a dataset."""
    r = ShardReader(root)
    try:
        labels = read_labels(root)
        out = {}
        for i in range(len(r)):
            data = r.read(i)
            out[r.record(i)["path"]] = (labels[i], data)
        assert len(out) == len(r)  # no path twice
        return out
    finally:
        r.close()


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Source, whole build, and its two parts; read-only."""
    base = tmp_path_factory.mktemp("merging")
    src = make_image_folder(base / "src", images=24, classes=3)
    whole = build(src, base / "whole")
    parts = [build(src, base / f"p{k}", part=f"{k}/2") for k in range(2)]
    return src, whole, parts


def test_merged_parts_equal_the_whole_build(datasets, tmp_path):
    src, whole, parts = datasets
    m = merge(parts, tmp_path / "all")
    assert m["count"] == 24 and len(m["shards"]) == sum(
        len(json.loads((p / "manifest.json").read_text())["shards"]) for p in parts) >= 2
    assert contents(tmp_path / "all") == contents(whole)
    w = json.loads((whole / "manifest.json").read_text())
    assert m["classes"] == w["classes"] and m["class_counts"] == w["class_counts"] == [8, 8, 8]
    assert m["options"]["part"] is None and m["options"]["merged_from"] == [str(p) for p in parts]
    # the merged offsets table is the parts' tables one after the other (offsets are per shard)
    assert list(read_offsets(tmp_path / "all")) == list(read_offsets(parts[0])) + list(read_offsets(parts[1]))


def test_merging_a_merged_dataset(datasets, tmp_path):
    _, whole, parts = datasets
    merge([parts[1]], tmp_path / "one")
    merge([parts[0], tmp_path / "one"], tmp_path / "again" / "nested")
    assert contents(tmp_path / "again" / "nested") == contents(whole)


def test_the_cli_names_the_parts_a_merge_lacks(datasets, tmp_path):
    """A merge of some parts is allowed (the rest may come later), but not silent."""
    from click.testing import CliRunner
    from packer.cli import main
    _, _, parts = datasets
    r = CliRunner().invoke(main, ["merge", str(parts[1]), str(tmp_path / "one")])
    assert r.exit_code == 0 and "note: parts 0/2 of the build are not in it" in r.output
    r = CliRunner().invoke(main, ["merge", str(parts[0]), str(tmp_path / "one"),
                                  str(tmp_path / "all"), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["missing_parts"] == []
    assert "note:" not in CliRunner().invoke(main, ["merge", *map(str, parts), str(tmp_path / "b")]).output


def test_the_same_part_built_twice_is_refused(datasets, tmp_path):
    src, _, parts = datasets
    again = build(src, tmp_path / "p0-again", part="0/2")
    with pytest.raises(PackerError, match=r"p0-again is the same part as .*p0 .*duplicate its records"):
        merge([parts[0], parts[1], again], tmp_path / "m")
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_different_classes_are_refused(datasets, tmp_path):
    _, _, parts = datasets
    other = build(make_image_folder(tmp_path / "other_src", images=4, classes=2), tmp_path / "other")
    with pytest.raises(PackerError, match="other has different classes from .*p0"):
        merge([parts[0], other], tmp_path / "m")
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_different_fields_are_refused(datasets, tmp_path):
    """Same classes (none), other fields: merged, the second part's records would lack the
    fields its manifest's schema promises."""
    jpeg = next(datasets[0].rglob("*.jpg")).read_bytes()
    a, b = tmp_path / "a", tmp_path / "b"
    packer.write(a, [{"image": jpeg, "score": 0.5}], progress=False)
    packer.write(b, [{"image": jpeg, "n": 3}], progress=False)
    with pytest.raises(PackerError, match=r"b has different fields from .*a; "):
        merge([a, b], tmp_path / "m")
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_merge_into_one_of_its_parts_is_refused_even_with_overwrite(datasets, tmp_path):
    """overwrite=True would first remove the part's own dataset (its manifest, its tables)."""
    parts = [Path(shutil.copytree(p, tmp_path / p.name)) for p in datasets[2]]
    before = contents(parts[0])
    with pytest.raises(PackerError, match=r"DST .*p0 is one of the parts"):
        merge(parts, parts[0], overwrite=True)
    assert contents(parts[0]) == before


@pytest.mark.parametrize("options", [{"part": "x/y"}, {"part": None, "merged_parts": 7}])
def test_a_part_whose_manifest_holds_no_parts_is_a_format_error(datasets, tmp_path, options):
    parts = [Path(shutil.copytree(p, tmp_path / p.name)) for p in datasets[2]]
    man = json.loads((parts[1] / "manifest.json").read_text())
    man["options"].update(options)
    (parts[1] / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(FormatError, match=r"p1: its manifest's parts .* are not K/N"):
        merge(parts, tmp_path / "m")
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_existing_dst_needs_overwrite(datasets, tmp_path):
    _, whole, parts = datasets
    dst = build(datasets[0], tmp_path / "dst", part="1/2")  # a finished dataset already there
    before = (dst / "manifest.json").read_bytes()
    with pytest.raises(PackerError, match="already holds a finished dataset; .*overwrite=True"):
        merge(parts, dst)
    assert (dst / "manifest.json").read_bytes() == before
    merge(parts, dst, overwrite=True)
    assert contents(dst) == contents(whole)


def test_no_parts():
    with pytest.raises(PackerError, match="at least one part"):
        merge([], "/nonexistent/dst")


@pytest.mark.parametrize("other, match", [
    ({"part": "1/2", "shuffle": True, "seed": 2}, r"was not built like"),
    ({"part": "1/3"}, r"p1 \(part 1/3\) was not built like .*\(part 0/2\)"),
    ({"part": "1/2", "transcode": packer.Transcode(max_side=64)}, r"was not built like"),
    ({"part": "00/2"}, r"p1 holds part 0/2, as .*p0 does"),
    ({}, r"was not built with --part K/N but .*p0 was"),
])
def test_parts_of_other_commands_are_refused(datasets, tmp_path, other, match):
    # parts are slices of one (shuffled) order: another seed or N repeats and loses records
    src, _, parts = datasets
    p1 = build(src, tmp_path / "p1", **other)
    with pytest.raises(PackerError, match=match):
        merge([parts[0], p1], tmp_path / "m")
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_parts_of_a_copy_of_src_or_other_storage_options_merge(datasets, tmp_path):
    # each node may pack its own copy of SRC; only what picks a part's records must agree
    import shutil
    src, whole, parts = datasets
    copy = shutil.copytree(src, tmp_path / "node1" / src.name)
    p1 = build(copy, tmp_path / "p1", part="1/2", shard_size=2 << 20)
    merge([parts[0], p1], tmp_path / "m")
    assert contents(tmp_path / "m") == contents(whole)
    # but a part of another source (of other images, the same classes) is refused
    other = shutil.copytree(src, tmp_path / "val")
    with pytest.raises(PackerError, match="was not built like"):
        merge([parts[0], build(other, tmp_path / "v1", part="1/2")], tmp_path / "m2")


def test_parts_cut_from_copies_of_src_that_differ_are_refused(datasets, tmp_path):
    """Each node's copy of SRC must list the same files: a copy lacking one image shifts
    the strided parts, so the merge would repeat some records and lose others."""
    import shutil
    src, _, parts = datasets
    copy = shutil.copytree(src, tmp_path / "node1" / src.name)
    next(iter(sorted((copy / "class_01").iterdir()))).unlink()
    p1 = build(copy, tmp_path / "p1", part="1/2")
    assert json.loads((p1 / "manifest.json").read_text())["options"]["part_of"]
    with pytest.raises(PackerError, match=r"p1 \(part 1/2\) was cut from another listing than "
                                          r".*p0 \(part 0/2\): its copy of SRC holds other files"):
        merge([parts[0], p1], tmp_path / "m")
    assert not (tmp_path / "m").exists() or not (tmp_path / "m" / "manifest.json").exists()


def test_parts_built_before_parts_recorded_their_listing_resume_and_merge(datasets, tmp_path):
    """A part of an older packer (no ``part_of``; the same fingerprint) is finished for a re-run
    of its command, and merges with a part that records its listing."""
    src, whole, parts = datasets
    old = build(src, tmp_path / "old1", part="1/2")
    man = json.loads((old / "manifest.json").read_text())
    del man["options"]["part_of"]
    (old / "manifest.json").write_text(json.dumps(man))
    before = (old / "manifest.json").read_bytes()
    build(src, old, part="1/2")  # the same command again: nothing to do, not "already holds"
    assert (old / "manifest.json").read_bytes() == before
    merge([parts[0], old], tmp_path / "m")
    assert contents(tmp_path / "m") == contents(whole)


def test_a_dataset_merged_before_merges_recorded_their_parts_still_merges(datasets, tmp_path):
    src, whole, parts = datasets
    one = tmp_path / "one"
    merge([parts[1]], one)
    man = json.loads((one / "manifest.json").read_text())
    del man["options"]["merged_parts"]  # as older merges wrote it
    (one / "manifest.json").write_text(json.dumps(man))
    m = merge([parts[0], one], tmp_path / "all")
    assert m["options"]["merged_parts"] is None  # unknown from then on
    assert contents(tmp_path / "all") == contents(whole)


def test_a_merged_dataset_remembers_its_parts(datasets, tmp_path):
    src, whole, parts = datasets
    one, again = tmp_path / "one", build(src, tmp_path / "p1-again", part="1/2")
    assert merge([again], one)["options"]["merged_parts"] == ["1/2"]
    with pytest.raises(PackerError, match="one holds part 1/2, as .*p1 does"):
        merge([parts[1], one], tmp_path / "twice")
    m = merge([parts[0], one], tmp_path / "all")
    assert m["options"]["merged_parts"] == ["0/2", "1/2"]
    assert contents(tmp_path / "all") == contents(whole)


def test_coco_parts_keep_the_images_left_out(tmp_path):
    from packer.demo.scenes import make_detection_folder
    from packer.sources import Coco
    scenes = make_detection_folder(tmp_path / "scenes", images=12, empty_fraction=0.25)
    src = Coco(scenes / "images", scenes / "annotations.json", skip_empty=True)
    whole = packer.build(src, tmp_path / "whole", progress=False, workers=0)
    parts = [packer.build(src, tmp_path / f"p{k}", part=f"{k}/2", progress=False, workers=0)
             .manifest for k in range(2)]
    assert whole.manifest["skipped_empty"] == parts[0]["skipped_empty"] > 0
    m = merge([tmp_path / "p0", tmp_path / "p1"], tmp_path / "m")
    assert m["skipped_empty"] == whole.manifest["skipped_empty"]
