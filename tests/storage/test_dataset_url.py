"""PackedDataset("s3://...", cache_dir=...): the same samples as the local dataset, through
DataLoader worker processes that share one node-local cache within its limit."""
from __future__ import annotations

import pytest
import torch

from packer import PackedDataset
from packer.errors import PackerError


def raw(ds):
    return [ds.load(i)["image"] for i in range(len(ds))]


def test_dataset_from_s3_matches_the_local_one(s3, remote, local_dataset, tmp_path):
    local = PackedDataset(local_dataset)
    sizes = [s["bytes"] for s in local.manifest["shards"]]
    ds = PackedDataset(remote, cache_dir=tmp_path / "cache", cache_limit=sum(sizes) - 1,
                       storage_options=s3["options"])
    assert len(ds) == len(local) and ds.targets == local.targets and ds.classes == local.classes
    assert raw(ds) == raw(local)  # in order: each shard evicted once two are open
    assert ds.reader.cache.evictions >= 1 and ds.reader.cache.usage() <= sum(sizes) - 1
    ds.reader.close()
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2,
                                         collate_fn=lambda b: [t for _, t in b])
    assert sum(loader, []) == local.targets
    with pytest.raises(PackerError, match="cache_dir"):
        PackedDataset(remote, storage_options=s3["options"])
