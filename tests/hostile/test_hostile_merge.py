"""merge is crash-safe and refuses duplicates and damaged parts.

``merge --overwrite`` stopped midway leaves no manifest (never the old manifest over new
tables) and the same command re-run finishes; a part given twice under any spelling, or a
merged dataset given with its own part (they share shard files), is refused; a part whose
labels.i32 holds a label outside its classes is a FormatError, not an IndexError or a
silently merged dataset.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import packer
from packer import PackedDataset, build, merge, verify
from packer.demo import make_image_folder
from packer.errors import FormatError, PackerError

REPO = Path(packer.__file__).resolve().parent.parent


def merge_cmd(*args) -> list:
    return [sys.executable, "-m", "packer", "merge", *map(str, args)]


def packer_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".edit")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def hardlinked_copy(src: Path, dst: Path) -> Path:
    """``cp -al``: the same files under another folder."""
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file():
            os.link(p, dst / p.name)
    return dst


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> list:
    """Two parts (--part 0/2, 1/2) of one source."""
    root = tmp_path_factory.mktemp("parts")
    src = make_image_folder(root / "src", images=24, classes=3)
    out = [root / "p0", root / "p1"]
    for k, p in enumerate(out):
        build(src, p, part=f"{k}/2", progress=False, workers=0)
    return out


@pytest.fixture(scope="module")
def separate(tmp_path_factory) -> list:
    """Two datasets of different images (not parts of one build), same classes."""
    root = tmp_path_factory.mktemp("separate")
    out = []
    for k in range(2):
        src = make_image_folder(root / f"src{k}", images=12, classes=3, seed=10 + k)
        build(src, root / f"d{k}", progress=False, workers=0)
        out.append(root / f"d{k}")
    return out


# -- crash safety ------------------------------------------------------------------------------

@pytest.mark.parametrize("blocked", ["labels.i32.tmp", "offsets.u64.tmp"])
def test_interrupted_overwrite_leaves_no_manifest_and_the_same_merge_finishes(parts, tmp_path, blocked):
    p0, p1 = parts
    dst = tmp_path / "merged"
    merge([p0, p1], dst)
    # The new merge has the other order: its tables differ from the old ones, so an old
    # manifest over new tables would give wrong labels without any error.
    (dst / blocked).mkdir()  # creating this temp file fails: the merge stops there
    with pytest.raises(Exception) as stopped:
        merge([p1, p0], dst, overwrite=True)
    assert not (dst / "manifest.json").exists(), "the old manifest survived a half-done overwrite"
    assert isinstance(stopped.value, PackerError), repr(stopped.value)
    with pytest.raises(FormatError, match="not a packer dataset|unfinished"):
        PackedDataset(dst)

    (dst / blocked).rmdir()
    merge([p1, p0], dst, overwrite=True)  # the same command again
    rep = verify(dst, progress=False)
    assert rep.ok, rep.problems
    ds = PackedDataset(dst)
    assert ds.targets == PackedDataset(p1).targets + PackedDataset(p0).targets
    assert [ds.load(i)["path"] for i in range(len(ds))] == (
        [PackedDataset(p1).load(i)["path"] for i in range(len(PackedDataset(p1)))]
        + [PackedDataset(p0).load(i)["path"] for i in range(len(PackedDataset(p0)))])


def test_merge_killed_after_writing_its_labels_can_be_rerun(parts, tmp_path):
    """A real `packer merge` SIGKILLed the moment its labels.i32 is in place (before its
    offsets and manifest): DST is no dataset, and the same command re-run finishes it."""
    p0, p1 = parts
    for attempt in range(20):
        dst = tmp_path / f"merged{attempt}"
        proc = subprocess.Popen(merge_cmd(p0, p1, dst), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=packer_env())
        deadline = time.monotonic() + 60
        while proc.poll() is None and not (dst / "labels.i32").exists() and time.monotonic() < deadline:
            pass
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if (dst / "labels.i32").exists() and not (dst / "manifest.json").exists():
            break  # killed between its tables and its manifest
    else:
        pytest.fail("could not kill the merge between its labels and its manifest in 20 tries")
    with pytest.raises(FormatError, match="not a packer dataset|unfinished"):
        PackedDataset(dst)
    rerun = subprocess.run(merge_cmd(p0, p1, dst), capture_output=True, text=True,
                           env=packer_env(), timeout=120)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    rep = verify(dst, progress=False)
    assert rep.ok, rep.problems
    assert PackedDataset(dst).targets == PackedDataset(p0).targets + PackedDataset(p1).targets


# -- duplicates --------------------------------------------------------------------------------

def test_merge_refuses_a_part_given_twice(parts, separate, tmp_path):
    p0, p1 = parts
    with pytest.raises(PackerError):
        merge([p0, p1, p0], tmp_path / "m1")
    d0, d1 = separate
    twin = hardlinked_copy(d0, tmp_path / "d0-twin")  # the same shard files, another folder
    with pytest.raises(PackerError, match="share"):
        merge([d0, d1, twin], tmp_path / "m2")
    for m in ("m1", "m2"):
        assert not (tmp_path / m / "manifest.json").exists()


def test_merge_refuses_a_merged_dataset_with_its_own_part(separate, tmp_path):
    d0, d1 = separate
    both = tmp_path / "both"
    merge([d0, d1], both)
    for n, group in enumerate([[d0, both], [both, d1]]):
        dst = tmp_path / f"again{n}"
        with pytest.raises(PackerError, match="share"):
            merge(group, dst)
        assert not (dst / "manifest.json").exists()
    assert verify(both, progress=False).ok


# -- damaged parts -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad_label", [7, -1])
def test_label_outside_classes_in_a_part_is_a_format_error(separate, tmp_path, bad_label):
    d0, d1 = separate
    part = hardlinked_copy(d0, tmp_path / "part")
    labels = bytearray((d0 / "labels.i32").read_bytes())
    struct.pack_into("<i", labels, 4 * 3, bad_label)  # record 3: a class that does not exist
    (part / "labels.i32").unlink()  # a new file, not the shared one
    (part / "labels.i32").write_bytes(bytes(labels))
    man = json.loads((part / "manifest.json").read_text())
    man["labels"]["sha256"] = hashlib.sha256(bytes(labels)).hexdigest()
    (part / "manifest.json").unlink()
    write_json(part / "manifest.json", man)

    dst = tmp_path / "merged"
    with pytest.raises(FormatError, match="outside"):
        merge([part, d1], dst)
    assert not (dst / "manifest.json").exists()
