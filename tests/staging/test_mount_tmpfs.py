"""scripts/mount_tmpfs.sh: sizes, refusals, --dry-run/--fstab output (shellcheck: tests/test_scripts.py)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mount_tmpfs.sh"
MIB = 1 << 20
ODD = "dir with spaces/ünïcødé ✓"  # a mount point name that must survive quoting


def run(*args, env=None, user=None):
    cmd = ["bash", str(SCRIPT), *map(str, args)]
    if user is not None:  # pass the text: that user may not be able to read the checkout
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups",
               "bash", "-c", SCRIPT.read_text(), SCRIPT.name, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def mount_lines(out):
    """The `mount ...` commands a --dry-run printed, as argument lists."""
    return [shlex.split(line) for line in out.splitlines() if line.startswith("mount ")]


def option(args, name):
    opts = args[args.index("-o") + 1].split(",")
    return next(o.split("=", 1)[1] for o in opts if o.startswith(name + "="))


def fake_dataset(root, shard_bytes, labels_bytes=400):
    """A manifest is all --for reads; sizes can be large without writing the data."""
    root.mkdir(parents=True)
    man = {"format": "packer", "format_version": "1.0", "count": 100,
           "shards": [{"path": f"shard-{i:05d}.lmdb", "count": 1, "bytes": b, "sha256": "0" * 64}
                      for i, b in enumerate(shard_bytes)],
           "labels": {"path": "labels.i32", "bytes": labels_bytes, "sha256": "0" * 64}}
    (root / "manifest.json").write_text(json.dumps(man))
    return root


def test_help_explains_swap():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage:")
    text = r.stdout.lower()
    assert "swap" in text and "vmstat" in text and "swapon" in text
    assert "/dev/shm" in r.stdout and "root" in text


def test_dry_run_prints_the_mount_command(tmp_path):
    mnt = tmp_path / ODD
    r = run("--dry-run", "--size", "64M", mnt)
    assert r.returncode == 0, r.stderr
    (cmd,) = mount_lines(r.stdout)
    assert cmd[:3] == ["mount", "-t", "tmpfs"] and cmd[-2:] == ["tmpfs", str(mnt)]
    assert option(cmd, "size") == "64m"
    assert not mnt.exists()  # printed, not run
    assert any(shlex.split(line) == ["mkdir", "-p", "--", str(mnt)] for line in r.stdout.splitlines())


@pytest.mark.parametrize("text,mib", [("512K", 1), ("64m", 64), ("2G", 2048), ("3GiB", 3072),
                                      (str(5 * MIB + 1), 6)])
def test_sizes(tmp_path, text, mib):
    r = run("--dry-run", "--size", text, tmp_path / "m")
    if r.returncode == 1 and "refusing" in r.stderr:
        pytest.skip("not enough free RAM here for this size")
    assert r.returncode == 0, r.stderr
    assert option(mount_lines(r.stdout)[0], "size") == f"{mib}m"


def test_for_sizes_from_the_manifest(tmp_path):
    dst = fake_dataset(tmp_path / "ds", [100 * MIB, 100 * MIB, 37 * MIB + 5])
    data = 237 * MIB + 5 + 400 + (dst / "manifest.json").stat().st_size
    want = data + data // 20 + 32 * MIB
    r = run("--for", dst, "--dry-run", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert option(mount_lines(r.stdout)[0], "size") == f"{-(-want // MIB)}m"


def test_for_a_real_dataset(tmp_path):
    from packer import build
    from packer.demo import make_image_folder
    src = make_image_folder(tmp_path / "src", images=8, classes=2)
    dst = tmp_path / ODD / "packed"
    man = build(src, dst, workers=0, progress=False, shard_size=1 << 20).manifest
    data = man["bytes"] + man["labels"]["bytes"] + (dst / "manifest.json").stat().st_size
    r = run("--for", dst, "--dry-run", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert option(mount_lines(r.stdout)[0], "size") == f"{-(-(data + data // 20 + 32 * MIB) // MIB)}m"


def test_for_refuses_what_is_not_a_dataset(tmp_path):
    r = run("--for", tmp_path / "nope", "--dry-run", tmp_path / "m")
    assert r.returncode == 1 and "not a folder" in r.stderr
    (tmp_path / "empty").mkdir()
    r = run("--for", tmp_path / "empty", "--dry-run", tmp_path / "m")
    assert r.returncode == 1 and "no manifest.json" in r.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    r = run("--for", tmp_path / "bad", "--dry-run", tmp_path / "m")
    assert r.returncode == 1 and "manifest.json" in r.stderr and "Traceback" not in r.stderr


def test_fstab_line(tmp_path):
    mnt = tmp_path / ODD
    r = run("--fstab", "--size", "1G", mnt)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if not line.startswith("#")]
    assert len(lines) == 1
    fields = lines[0].split()
    assert len(fields) == 6 and fields[0] == "tmpfs" and fields[2] == "tmpfs"
    assert fields[1] == str(mnt).replace(" ", "\\040")  # fstab's escape for a space
    assert "size=1024m" in fields[3].split(",") and fields[4:] == ["0", "0"]
    assert not mnt.exists()


def test_size_beyond_free_ram_is_refused(tmp_path):
    for args in (["--size", "900T", "--dry-run"], ["--size", "900T"], ["--size", "900T", "--fstab"]):
        r = run(*args, tmp_path / "m")
        assert r.returncode == 1, r
        assert "refusing" in r.stderr and "free RAM" in r.stderr
        assert "mount" not in r.stdout
    dst = fake_dataset(tmp_path / "huge", [1 << 50])
    r = run("--for", dst, "--dry-run", tmp_path / "m")
    assert r.returncode == 1 and "refusing" in r.stderr


@pytest.mark.parametrize("args", [
    [],                                       # no MOUNTPOINT
    ["/mnt/x"],                               # no size
    ["--size", "lots", "/mnt/x"],
    ["--size", "0", "/mnt/x"],
    ["--size", "1G", "--for", "/tmp", "/mnt/x"],
    ["--size", "1G", "/mnt/x", "/mnt/y"],
    ["--bogus", "/mnt/x"],
    ["--size"],
    ["--umount", "--size", "1G", "/mnt/x"],
])
def test_bad_arguments_are_usage_errors(args):
    r = run(*args)
    assert r.returncode == 2, r
    assert "Usage:" in r.stderr and "error:" in r.stderr and r.stdout == ""


def test_umount_of_something_not_mounted_is_a_noop(tmp_path):
    r = run("--umount", tmp_path)
    assert r.returncode == 0 and "nothing to do" in r.stdout


def test_refuses_to_umount_a_disk():
    r = run("--umount", "--dry-run", "/")
    assert r.returncode == 1 and "not a tmpfs" in r.stderr


def test_says_plainly_when_it_needs_root():
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: cannot run the script as another user")
        user = 65534  # nobody
    else:
        user = None
    mnt = "/nonexistent-packer-test/m"  # never created: the refusal comes first
    r = run("--size", "16M", mnt, user=user)
    assert r.returncode == 1, r
    assert "needs root" in r.stderr and "sudo" in r.stderr and "/dev/shm" in r.stderr
    r = run("--size", "16M", "--dry-run", mnt, user=user)  # a dry run does not
    assert r.returncode == 0 and mount_lines(r.stdout), r


def _can_mount(tmp_path):
    if os.geteuid() != 0:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                        capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(probe)], check=True)
    return ok


def test_real_mount_is_idempotent_and_undone(tmp_path):
    if not _can_mount(tmp_path):
        pytest.skip("needs root and permission to mount a tmpfs")
    mnt = tmp_path / ODD
    try:
        r = run("--size", "2M", mnt)
        assert r.returncode == 0, r.stderr
        assert subprocess.run(["mountpoint", "-q", str(mnt)]).returncode == 0
        assert shutil.disk_usage(mnt).total == 2 * MIB
        r = run("--size", "2M", mnt)
        assert r.returncode == 0 and "nothing to do" in r.stdout
        r = run("--size", "1M", mnt)  # smaller: still room, nothing to do
        assert r.returncode == 0 and "nothing to do" in r.stdout
        (mnt / "kept").write_text("x")
        r = run("--size", "3M", mnt)  # bigger: grown in place, files kept
        assert r.returncode == 0, r.stderr
        assert shutil.disk_usage(mnt).total == 3 * MIB and (mnt / "kept").read_text() == "x"
        r = run("--umount", mnt)
        assert r.returncode == 0, r.stderr
        assert subprocess.run(["mountpoint", "-q", str(mnt)]).returncode != 0
        r = run("--umount", mnt)
        assert r.returncode == 0 and "nothing to do" in r.stdout
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_refuses_a_non_empty_mount_point(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "file").write_text("x")
    r = run("--size", "16M", "--dry-run", tmp_path / "m")
    assert r.returncode == 1 and "not empty" in r.stderr
