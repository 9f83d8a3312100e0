"""Every manifest field is checked before it drives any work.

A real dataset is built once; each test gives a copy of it one hostile ``manifest.json``
(or side table) and opens it through every entry point: ``verify``, ``PackedDataset``,
``PackedIterableDataset`` (iterated), ``stage``, ``merge`` and the ``packer`` command. Each
must answer with a ``FormatError`` naming the field — never a TypeError, KeyError,
RecursionError or MemoryError, never a hang, and never after copying anything.
"""
from __future__ import annotations

import json
import os
import pickle
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import packer
from helpers import limited_packer_cli
from packer import PackedDataset, PackedIterableDataset, build, merge, stage, verify
from packer.demo import make_image_folder
from packer.errors import FormatError

PKG_PARENT = str(Path(packer.__file__).resolve().parents[1])
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    p for p in (PKG_PARENT, os.environ.get("PYTHONPATH")) if p))
HUGE = 10 ** 12


# -- helpers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A real 24-image dataset (read-only: tests work on ``clone`` copies)."""
    tmp = tmp_path_factory.mktemp("manifest")
    src = make_image_folder(tmp / "src", images=24, classes=3)
    build(src, tmp / "dst", workers=0, progress=False)
    return tmp / "dst"


@pytest.fixture
def clone(base, tmp_path) -> Path:
    """A copy of ``base``: data files hard-linked (never written), the manifest a new file."""
    root = tmp_path / "ds"
    shutil.copytree(base, root, copy_function=os.link)
    (root / "manifest.json").unlink()
    shutil.copyfile(base / "manifest.json", root / "manifest.json")
    return root


def load(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def save(root: Path, man) -> None:
    (root / "manifest.json").write_text(json.dumps(man, indent=1))


def run_packer(*args, limit_as=None, timeout=30):
    """``packer ARGS`` in a child; ``limit_as``: bytes of address space it may add after
    importing torch and packer."""
    env = dict(ENV, PACKER_TEST_EXTRA_AS=str(limit_as or 0))
    return subprocess.run(limited_packer_cli(limit_as or 0) + [str(a) for a in args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def iterate(root):
    return next(iter(PackedIterableDataset(root, decode=bytes, shuffle=False)))


def entry_points(tmp: Path):
    """(name, call) for each library entry point that takes a dataset folder."""
    return [
        ("verify", lambda root: verify(root, progress=False)),
        ("verify --quick", lambda root: verify(root, quick=True, progress=False)),
        ("PackedDataset", lambda root: PackedDataset(root, decode=bytes)[0]),
        ("PackedIterableDataset", iterate),
        ("stage", lambda root: stage(root, tmp / "staged", progress=False)),
        ("merge", lambda root: merge([root], tmp / "merged")),
    ]


def in_child(fn, *args, timeout=20.0, more_memory=1 << 30):
    """``fn(*args)`` in a forked child allowed ``more_memory`` bytes of address space beyond
    what it starts with, killed after ``timeout`` s: a manifest that drove work without bound
    fails the test instead of taking the test process (or the machine) down with it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send back ("ok", value) or ("raised", text), exit at once
        try:
            os.close(r)
            vm = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) << 10
            resource.setrlimit(resource.RLIMIT_AS, (vm + more_memory, vm + more_memory))
            result = ("ok", fn(*args))
        except BaseException as e:
            result = ("raised", f"{type(e).__name__}: {e}")
        try:
            data = pickle.dumps(result)
        except BaseException:
            data = pickle.dumps(("raised", "unpicklable result"))
        os.write(w, len(data).to_bytes(8, "little"))
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
        os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"{getattr(fn, '__name__', fn)} ran past {timeout} s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    assert len(data) >= 8, f"the child died (status {status:#x}) before answering"
    kind, value = pickle.loads(data[8:])
    assert kind == "ok", value
    return value


def _outcomes(root: Path, tmp: Path):
    out = []
    for name, call in entry_points(tmp):
        t0 = time.perf_counter()
        try:
            result = call(root)
            kind, text = "returned", repr(getattr(result, "problems", result))[:2000]
        except FormatError as e:
            kind, text = "FormatError", str(e)
        except Exception as e:
            kind, text = type(e).__name__, str(e)[:2000]
        out.append((name, kind, text, time.perf_counter() - t0))
    return out


def outcomes(root: Path, tmp: Path):
    """(entry point, "FormatError" | "returned" | other exception name, text, seconds) for
    every library entry point opening ``root``, run in a guarded child process."""
    return in_child(_outcomes, root, tmp)


def refused_everywhere(root: Path, tmp: Path, field: str, seconds: float = 1.0) -> None:
    """Every entry point raises a FormatError naming ``field``, within ``seconds``, having
    created nothing."""
    for name, kind, text, took in outcomes(root, tmp):
        assert kind == "FormatError", (name, kind, text)
        assert f"field {field!r}" in text, (name, text)
        assert took < seconds, f"{name} took {took:.2f} s"
    assert not (tmp / "staged").exists(), "stage created TARGET for a refused dataset"
    assert not (tmp / "merged" / "manifest.json").exists()


def shard(man):
    return man["shards"][0]


def set_shard(**kw):
    return lambda m: shard(m).update(kw)


def set_table(kind, **kw):
    return lambda m: m[kind].update(kw)


def put(**kw):
    return lambda m: m.update(kw)


def huge_count_in_shards(m):
    m["count"] = shard(m)["count"] = HUGE


def two_shards_one_file(m):
    s = shard(m)
    m["shards"] = [dict(s, count=12), dict(s, count=12)]
    m["bytes"] = 2 * s["bytes"]


def label_field_typed_float(m):
    next(f for f in m["schema"]["fields"] if f["name"] == "label")["type"] = "float"


def column_for_a_field_without_one(m):
    """A str field (no side table) given a column entry whose dtype is null."""
    m["schema"]["fields"].append({"name": "note", "type": "str"})
    m["columns"]["note"] = dict(m["columns"]["width"], dtype=None)


# (case id, change to the manifest, the field the FormatError must name)
CASES = [
    ("count-string", put(count="24"), "count"),
    ("count-negative", put(count=-1), "count"),
    ("count-float", put(count=24.0), "count"),
    ("count-bool", put(count=True), "count"),
    ("count-huge", put(count=HUGE), "count"),
    ("count-huge-in-shards", huge_count_in_shards, "shards[0].count"),
    ("count-missing", lambda m: m.pop("count"), "count"),
    ("bytes-lying", lambda m: m.update(bytes=m["bytes"] + 4096), "bytes"),
    ("bytes-string", lambda m: m.update(bytes=str(m["bytes"])), "bytes"),
    ("shards-not-list", lambda m: m.update(shards=shard(m)), "shards"),
    ("shards-empty", put(shards=[]), "shards"),
    ("shards-null", put(shards=None), "shards"),
    ("shard-not-dict", put(shards=["shard-00000.lmdb"]), "shards[0]"),
    ("shard-path-absolute", set_shard(path="/etc/passwd"), "shards[0].path"),
    ("shard-path-dotdot-inside", set_shard(path="a/../shard-00000.lmdb"), "shards[0].path"),
    ("shard-path-dotdot-name", set_shard(path="../.."), "shards[0].path"),
    ("shard-path-dot", set_shard(path="./shard-00000.lmdb"), "shards[0].path"),
    ("shard-path-backslash", set_shard(path="..\\..\\etc\\passwd"), "shards[0].path"),
    ("shard-path-nul", set_shard(path="shard-00000.lmdb\0.txt"), "shards[0].path"),
    ("shard-path-empty", set_shard(path=""), "shards[0].path"),
    ("shard-path-int", set_shard(path=0), "shards[0].path"),
    ("shard-path-repeated", two_shards_one_file, "shards[1].path"),
    ("shard-path-packer-temp", set_shard(path="manifest.json.tmp"), "shards[0].path"),
    ("shard-path-manifest", set_shard(path="manifest.json"), "shards[0].path"),
    ("shard-path-hidden", set_shard(path=".shard-00000.lmdb"), "shards[0].path"),
    ("shard-count-negative", lambda m: (shard(m).update(count=-1), m.update(count=-1)),
     "count"),
    ("shard-count-string", set_shard(count="24"), "shards[0].count"),
    ("shard-bytes-negative", set_shard(bytes=-1), "shards[0].bytes"),
    ("shard-sha256-null", set_shard(sha256=None), "shards[0].sha256"),
    ("shard-sha256-not-hex", set_shard(sha256="z" * 64), "shards[0].sha256"),
    ("shard-sha256-short", set_shard(sha256="ab" * 8), "shards[0].sha256"),
    ("labels-path-dev-zero", set_table("labels", path="/dev/zero"), "labels.path"),
    ("labels-path-up", set_table("labels", path="../../etc/passwd"), "labels.path"),
    ("labels-path-sub", set_table("labels", path="sub/labels.i32"), "labels.path"),
    ("labels-path-packer-temp", set_table("labels", path="labels.i32.tmp"), "labels.path"),
    ("labels-not-object", put(labels="labels.i32"), "labels"),
    ("labels-missing", lambda m: m.pop("labels"), "labels"),
    ("labels-bytes-wrong", set_table("labels", bytes=95), "labels.bytes"),
    ("labels-bytes-huge", set_table("labels", bytes=4 * HUGE), "labels.bytes"),
    ("labels-sha256-null", set_table("labels", sha256=None), "labels.sha256"),
    ("offsets-path-absolute", set_table("offsets", path="/dev/zero"), "offsets.path"),
    ("offsets-bytes-wrong", set_table("offsets", bytes=16 * 23), "offsets.bytes"),
    ("classes-not-list", put(classes="abc"), "classes"),
    ("classes-not-strings", put(classes=[0, 1, 2]), "classes"),
    ("classes-duplicated", put(classes=["class_00", "class_00", "class_02"]), "classes"),
    ("class_to_idx-inconsistent",
     put(class_to_idx={"class_00": 1, "class_01": 0, "class_02": 2}), "class_to_idx"),
    ("class_to_idx-not-object", put(class_to_idx=["class_00"]), "class_to_idx"),
    ("class_counts-short", put(class_counts=[8, 8]), "class_counts"),
    ("class_counts-negative", put(class_counts=[8, -8, 8]), "class_counts"),
    ("skipped-not-list", put(skipped="none"), "skipped"),
    ("skipped-entry-not-object", put(skipped=[["a.jpg", "broken"]]), "skipped[0]"),
    ("skipped-path-int", put(skipped=[{"path": 7, "reason": "broken"}]), "skipped[0].path"),
    ("skipped-reason-missing", put(skipped=[{"path": "a.jpg"}]), "skipped[0].reason"),
    ("options-not-object", put(options=["shuffle"]), "options"),
    ("dropped_count-bool", put(dropped_count=True), "dropped_count"),
    ("schema-task-unknown", lambda m: m["schema"].update(task="segmentation"), "schema"),
    ("schema-label-not-int", label_field_typed_float, "schema.fields"),
    ("column-dtype-null", column_for_a_field_without_one, "columns.note"),
    ("paths-index-path-up", lambda m: m["paths"]["index"].update(path="../../etc/passwd"),
     "paths.index.path"),
    ("paths-text-path-dev-zero", lambda m: m["paths"]["text"].update(path="/dev/zero"),
     "paths.text.path"),
    ("paths-index-bytes-wrong", lambda m: m["paths"]["index"].update(bytes=8 * 23),
     "paths.index.bytes"),
    ("source-not-string", put(source=["/src"]), "source"),
]


@pytest.mark.parametrize("change, field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_field_is_a_format_error_naming_it(clone, tmp_path, change, field):
    man = load(clone)
    change(man)
    save(clone, man)
    refused_everywhere(clone, tmp_path, field)


# -- through the command, fast -----------------------------------------------------------------

CLI_CASES = ["count-huge", "count-huge-in-shards", "shard-path-absolute", "shard-sha256-null",
             "labels-path-dev-zero", "classes-not-strings"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_field_through_the_command(clone, case):
    change, field = {c[0]: c[1:] for c in CASES}[case]
    man = load(clone)
    change(man)
    save(clone, man)
    for args in (["ls"], ["info"], ["info", "--json"], ["verify", "-q"], ["cat", "-o", "/dev/null"]):
        args = args[:1] + [clone] + ([0] if args[0] == "cat" else []) + args[1:]
        t0 = time.perf_counter()
        p = run_packer(*args, timeout=20)
        took = time.perf_counter() - t0
        assert p.returncode == 1, (args, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
        assert p.stderr.startswith("Error: ") and f"field {field!r}" in p.stderr, p.stderr
        assert took < 10, f"packer {args[0]} took {took:.1f} s"


def test_huge_count_with_consistent_sizes_fails_fast(clone, tmp_path):
    """count 10**12 with every size in the manifest agreeing: only the real files disagree.
    Nothing may size an allocation or a loop by the manifest's numbers."""
    man = load(clone)
    s = shard(man)
    man["count"] = s["count"] = HUGE
    man["bytes"] = s["bytes"] = 16 * HUGE
    man["labels"]["bytes"] = 4 * HUGE
    man["offsets"]["bytes"] = 16 * HUGE
    man["paths"]["index"]["bytes"] = 8 * HUGE
    for col in man["columns"].values():
        col["bytes"] = {"int32": 4, "int64": 8, "float64": 8, "uint8": 1}[col["dtype"]] * HUGE
    man["class_counts"] = [HUGE, 0, 0]
    save(clone, man)

    for name, kind, text, took in outcomes(clone, tmp_path):
        if kind == "FormatError":
            assert "shard-00000.lmdb" in text or "labels.i32" in text, (name, text)
        else:  # verify reports instead of raising
            assert name.startswith("verify") and kind == "returned", (name, kind, text)
            assert "shard-00000.lmdb: size" in text, text
        assert took < 1.0, f"{name} took {took:.2f} s"
    assert not (tmp_path / "staged").exists()

    for args in (["ls", clone], ["verify", "-q", clone], ["cat", clone, "5"]):
        # a loop or an allocation sized by the manifest would run past the timeout or the
        # 1 GiB address space (the bound is loose: a loaded 2-core box starts Python slowly)
        p = run_packer(*args, limit_as=1 << 30, timeout=60)
        assert p.returncode == 1 and "Traceback" not in p.stderr, (args, p.stdout, p.stderr)


def test_shard_outside_any_dataset_is_refused_everywhere(clone, tmp_path):
    """``../`` may lead only into a packer dataset (a merged dataset's part). A manifest whose
    shard lies in a plain folder is refused by every entry point: verify (quick or not) must
    not pass what readers refuse, and merge must not write a dataset that no reader accepts."""
    outside = tmp_path / "outside"
    outside.mkdir()
    os.link(clone / "shard-00000.lmdb", outside / "shard-00000.lmdb")
    (clone / "shard-00000.lmdb").unlink()
    man = load(clone)
    shard(man)["path"] = "../outside/shard-00000.lmdb"
    save(clone, man)
    results = outcomes(clone, tmp_path)
    # verify reports it as a problem (exit 1 from the CLI); every other entry point raises
    wrong = [(name, kind, text) for name, kind, text, _ in results
             if "../outside/shard-00000.lmdb" not in text
             or kind != ("returned" if name.startswith("verify") else "FormatError")]
    assert not wrong, wrong
    assert not (tmp_path / "staged").exists()
    assert not (tmp_path / "merged" / "manifest.json").exists()


# -- side tables that are not files ------------------------------------------------------------

CHILD = r"""
import json, resource, sys
import torch  # imported before the limit: a CUDA build maps far more address space than 1 GiB
from packer import PackedDataset, PackedIterableDataset, stage, verify
from packer.errors import FormatError
vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))  # 1 GiB more, at most
root, target = sys.argv[1], sys.argv[2]
out = {}
for name, call in [("verify", lambda: verify(root, progress=False)),
                   ("PackedDataset", lambda: PackedDataset(root, decode=bytes)[0]),
                   ("PackedIterableDataset",
                    lambda: next(iter(PackedIterableDataset(root, decode=bytes, shuffle=False)))),
                   ("stage", lambda: stage(root, target, progress=False))]:
    try:
        r = call()
        out[name] = "problems: " + " | ".join(r.problems) if name == "verify" else "returned"
    except FormatError as e:
        out[name] = "FormatError: " + str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["symlink-to-dev-zero", "fifo"])
def test_labels_file_that_never_ends_is_not_read(clone, tmp_path, kind):
    """labels.i32 as a link to /dev/zero (or a FIFO nobody writes): its manifest entry is
    fine, the file is not. Reading it until memory runs out (or waiting on it) would be the
    bug: a child process may use at most 1 GiB more address space, and has a timeout."""
    (clone / "labels.i32").unlink()
    if kind == "fifo":
        os.mkfifo(clone / "labels.i32")
    else:
        os.symlink("/dev/zero", clone / "labels.i32")
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, str(clone), str(tmp_path / "staged")],
                           env=ENV, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading a dataset whose labels.i32 is a {kind} did not end in 30 s")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for name in ("PackedDataset", "stage"):
        assert out[name].startswith("FormatError: ") and "labels.i32" in out[name], (name, out)
    # the streaming dataset takes labels from the records: it need not open labels.i32 at all
    assert out["PackedIterableDataset"] == "returned" or "labels.i32" in out["PackedIterableDataset"]
    assert out["verify"].startswith("problems: ") and "labels.i32" in out["verify"], out
    assert not (tmp_path / "staged").exists()


# -- JSON itself -------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "[" * 100000,
    '{"format": "packer", "format_version": "1.1", "options": ' + "[" * 100000 + "]" * 100000 + "}",
    "{" + '"a":{' * 100000 + "}" * 100001,
], ids=["list-opened", "options-nested", "objects-nested"])
def test_deeply_nested_json_is_a_format_error(clone, tmp_path, text):
    (clone / "manifest.json").write_text(text)
    for name, kind, text, _ in outcomes(clone, tmp_path):
        assert kind == "FormatError" and "nested too deeply" in text, (name, kind, text)
    p = run_packer("info", clone)
    assert p.returncode == 1 and "nested too deeply" in p.stderr, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "staged").exists()


@pytest.mark.parametrize("version, match", [
    ("9.0", "newer than this packer understands"),
    ("2.0", "newer than this packer understands"),
    ("one", "unreadable format_version"),
])
def test_unknown_format_version_is_refused(clone, tmp_path, version, match):
    man = load(clone)
    man["format_version"] = version
    save(clone, man)
    for name, kind, text, _ in outcomes(clone, tmp_path):
        assert kind == "FormatError" and match in text, (name, kind, text)
    p = run_packer("ls", clone)
    assert p.returncode == 1 and match in p.stderr and "Traceback" not in p.stderr, p.stderr


# -- stage plans from the real files ------------------------------------------------------------

@pytest.mark.parametrize("lie", [-4096, 4096, -1])
@pytest.mark.parametrize("target_exists", [False, True])
def test_stage_refuses_sizes_that_disagree_with_the_files(clone, tmp_path, lie, target_exists):
    """The manifest is self-consistent (sizes add up, sha256 is the file's), but a shard's
    ``bytes`` is not its real size: refused before anything is copied."""
    man = load(clone)
    shard(man)["bytes"] += lie
    man["bytes"] += lie
    save(clone, man)
    target = tmp_path / "target"
    if target_exists:
        target.mkdir()
    with pytest.raises(FormatError, match="shard-00000.lmdb"):
        stage(clone, target, progress=False)
    if target_exists:
        assert sorted(os.listdir(target)) == []
    else:
        assert not target.exists()
    p = run_packer("stage", clone, target, "-q")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert (sorted(os.listdir(target)) == []) if target_exists else not target.exists()
