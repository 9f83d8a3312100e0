"""Two "nodes" of two ranks each, as real processes stepping together over gloo as in DDP
training, read a dataset in object storage through ``PackedSampler(order="node")`` and a
per-node shard cache smaller than the data: every sample is read once per epoch across the
four ranks, and each node downloads about its share of the shards per epoch (one pass), not
the whole dataset and never a shard per sample (measured: 17-23 downloads of 15 shards over
3 epochs per node, also with the box busy; the random order 199). Without the steps in
lockstep one rank can run ahead of its node's other rank and evict what it still reads."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings

import pytest

from packer import write
from packer.demo import make_image_folder
from packer.storage import upload_dataset

from conftest import BUCKET

CHILD = r"""
import json, os, sys
import torch.distributed as dist
from packer import PackedDataset, PackedSampler
dist.init_process_group("gloo")  # the ranks step together, as in DDP training
url, cache_dir, limit, opts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
ds = PackedDataset(url, cache_dir=cache_dir, cache_limit=limit, storage_options=opts)
sampler = PackedSampler(ds, order="node", num_replicas=4, rank=int(os.environ["RANK"]), seed=3)
epochs = []
for epoch in range(3):
    sampler.set_epoch(epoch)
    seen = list(sampler)
    for step, i in enumerate(seen):
        ds[i]
        if step % 8 == 7:  # a training step of 8 samples
            dist.barrier()
    epochs.append(seen)
ds.reader.cache.close()  # waits for the prefetches under way
dist.destroy_process_group()
print(json.dumps({"epochs": epochs, "downloads": ds.reader.cache.downloads}))
"""


@pytest.fixture(scope="module")
def many_shards(s3, tmp_path_factory):
    """240 photo records in ~17 shards of 1 MiB, uploaded."""
    base = tmp_path_factory.mktemp("nodes")
    photos = sorted(make_image_folder(base / "src", images=40, classes=4, seed=8).rglob("*.jpg"))
    blobs = [p.read_bytes() for p in photos]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write(base / "ds", ({"image": blobs[i % 40], "label": i % 4} for i in range(240)),
              classes=list("abcd"), shard_size=1 << 20, progress=False, total=240)
    url = f"s3://{BUCKET}/many-shards"
    upload_dataset(base / "ds", url, s3["options"])
    return url


def test_each_node_downloads_its_share_once_per_epoch(s3, many_shards, tmp_path):
    from packer import PackedDataset
    import torch
    counts = [s["count"] for s in PackedDataset(many_shards, cache_dir=tmp_path / "probe",
                                                storage_options=s3["options"]).manifest["shards"]]
    shards, ends = len(counts), torch.tensor(counts).cumsum(0)
    assert shards >= 12
    limit = 7 << 20  # well under a node's share of ~8.5 MiB a epoch: nothing stays for the next
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", CHILD, many_shards, str(tmp_path / f"node{rank // 2}"),
             str(limit), json.dumps(s3["options"])], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    for epoch in range(3):  # DDP-exact: the four ranks read every sample once
        assert sorted(i for r in out for i in r["epochs"][epoch]) == list(range(240))
    node0 = [{int(torch.searchsorted(ends, torch.tensor(i), right=True))
              for r in out[:2] for i in r["epochs"][epoch]} for epoch in range(3)]
    assert len(node0[0]) <= shards // 2 + 2 and node0[0] != node0[1]  # a share that moves
    for node in (0, 1):
        downloads = out[2 * node]["downloads"] + out[2 * node + 1]["downloads"]
        # its half of the shards each epoch, plus the shards cut between the nodes' runs
        assert downloads <= 3 * (shards // 2 + 3), (node, downloads, shards)
