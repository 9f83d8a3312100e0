"""``PackedSampler``: a seeded global order, split exactly across DDP ranks, resumable in O(1):
rank ``r`` of ``W`` takes positions ``consumed + r, consumed + r + W, ...``; ``order="node"``
gives each node its own shards, for a shard cache smaller than the data (docs/sampling.md)."""
from __future__ import annotations

import copy
import hashlib
import os
from typing import Any, Dict, Iterator, List, Optional, Sized, Tuple

import torch
from torch.utils.data import Sampler

from .nodeorder import node_order

ORDERS = ("random", "block", "node")
_CHUNK = 8192  # indices converted to Python ints at a time: never a whole-epoch list


def seed_for(seed: int, epoch: int, *salt: int) -> int:
    """A 63-bit generator seed from (seed, epoch, ...), the same on every machine and Python
    (unlike ``hash()``; unlike ``seed + epoch``, no two pairs collide)."""
    text = ":".join(str(int(v)) for v in (seed, epoch) + salt).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def global_order(n: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                 order: str = "random", block_size: int = 256, window: int = 16) -> torch.Tensor:
    """The epoch's global order, an int64 permutation of ``range(n)``: a pure function of its
    arguments (``torch.randperm`` on a seeded CPU generator)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if block_size < 1 or window < 1:
        raise ValueError(f"block_size and window must be >= 1, got {block_size} and {window}")
    if not shuffle or n == 0:
        return torch.arange(n, dtype=torch.int64)
    if order == "node":
        raise ValueError("order='node' needs the dataset's shards: use PackedSampler")
    g = torch.Generator().manual_seed(seed_for(seed, epoch))
    if order == "random":
        return torch.randperm(n, generator=g)
    # Permuted blocks' records (the last may be short); memory is sized by n, not block_size.
    block_size = min(block_size, n)
    nblocks = -(-n // block_size)
    blocks = torch.randperm(nblocks, generator=g)
    grid = blocks[:, None] * block_size + torch.arange(block_size)
    slot = torch.arange(nblocks)[:, None].expand(nblocks, block_size)
    seq, slot = grid[grid < n], slot[grid < n]
    if window == 1:
        return seq
    # Blocks shuffled within each window; each block's records go out in ascending order.
    shuffled = slot[torch.argsort((slot // window) * n + torch.randperm(n, generator=g))]
    out = torch.empty_like(seq)
    out[torch.sort(shuffled, stable=True).indices] = seq
    return out


def aspect_group_ids(ratios: torch.Tensor, factor: int) -> torch.Tensor:
    """Group of each width/height ratio: torchvision's ``create_aspect_ratio_groups`` bins."""
    edges = (torch.pow(2.0, torch.linspace(-1, 1, 2 * factor + 1, dtype=torch.float64))
             if factor else torch.tensor([1.0], dtype=torch.float64))
    return torch.bucketize(ratios.to(torch.float64), edges, right=True)


def grouped_order(order: torch.Tensor, groups: torch.Tensor, chunk: int, *, seed: int = 0,
                  epoch: int = 0, shuffle: bool = True) -> torch.Tensor:
    """``order`` rearranged so every ``chunk`` positions (one global batch) hold one aspect group,
    but for a few mixed runs of the groups' remainders; runs shuffled with (seed, epoch)."""
    n = len(order)
    if n == 0:
        return order
    sorted_g, idx = torch.sort(groups[order], stable=True)
    seq = order[idx]
    # Elements past their group's last full chunk are leftovers, run together in group order.
    starts = torch.searchsorted(sorted_g, sorted_g, right=False)
    ends = torch.searchsorted(sorted_g, sorted_g, right=True)
    full = torch.arange(n) - starts < (ends - starts) // chunk * chunk
    runs = list(seq[full].split(chunk)) + list(seq[~full].split(chunk))
    if shuffle and len(runs) > 1:
        gen = torch.Generator().manual_seed(seed_for(seed, epoch, 1))
        runs = [runs[i] for i in torch.randperm(len(runs), generator=gen).tolist()]
        short = [i for i, r in enumerate(runs) if len(r) != chunk]
        if short:  # keep the one short run last (it may be padded or dropped)
            runs.append(runs.pop(short[0]))
    return torch.cat(runs)


def resolve_world(num_replicas: Optional[int], rank: Optional[int]):
    """(world size, rank): the given values, else torch.distributed's, else (1, 0); checked.
    Several ranks with no rank known (``WORLD_SIZE`` before ``init_process_group``, or
    ``num_replicas`` alone) are refused, as by ``DistributedSampler``."""
    dist = torch.distributed
    ready = dist.is_available() and dist.is_initialized()
    env = os.environ.get("WORLD_SIZE", "")
    world = num_replicas if num_replicas is not None else int(env) if env.isdigit() else 1
    if not ready and (num_replicas is None or rank is None) and world > 1:
        named = "num_replicas" if num_replicas is not None else "torchrun's WORLD_SIZE"
        raise ValueError(f"{world} ranks ({named}) but torch.distributed is not initialised, "
                         f"so the split across ranks is unknown: call torch.distributed."
                         f"init_process_group() before making the sampler, or pass both "
                         f"num_replicas= and rank= (else every rank reads the same samples)")
    if num_replicas is None:
        num_replicas = dist.get_world_size() if ready else 1
    if rank is None:
        rank = dist.get_rank() if ready else 0
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, "
                         f"got {rank}")
    return num_replicas, rank


def node_size(world: int, ranks_per_node: Optional[int]) -> int:
    """Ranks per node: as given, else ``LOCAL_WORLD_SIZE`` where it divides ``world``, else 1."""
    if ranks_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        ranks_per_node = int(local) if local.isdigit() and int(local) > 0 else 1
        ranks_per_node = ranks_per_node if world % ranks_per_node == 0 else 1
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node must divide the world size {world}, got {ranks_per_node}")
    return int(ranks_per_node)


def rank_count(n: int, start: int, num_replicas: int, drop_last: bool) -> int:
    """Samples each rank gets for the global positions ``start..`` of an ``n``-sample epoch."""
    left = max(0, n - start)
    return left // num_replicas if drop_last else -(-left // num_replicas)


class PackedSampler(Sampler[int]):
    """Seeded, DDP-exact, O(1)-resumable sampler for ``PackedDataset`` (any ``Sized``; a
    ``Mixture`` orders its epochs itself); docs/sampling.md.

    Args:
        seed: with the epoch, fixes the order on every machine. Use the same on all ranks.
        num_replicas / rank: default to torch.distributed's (1 and 0 when not initialised).
        drop_last: every rank gets ``n // W`` samples; otherwise pad to ``ceil(n / W)``.
        order / block_size / window: ``"random"``; ``"block"`` for slow disks (``window``
            blocks at a time, default 16); ``"node"`` for a shard cache smaller than the data:
            each node reads its own share of the shards, ``window`` (default 2) at a time,
            prefetching the next into the dataset's cache; the shares move every epoch.
        ranks_per_node: with ``order="node"``: default ``LOCAL_WORLD_SIZE`` (torchrun's)
            when it divides the world size, else 1 (each rank its own share).
        aspect_groups / batch_size: every batch of ``batch_size`` holds one aspect group
            (torchvision's ``GroupedBatchSampler``), from the width/height columns.

    ``make_loader`` moves to the next epoch after each pass (else call ``set_epoch``);
    ``state_dict()`` resumes at the first unseen sample, at any world size."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 drop_last: bool = False, order: str = "random", *,
                 block_size: int = 256, window: Optional[int] = None,
                 aspect_groups: Optional[int] = None, batch_size: Optional[int] = None,
                 ranks_per_node: Optional[int] = None):
        self.mixture = dataset if hasattr(dataset, "epoch_order") else None
        self.size = dataset.epoch_size if self.mixture is not None else len(dataset)
        if self.mixture is not None and order != "random":
            raise ValueError(f"order={order!r} does not apply to a Mixture, which orders its "
                             f"epochs itself: leave order='random'")
        self.groups = None
        if aspect_groups is not None:
            if not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError("aspect_groups needs batch_size= (samples per batch per rank): "
                                 "batches are what is grouped")
            if not hasattr(dataset, "aspect_ratios"):
                raise ValueError("aspect_groups needs a dataset with aspect_ratios() "
                                 "(PackedDataset reads them from its width/height columns)")
            self.groups = aspect_group_ids(dataset.aspect_ratios(), int(aspect_groups))
        self.aspect_groups, self.batch_size = aspect_groups, batch_size
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        window = (2 if order == "node" else 16) if window is None else window
        self.order, self.block_size, self.window = order, int(block_size), int(window)
        global_order(0, order=order, block_size=self.block_size, window=self.window)  # validate
        self.counts, self.cache, self.layout = None, None, None
        if order == "node":
            shards = getattr(dataset, "manifest", {}).get("shards")
            if shards is None:
                raise ValueError("order='node' needs a PackedDataset (its shards are what "
                                 "nodes divide)")
            self.counts = [int(s["count"]) for s in shards]
            self.cache = getattr(getattr(dataset, "reader", None), "cache", None)
            self.layout = (self.num_replicas, node_size(self.num_replicas, ranks_per_node))
        self._resumed_layout = None  # (epoch, layout) of a state saved at another world size
        self.epoch = 0
        self._start = 0     # global position the next __iter__ starts at (set by a resume)
        self._consumed = 0  # global position reached by the live iterator (for state_dict)
        self._begun = False  # iterated, told a count or resumed: from then on a state wins
        self._cache = None  # (epoch, seed, order tensor)

    def set_epoch(self, epoch: int) -> None:
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch, self._start, self._consumed = epoch, 0, 0

    def permutation(self) -> torch.Tensor:
        """This epoch's global order (cached; int64)."""
        if self._cache is None or self._cache[:2] != (self.epoch, self.seed):
            if self.mixture is not None:
                perm = self.mixture.epoch_order(self.seed, self.epoch, self.shuffle)
            elif self.order == "node" and self.shuffle:
                world, per_node = self.epoch_layout()
                perm = node_order(self.counts, world=world, per_node=per_node,
                                  window=self.window, generator=torch.Generator().manual_seed(
                                      seed_for(self.seed, self.epoch)))
            else:
                perm = global_order(self.size, seed=self.seed, epoch=self.epoch,
                                    shuffle=self.shuffle, order=self.order,
                                    block_size=self.block_size, window=self.window)
            if self.groups is not None:
                perm = grouped_order(perm, self.groups, self.batch_size * self.num_replicas,
                                     seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
            self._cache = (self.epoch, self.seed, perm)
        return self._cache[2]

    def epoch_layout(self):
        """(world size, ranks per node) that shape this epoch's node order: a resumed epoch
        keeps the layout it started with, so every sample is still seen once."""
        if self._resumed_layout is not None and self._resumed_layout[0] == self.epoch:
            return self._resumed_layout[1]
        return self.layout

    def __len__(self) -> int:
        return rank_count(self.size, self._start, self.num_replicas, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        # Fixed now, eagerly: later load_state_dict/set_epoch calls do not reach the iterator.
        perm = self.permutation() if self.size else None
        self._consumed = self._start
        return self._iterate(perm, self._start, self.num_replicas, len(self))

    def _iterate(self, perm, start: int, w: int, count: int) -> Iterator[int]:
        first, self._begun = start + self.rank, True  # at the first next(), not at iter()
        ahead = self._prefetch_plan(perm, first, w, count)
        for lo in range(0, count, _CHUNK):
            hi = min(count, lo + _CHUNK)
            pos = torch.arange(first + lo * w, first + hi * w, w) % self.size
            for i, index in enumerate(perm[pos].tolist(), lo + 1):
                while ahead and ahead[-1][0] <= i:
                    self.cache.prefetch([ahead.pop()[1]])
                self._consumed = start + i * w
                yield index
        self._start = 0  # a finished pass: the next one starts the (next) epoch from the top

    def _prefetch_plan(self, perm, first: int, w: int, count: int) -> List[Tuple[int, int]]:
        """``order="node"`` with a shard cache: (position, shard) pairs, last first: fetch the
        shard that many samples into this pass, about one window before this rank reads it."""
        if self.cache is None or not count:  # count is 0 for an empty dataset
            return []
        ends = torch.tensor(self.counts, dtype=torch.int64).cumsum(0)
        pos = torch.arange(first, first + count * w, w) % self.size
        shard = torch.searchsorted(ends, perm[pos], right=True)
        at = torch.full((len(self.counts),), count, dtype=torch.int64)
        at.scatter_reduce_(0, shard, torch.arange(count), reduce="amin")
        lead = max(1, self.window * count // len(self.counts))  # one window of this rank's
        plan = sorted((max(0, int(p) - lead), k) for k, p in enumerate(at.tolist()) if p < count)
        return plan[::-1]

    @property
    def start(self) -> int:
        """The global position the next pass starts at (0, or where a resume left off)."""
        return self._start

    def epoch_copy(self, epoch: Optional[int] = None) -> "PackedSampler":
        """A copy here, or at the start of ``epoch``, for a loader that runs ahead to iterate."""
        out = copy.copy(self)  # shares the cached order
        if epoch is not None:
            out.set_epoch(epoch)
        return out

    def received(self, consumed: int) -> None:
        """The training loop has received ``consumed`` (global) samples of this epoch: a loader
        iterating a copy reports here, so ``state_dict`` stays exact."""
        self._consumed, self._begun = int(consumed), True

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, int]:
        """``{"seed", "epoch", "consumed", "size", "arrangement"}``; pass ``consumed`` (global
        samples received this epoch) with a plain multi-worker ``DataLoader``."""
        if consumed is None:
            consumed = self._consumed
        elif consumed < 0:
            raise ValueError(f"consumed must be >= 0 (global samples seen this epoch), got {consumed}")
        state = {"seed": self.seed, "epoch": self.epoch, "consumed": int(consumed), "size": self.size}
        if self.mixture is not None:  # what, with seed and epoch, fixes a mixture's order
            state["mixture"] = self.mixture.layout
        if self.order == "node":  # and for the node order, the world it was laid out for
            state["layout"] = list(self.epoch_layout())
        state["arrangement"] = self._arrangement()
        return state

    def _arrangement(self) -> Dict[str, Any]:
        """What, with seed and epoch, fixes the global order: a state resumes only into it."""
        key: Dict[str, Any] = {"shuffle": self.shuffle}
        if self.shuffle:  # unshuffled, every order is the dataset's own
            key["order"] = self.order
            if self.order == "block":
                key["block_size"] = self.block_size
            if self.order != "random":
                key["window"] = self.window
        if self.groups is not None:  # grouped in runs of one global batch
            key["aspect_groups"] = self.aspect_groups
            key["global_batch"] = self.batch_size * self.num_replicas
        return key

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from ``state`` (maybe saved at another world size) at the next unseen sample.
        A finished epoch's state, loaded after ``set_epoch(later)`` but before iterating (as
        ``StatefulDataLoader`` does), leaves that later epoch to start from the top."""
        missing = {"seed", "epoch", "consumed"} - set(state)
        if missing:
            raise ValueError(f"not a PackedSampler state (missing {sorted(missing)}): pass what "
                             f"PackedSampler.state_dict() returned")
        if state.get("size", self.size) != self.size:
            raise ValueError(f"the state was saved for a dataset of {state['size']} samples, this one "
                             f"has {self.size}; resume on the same dataset or start a new run")
        saved, layout = state.get("mixture"), getattr(self.mixture, "layout", None)
        if saved is not None and [list(p) for p in saved] != layout:
            raise ValueError(f"the state was saved for a mixture of {saved} "
                             f"([samples, samples per epoch] per source), this one is "
                             f"{layout or 'not a mixture'}; "
                             f"resume with the same sources, weights and epoch_size")
        saved, mine = state.get("arrangement"), self._arrangement()
        inside = 0 < int(state["consumed"]) < self.size  # at an epoch's edge no order is left
        if saved is not None and inside and dict(saved) != mine:
            raise ValueError(f"the state was saved for a sampler arranged as {dict(saved)}, this "
                             f"one is {mine}: the rest of the epoch would repeat some samples "
                             f"and skip others; resume with the same order settings (and, with "
                             f"aspect_groups, the same batch_size x world size)")
        consumed, epoch = int(state["consumed"]), int(state["epoch"])
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, got {consumed}")
        done = not rank_count(self.size, consumed, self.num_replicas, self.drop_last)
        later, self._begun = not self._begun and self.epoch > epoch, True
        if done and later:  # the state's epoch is over: start the later one
            self.seed = int(state["seed"])
            return
        self.seed, self.epoch = int(state["seed"]), epoch
        if self.order == "node" and "layout" in state:
            self._resumed_layout = (self.epoch, tuple(state["layout"]))
            self._cache = None
        # Saved after the epoch's last sample: the next pass is empty (else every sample twice).
        self._consumed = self._start = consumed

    def __repr__(self) -> str:
        extra = f", block_size={self.block_size}, window={self.window}" if self.order == "block" else ""
        extra += f", window={self.window}, layout={self.layout}" if self.order == "node" else ""
        return (f"PackedSampler(size={self.size}, rank={self.rank}/{self.num_replicas}, "
                f"order={self.order!r}, shuffle={self.shuffle}, seed={self.seed}, "
                f"epoch={self.epoch}, drop_last={self.drop_last}{extra})")
