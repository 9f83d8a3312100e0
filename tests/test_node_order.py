"""``PackedSampler(order="node")``: each node reads its own share of the shards, the shares
move every epoch, and the split stays DDP-exact and resumable."""
from __future__ import annotations

import warnings

import pytest
import torch

from packer import PackedDataset, PackedSampler, build
from packer.demo import make_image_folder
from packer.reading.nodeorder import node_order


def shard_of(counts):
    ends = torch.tensor(counts).cumsum(0)
    return lambda idx: int(torch.searchsorted(ends, torch.tensor(idx), right=True))


@pytest.mark.parametrize("counts,world,per_node", [
    ([10] * 12, 4, 2), ([7, 13, 9, 11, 10, 3, 12, 8], 6, 3), ([5] * 9, 3, 1), ([40], 2, 1),
    ([3, 3], 4, 4)])
def test_a_permutation_whose_ranks_read_their_nodes_shards(counts, world, per_node):
    n = sum(counts)
    order = node_order(counts, world=world, per_node=per_node, window=2,
                       generator=torch.Generator().manual_seed(1))
    assert sorted(order.tolist()) == list(range(n))
    shard = shard_of(counts)
    nodes = world // per_node
    on_node = [[shard(i) for i in order[r::world].tolist()] for r in range(world)]
    tail = n - (n // nodes // per_node) * world  # the few leftovers at the end, on any rank
    for j in range(nodes):  # a node's ranks share shards with other nodes only at the cuts
        mine = {s for r in range(j * per_node, (j + 1) * per_node)
                for s in on_node[r][:len(on_node[r]) - tail // world - 1]}
        others = {s for r in range(world) if r // per_node != j
                  for s in on_node[r][:len(on_node[r]) - tail // world - 1]}
        assert len(mine & others) <= 2, (j, mine, others)


def test_a_node_reads_a_few_shards_at_a_time():
    counts = [50] * 16
    order = node_order(counts, world=2, per_node=1, window=2,
                       generator=torch.Generator().manual_seed(0))
    shard = shard_of(counts)
    rank0 = [shard(i) for i in order[0::2].tolist()]
    for k in range(0, len(rank0), 50):  # any 50 consecutive reads touch at most 3 shards
        assert len(set(rank0[k:k + 50])) <= 3


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    base = tmp_path_factory.mktemp("node")
    src = make_image_folder(base / "src", images=90, classes=3, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(src, base / "ds", workers=0, progress=False, shard_size=1 << 20)
    ds = PackedDataset(base / "ds")
    assert len(ds.manifest["shards"]) >= 5
    return ds


def test_ddp_exact_and_the_shares_move_across_epochs(packed):
    ranks = [PackedSampler(packed, order="node", num_replicas=3, rank=r, seed=7,
                           ranks_per_node=1) for r in range(3)]
    shard = shard_of([s["count"] for s in packed.manifest["shards"]])
    shares = []
    for epoch in range(3):
        for s in ranks:
            s.set_epoch(epoch)
        seen = [list(s) for s in ranks]
        assert sorted(sum(seen, [])) == list(range(len(packed)))  # once each per epoch
        shares.append([{shard(i) for i in idx[:20]} for idx in seen])
    assert shares[0] != shares[1] != shares[2]  # the partition moves


def test_resume_at_another_world_size_keeps_exactly_once(packed):
    a = [PackedSampler(packed, order="node", num_replicas=2, rank=r, seed=3, ranks_per_node=1)
         for r in range(2)]
    its = [iter(s) for s in a]
    seen = [next(its[r]) for _ in range(10) for r in range(2)]  # 20 global samples
    state = a[0].state_dict(consumed=20)
    assert state["layout"] == [2, 1]
    b = [PackedSampler(packed, order="node", num_replicas=3, rank=r, ranks_per_node=1)
         for r in range(3)]
    for s in b:
        s.load_state_dict(state)
    rest = sum((list(s) for s in b), [])
    assert sorted(set(seen + rest)) == list(range(len(packed)))
    assert len(seen + rest) - len(packed) == (-(len(packed) - 20)) % 3  # padding, as DDP pads
    for s in b:  # the next epoch is laid out for the new world
        s.set_epoch(state["epoch"] + 1)
        assert s.epoch_layout() == (3, 1)


def test_defaults_and_refusals(packed, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert PackedSampler(packed, order="node", num_replicas=4, rank=0).layout == (4, 2)
    assert PackedSampler(packed, order="node", num_replicas=3, rank=0).layout == (3, 1)
    assert PackedSampler(packed, order="node", num_replicas=1, rank=0).window == 2
    with pytest.raises(ValueError, match="must divide the world size"):
        PackedSampler(packed, order="node", num_replicas=4, rank=0, ranks_per_node=3)
    with pytest.raises(ValueError, match="needs a PackedDataset"):
        PackedSampler(list(range(10)), order="node")
    unshuffled = PackedSampler(packed, order="node", shuffle=False, num_replicas=1, rank=0)
    assert list(unshuffled) == list(range(len(packed)))
