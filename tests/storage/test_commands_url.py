"""`packer info/ls/cat/verify URL`: the read-only commands on a dataset in object storage."""
from __future__ import annotations

import json

from click.testing import CliRunner

from conftest import KEY, SECRET
from packer.cli import main
from packer.info import cat, info, ls, verify
from packer.reading.reader import open_reader


def flags(s3) -> list:
    """The server's options as the CLI takes them."""
    out = []
    for k, v in s3["options"].items():
        out += ["--storage-option", f"{k}={json.dumps(v) if isinstance(v, dict) else v}"]
    return out


def test_library_calls_take_a_url(s3, remote, local_dataset, tmp_path):
    opts = s3["options"]
    got, want = info(remote, opts), info(local_dataset)
    assert got["path"] == remote and got["shards"] == want["shards"] and got["count"] == want["count"]
    assert list(ls(remote, opts)) == list(ls(local_dataset))
    with open_reader(remote, opts) as reader:  # a temporary cache keeps 2 shards at most
        assert len(reader.cache) > 2 and all(reader.read(i) for i in range(len(reader)))
        assert reader.cache.evictions >= len(reader.cache) - 2 and reader.cache.usage() <= reader.cache.limit
    cache = tmp_path / "cache"
    assert cat(remote, 5, opts, cache) == cat(local_dataset, 5)
    (folder,) = [p for p in cache.iterdir()]
    assert len(list(folder.glob("*.lmdb"))) == 1  # only the shard record 5 lies in
    rep = verify(remote, progress=False, storage_options=opts, cache_dir=cache)
    assert rep.ok and rep.checked_shards == len(want["shards"]) and rep.checked_records == want["count"]


def test_cli_commands_on_a_url(s3, remote, local_dataset, tmp_path):
    run = CliRunner().invoke
    r = run(main, ["info", remote, "--json"] + flags(s3))
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["count"] == info(local_dataset)["count"]
    r = run(main, ["ls", remote, "--cache-dir", str(tmp_path / "c")] + flags(s3))
    assert r.exit_code == 0, r.output
    assert r.output == CliRunner().invoke(main, ["ls", str(local_dataset)]).output
    r = run(main, ["cat", remote, "3", "-o", str(tmp_path / "x.jpg")] + flags(s3))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "x.jpg").read_bytes() == cat(local_dataset, 3)
    r = run(main, ["verify", remote, "--quick", "-q"] + flags(s3))
    assert r.exit_code == 0 and r.output.startswith("OK: ") and remote in r.output, r.output
    assert SECRET not in r.output and KEY not in r.output
    r = run(main, ["stage", remote, str(tmp_path / "staged"), "-q"] + flags(s3))
    assert r.exit_code == 0 and (tmp_path / "staged" / "manifest.json").is_file(), r.output
    r = run(main, ["info", remote + "-missing"] + flags(s3))
    assert r.exit_code == 1 and "not a packer dataset" in r.output
    r = run(main, ["info", remote, "--storage-option", "novalue"])
    assert r.exit_code == 2 and "KEY=VALUE" in r.output


def test_verify_url_refuses_a_damaged_shard(s3, fresh_remote, local_dataset):
    key = fresh_remote.split("://")[1] + "/shard-00001.lmdb"
    data = bytearray(s3["fs"].cat_file(key))
    data[len(data) // 2] ^= 0xFF
    s3["fs"].pipe_file(key, bytes(data))
    r = CliRunner().invoke(main, ["verify", fresh_remote, "--quick"] + flags(s3))
    assert r.exit_code == 1 and "shard-00001.lmdb" in r.output and "SHA-256" in r.output, r.output


def test_local_inspection_imports_no_cloud_client(local_dataset, tmp_path):
    """info/ls/cat/verify --quick on a folder never import fsspec (nor torch)."""
    import subprocess
    import sys
    code = (f"import sys\nfrom click.testing import CliRunner\nfrom packer.cli import main\n"
            f"for a in (['info'], ['ls'], ['cat', '-o', {str(tmp_path / 'x')!r}], ['verify', '--quick']):\n"
            f"    r = CliRunner().invoke(main, a[:1] + [{str(local_dataset)!r}] + (['0'] if a[0] == 'cat' else []) + a[1:])\n"
            f"    assert r.exit_code == 0, r.output\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'fsspec', 's3fs', 'torch'}}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr + out.stdout
