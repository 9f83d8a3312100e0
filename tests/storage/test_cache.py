"""ShardCache: shards of a dataset in S3 on a node's disk, once per node, within a limit."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import s3_options
from packer.errors import PackerError
from packer.format.tables import read_labels
from packer.reading.reader import ShardReader
from packer.storage import ShardCache

ROOT = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from packer.storage import ShardCache
    url, cache_dir, opts, go = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
    cache = ShardCache(url, cache_dir, None, opts)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.005)
    path = cache.shard_path(1)
    print(json.dumps({"downloads": cache.downloads, "bytes": path.stat().st_size}), flush=True)
""")


def child(remote, cache_dir, opts, go):
    return subprocess.Popen([sys.executable, "-c", CHILD, remote, str(cache_dir), json.dumps(opts),
                             str(go)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_reads_through_the_cache_match_the_dataset(s3, remote, local_dataset, tmp_path):
    cache = ShardCache(remote, tmp_path / "cache", None, s3["options"])
    paths = [cache.shard_path(k) for k in range(len(cache))]
    assert all(p.parent == cache.root for p in paths) and cache.downloads == len(paths)
    reader, local = ShardReader(cache.root, cache.manifest), ShardReader(local_dataset)
    assert [reader.read(i) for i in range(len(reader))] == [local.read(i) for i in range(len(local))]
    assert read_labels(cache.root, cache.manifest) == read_labels(local_dataset, local.manifest)
    again = ShardCache(remote, tmp_path / "cache", None, s3["options"])
    assert again.shard_path(0) == paths[0] and again.downloads == 0 and again.hits > 0


def test_two_processes_download_a_shard_once(s3, remote, proxy, tmp_path):
    """Both ask at the same moment (through a slow link); one downloads, the other waits."""
    go = tmp_path / "go"
    opts = s3_options(proxy.url)
    procs = [child(remote, tmp_path / "cache", opts, go) for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    proxy.delay = 0.1
    go.touch()
    results = [json.loads(p.communicate(timeout=120)[0].strip()) for p in procs]
    assert sorted(r["downloads"] for r in results) == [0, 1]
    assert results[0]["bytes"] == results[1]["bytes"] > 0


def test_evicts_least_recently_used_unpinned_shards(s3, remote, tmp_path):
    probe = ShardCache(remote, tmp_path / "probe", None, s3["options"])
    sizes = [s["bytes"] for s in probe.manifest["shards"]]
    assert len(sizes) >= 3
    limit = sizes[0] + sizes[1] + sizes[2] - 1  # all three never fit
    cache = ShardCache(remote, tmp_path / "cache", limit, s3["options"])
    pinned = cache.shard_path(0)  # pinned: stays whatever happens
    cache.shard_path(1)
    cache.release(1)
    cache.shard_path(2)  # 1 (least recently used, unpinned) goes
    assert pinned.exists() and not (cache.root / cache.manifest["shards"][1]["path"]).exists()
    assert cache.evictions == 1 and cache.usage() <= limit
    cache.release(0)
    cache.release(2)
    cache.shard_path(1)  # now 0 is the oldest unpinned: it goes
    assert not pinned.exists() and cache.evictions == 2 and cache.usage() <= limit
    with pytest.raises(PackerError, match="smaller than one shard"):
        ShardCache(remote, tmp_path / "tiny", max(sizes) - 1, s3["options"])


def test_crash_leftovers_are_cleaned(s3, remote, proxy, tmp_path):
    """A process killed mid-download leaves a .part file; the next one removes it."""
    go = tmp_path / "go"
    p = child(remote, tmp_path / "cache", s3_options(proxy.url, packer_parallel=1), go)
    assert p.stdout.readline().strip() == "ready"
    proxy.delay = 0.5
    go.touch()
    root = next((tmp_path / "cache").iterdir())
    deadline = time.monotonic() + 60
    while not list(root.glob(".*.part")) and time.monotonic() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert list(root.glob(".*.part"))
    cache = ShardCache(remote, tmp_path / "cache", None, s3["options"])
    assert not list(root.glob(".*.part"))
    assert cache.shard_path(1).stat().st_size == cache.manifest["shards"][1]["bytes"]


def test_prefetch_in_the_background(s3, remote, tmp_path):
    cache = ShardCache(remote, tmp_path / "cache", None, s3["options"])
    futures = cache.prefetch(range(len(cache)))
    assert [f.result(timeout=60) for f in futures] == [cache.root / s["path"] for s in cache.manifest["shards"]]
    assert cache.downloads == len(cache)
    cache.shard_path(0)
    assert cache.hits >= 1 and cache.downloads == len(cache)
    cache.close()


def test_the_node_order_prefetches_the_shards_its_rank_reads(s3, remote, tmp_path):
    import torch
    from packer import PackedDataset, PackedSampler

    ds = PackedDataset(remote, cache_dir=tmp_path / "cache", storage_options=s3["options"])
    cache = ds.reader.cache
    sampler = PackedSampler(ds, order="node", num_replicas=2, rank=0, ranks_per_node=1, seed=1)
    ends = torch.tensor([s["count"] for s in ds.manifest["shards"]]).cumsum(0)
    wanted = {int(torch.searchsorted(ends, torch.tensor(i), right=True)) for i in sampler}
    cache.close()  # waits for the prefetches the sampler started
    assert 0 < len(wanted) < len(cache)  # this rank's node reads its share of the shards
    fetched = {k for k, s in enumerate(cache.manifest["shards"])
               if (cache.root / s["path"]).exists()}
    assert fetched == wanted and cache.downloads == len(wanted)


@pytest.mark.parametrize("limit", [None, 10 << 20])
def test_without_a_limit_a_reader_keeps_its_shards_open(s3, remote, tmp_path, limit):
    cache = ShardCache(remote, tmp_path / "cache", limit, s3["options"])
    reader = ShardReader(remote, cache=cache)
    firsts = reader.starts[:-1]
    assert len(firsts) >= 3
    for _ in range(2):  # shard 0, 1, 2, 0, 1, 2: with two open at most, each comes back
        for i in firsts[:3]:
            reader.read(i)
    assert cache.downloads == 3
    assert cache.hits == (0 if limit is None else 3)  # a reopen is a pin (and a lock) again
    reader.close()


def test_a_worker_forked_during_a_fetch_does_not_hold_its_lock(s3, remote, tmp_path):
    """The sampler prefetches in the training process while DataLoader workers are forked:
    a worker forked mid-download must not keep that download's lock (flock belongs to the
    open file the child shares), else fetching the shard again waits for ever, in the
    worker and in the training process."""
    import multiprocessing as mp
    import threading
    cache = ShardCache(remote, tmp_path / "cache", None, s3["options"])
    started, forked, done = threading.Event(), threading.Event(), tmp_path / "parent-done"
    real = cache.store.download

    def download(*args, **kwargs):  # the parent's fetch is under way when the worker forks
        started.set()
        assert forked.wait(60)
        return real(*args, **kwargs)
    cache.store.download = download
    future = cache.prefetch([0])[0]
    assert started.wait(60)
    worker = mp.get_context("fork").Process(target=fetch_again_in_a_worker, args=(cache, done, real))
    worker.start()
    forked.set()
    path = future.result(timeout=60)
    done.touch()
    worker.join(60)
    assert worker.exitcode == 0, f"the worker's fetch hung or failed (exit {worker.exitcode})"
    assert cache.shard_path(0) == path and path.stat().st_size == cache.manifest["shards"][0]["bytes"]
    cache.close()


def fetch_again_in_a_worker(cache, done, download):
    signal.alarm(30)  # a hang ends the worker (SIGALRM) instead of the test run
    cache.store.download = download
    while not done.exists():
        time.sleep(0.01)
    cache.shard_path(0, pin=False).unlink()  # evicted: fetched again, under the same lock
    assert cache.shard_path(0, pin=False).is_file()


LOCAL_ROOT_LOOP = textwrap.dedent("""
    import json, sys, time
    from packer.format.manifest import read_manifest
    from packer.storage.local import local_root
    url, cache_dir, opts, go = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    while not __import__("os").path.exists(go):
        time.sleep(0.005)
    end = time.monotonic() + 4
    while time.monotonic() < end:
        with local_root(url, opts, cache_dir) as root:
            assert read_manifest(root)["shards"]
""")


def test_commands_sharing_a_cache_dir_write_its_manifest_in_turn(s3, remote, tmp_path):
    """`packer info/verify URL --cache-dir D` run at once on a node: each makes D's copy a
    dataset folder (its manifest.json), none breaks the other's write or reads half of one."""
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", LOCAL_ROOT_LOOP, remote, str(tmp_path / "cache"),
                               json.dumps(s3["options"]), str(go)], stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT))) for _ in range(3)]
    go.touch()
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(e[-1500:] for e in errors)


def test_a_shard_that_fails_to_open_leaves_the_reader_usable(s3, remote, local_dataset, tmp_path):
    """A cached shard damaged between its fetch and its open is one FormatError; the reader's
    open-shard bookkeeping stays right (it once held the failed shard as open, and closing it
    later raised a TypeError) and the shard's pin goes."""
    from packer.errors import FormatError

    class DamagedOnce(ShardCache):  # another process truncates shard 1 right after its fetch
        damaged = False

        def shard_path(self, k, *, pin=True):
            path = super().shard_path(k, pin=pin)
            if k == 1 and not self.damaged:
                self.damaged = True
                os.truncate(path, 100)
            return path
    cache = DamagedOnce(remote, tmp_path / "cache", 10 << 20, s3["options"])
    reader, local = ShardReader(remote, cache=cache), ShardReader(local_dataset)
    first = reader.starts[:3]
    assert reader.read(first[0]) == local.read(first[0])
    with pytest.raises(FormatError, match="replaced"):
        reader.read(first[1])
    assert 1 not in cache._pins
    for i in (first[1], first[2], first[0], first[1]):  # opened, evicted and closed in turn
        assert reader.read(i) == local.read(i)
