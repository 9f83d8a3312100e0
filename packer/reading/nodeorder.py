"""The node-partitioned order (``PackedSampler(order="node")``): for reading through a shard
cache smaller than the data, each node reads the samples of its own share of the shards, a
few shards at a time, and the shares move every epoch (docs/sampling.md)."""
from __future__ import annotations

from typing import List, Sequence

import torch


def node_order(counts: Sequence[int], *, world: int, per_node: int, window: int,
               generator: torch.Generator) -> torch.Tensor:
    """A permutation of ``range(sum(counts))`` laid out for the rank-strided split (rank ``r``
    of ``world`` takes positions ``r, r + world, ...``; ranks ``j * per_node ..`` are node
    ``j``): the shards in a random order are cut into one run per node of equal sample
    counts; within a run, samples are shuffled among ``window`` shards at a time, so a node
    holds about ``window`` shards in use. All but fewer than ``world + nodes`` samples land
    on their node's ranks; those few, at the end, on any rank."""
    nodes = world // per_node
    starts = torch.tensor([0] + list(counts), dtype=torch.int64).cumsum(0)
    perm = torch.randperm(len(counts), generator=generator).tolist()
    seq = torch.cat([torch.arange(int(starts[k]), int(starts[k + 1])) for k in perm]
                    or [torch.zeros(0, dtype=torch.int64)])
    n = len(seq)
    chunk = max(1, window * n // max(1, len(counts)))  # about `window` shards' samples
    bounds = [j * n // nodes for j in range(nodes + 1)]
    runs: List[torch.Tensor] = []
    for j in range(nodes):
        run = seq[bounds[j]:bounds[j + 1]]
        runs.append(torch.cat([c[torch.randperm(len(c), generator=generator)]
                               for c in run.split(chunk)] or [run]))
    q = min(len(r) for r in runs) // per_node  # samples every rank gets from its node's run
    main = torch.stack([r[:q * per_node].view(q, per_node) for r in runs], dim=1)
    return torch.cat([main.reshape(-1)] + [r[q * per_node:] for r in runs])
