"""``Mixture``: several datasets read as one (indices as ``ConcatDataset``'s), each a fixed
share of every epoch, which ``PackedSampler`` takes from ``epoch_order`` (docs/mixture.md)."""
from __future__ import annotations

import bisect
import itertools
import math
from fractions import Fraction
from typing import Any, List, Optional, Sequence

import torch
from torch.utils.data import Dataset, IterableDataset

from .sampler import seed_for

__all__ = ["Mixture", "share_counts", "source_draws", "target_kind"]

_WALK, _INTERLEAVE = 2, 3  # seed_for salts (1 is grouped_order's)


def share_counts(weights: Sequence[float], total: int) -> List[int]:
    """``total`` split in proportion to ``weights`` by largest remainder (ties: the earlier
    source), in exact arithmetic so every machine agrees."""
    whole = sum(map(Fraction, weights))
    exact = [Fraction(w) * total / whole for w in weights]
    counts = [math.floor(e) for e in exact]
    by_rest = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_rest[:total - sum(counts)]:
        counts[i] += 1
    return counts


def source_draws(n: int, count: int, *, seed: int, epoch: int, source: int,
                 shuffle: bool = True) -> torch.Tensor:
    """The local indices (int64) a source of ``n`` samples giving ``count`` per epoch gives to
    ``epoch`` (docs/mixture.md): a pure function of its arguments."""
    full, rest = divmod(count, n) if n else (0, 0)
    parts = [torch.arange(n).repeat(full)]
    if rest:
        rnd, step = divmod(epoch, -(-n // rest))  # the round, and this epoch's place in it
        walk = torch.arange(n)
        if shuffle:
            walk = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed_for(seed, rnd, _WALK, source)))
        parts.append(walk[(torch.arange(rest) + step * rest) % n])
    return torch.cat(parts)


def target_kind(dataset) -> Optional[str]:
    """What ``dataset``'s samples carry as their target where packer makes it, else None."""
    make = getattr(dataset, "make_target", None)
    if make is None or getattr(dataset, "target_transform", None) is not None \
            or getattr(dataset, "transforms", None) is not None:
        return None
    if make.names is not None:
        return f"the field {make.names[0]!r}" if make.single else f"the fields {make.names}"
    if make.detection:
        return f"detection targets ({', '.join(make.keys)})"
    if make.label_only:
        return "class labels"
    return f"dicts of the fields {list(make.fields)}"


class Mixture(Dataset):
    """Datasets read as one, each a fixed share of every epoch, through ``PackedSampler``
    (without one the weights do not apply; docs/mixture.md).

    Args:
        datasets: map-style datasets giving the same kind of target (else ``ValueError``);
            class indices stay each source's own. Not a ``Mixture``: only the outer one's
            weights act, so a nested one is refused.
        weights: each source's share of an epoch (non-negative, not all 0); default: lengths.
        epoch_size: samples per epoch (all ranks together); default: the sources' total.

    ``counts``: each source's samples per epoch, summing to ``epoch_size``."""

    def __init__(self, datasets: Sequence[Any], weights: Optional[Sequence[float]] = None, *,
                 epoch_size: Optional[int] = None):
        self.sources = list(datasets)
        if not self.sources:
            raise ValueError("Mixture needs at least one dataset")
        for s, d in enumerate(self.sources):
            if isinstance(d, IterableDataset) or not hasattr(d, "__getitem__"):
                raise ValueError(f"Mixture mixes map-style datasets (indexable, with len()); "
                                 f"source {s} is a {type(d).__name__}: use PackedDataset")
            if hasattr(d, "epoch_order"):  # PackedSampler's test: its weights would go unused
                raise ValueError(f"source {s} is itself a Mixture, whose weights and epoch_size "
                                 f"would be ignored (its samples read uniformly); list its "
                                 f"sources in this Mixture with their weights")
        self.lengths = [len(d) for d in self.sources]
        self.offsets = [0, *itertools.accumulate(self.lengths)]
        self.weights = _weights(weights, self.lengths)
        epoch_size = self.offsets[-1] if epoch_size is None else epoch_size
        if not isinstance(epoch_size, int) or isinstance(epoch_size, bool) or epoch_size < 1:
            raise ValueError(f"epoch_size must be a positive int (samples per epoch), "
                             f"got {epoch_size!r}")
        self.epoch_size = epoch_size
        self.counts = share_counts(self.weights, epoch_size)
        kinds = [(s, k) for s, d in enumerate(self.sources) if (k := target_kind(d)) is not None]
        for s, k in kinds[1:]:  # targets that cannot be batched together
            if k != kinds[0][1]:
                s0, k0 = kinds[0]
                raise ValueError(
                    f"Mixture sources must give the same kind of target to be batched together: "
                    f"source {s0} ({self.sources[s0]!r}) gives {k0}, source {s} "
                    f"({self.sources[s]!r}) gives {k}; select matching targets (target_fields=, "
                    f"target_keys=) or map them with target_transform=")

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def layout(self) -> List[List[int]]:
        """``[samples, samples per epoch]`` per source: with (seed, epoch) it fixes the order
        (``PackedSampler`` keeps it in its state, to refuse another mixture's)."""
        return [[n, c] for n, c in zip(self.lengths, self.counts)]

    def locate(self, index: int):
        """``(source, local index)`` of mixture index ``index``."""
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a Mixture of {len(self)} samples")
        s = bisect.bisect_right(self.offsets, index) - 1
        return s, index - self.offsets[s]

    def __getitem__(self, index: int):
        s, i = self.locate(index)
        return self.sources[s][i]

    def epoch_order(self, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
        """The epoch's ``epoch_size`` mixture indices (int64): each source's draws, interleaved by a
        seeded permutation (``shuffle=False``: source after source)."""
        seq = torch.cat([source_draws(n, c, seed=seed, epoch=epoch, source=s, shuffle=shuffle) + off
                         for s, (n, c, off) in enumerate(zip(self.lengths, self.counts, self.offsets))])
        if not shuffle:
            return seq
        g = torch.Generator().manual_seed(seed_for(seed, epoch, _INTERLEAVE))
        return seq[torch.randperm(len(seq), generator=g)]

    def aspect_ratios(self) -> torch.Tensor:
        """width / height per mixture index (``PackedSampler(aspect_groups=...)``)."""
        for s, d in enumerate(self.sources):
            if not hasattr(d, "aspect_ratios"):
                raise ValueError(f"aspect_groups needs every source to have aspect_ratios(); "
                                 f"source {s} ({type(d).__name__}) has not")
        return torch.cat([d.aspect_ratios() for d in self.sources])

    @property
    def task(self) -> Optional[str]:
        """The sources' ``task`` where they all have the same, else None."""
        tasks = {getattr(d, "task", None) for d in self.sources}
        return tasks.pop() if len(tasks) == 1 else None

    def __repr__(self) -> str:
        parts = ", ".join(f"{type(d).__name__}({n}): {c}" for d, n, c in
                          zip(self.sources, self.lengths, self.counts))
        return f"Mixture([{parts}], epoch_size={self.epoch_size})"


def _weights(weights, lengths: List[int]) -> list:
    """The weights checked (default: the lengths)."""
    weights = [w if isinstance(w, int) else float(w)
               for w in (lengths if weights is None else weights)]
    if len(weights) != len(lengths):
        raise ValueError(f"Mixture got {len(lengths)} datasets and {len(weights)} weights; "
                         f"give one weight per dataset")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not any(weights):
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {weights}")
    empty = [s for s, (w, n) in enumerate(zip(weights, lengths)) if w and not n]
    if empty:
        raise ValueError(f"source {empty[0]} has no samples but weight {weights[empty[0]]}: "
                         f"drop it or give it weight 0")
    return weights

