"""PackedSampler: order validity, DDP-exact splits, O(1) resume (fresh process), elastic resume."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader

from packer.loading.loader import make_loader
from packer.reading.sampler import PackedSampler, global_order

SIZES = [1, 7, 97, 256, 1001]


def take(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def ranks(n, w, **kw):
    return [PackedSampler(range(n), num_replicas=w, rank=r, **kw) for r in range(w)]


# -- the order -------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["random", "block"])
@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 257, 1000, 5003])
def test_global_order_is_a_permutation(n, order):
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (12345, 7)]:
        p = global_order(n, seed=seed, epoch=epoch, order=order, block_size=16, window=4)
        assert p.dtype == torch.int64
        assert sorted(p.tolist()) == list(range(n))


@pytest.mark.parametrize("order", ["random", "block"])
def test_order_depends_only_on_seed_and_epoch(order):
    a = global_order(3000, seed=5, epoch=2, order=order)
    assert torch.equal(a, global_order(3000, seed=5, epoch=2, order=order))
    assert not torch.equal(a, global_order(3000, seed=5, epoch=3, order=order))
    assert not torch.equal(a, global_order(3000, seed=6, epoch=2, order=order))
    # seed/epoch are hashed together, not added: (0, 1) and (1, 0) differ
    assert not torch.equal(global_order(3000, seed=0, epoch=1, order=order),
                           global_order(3000, seed=1, epoch=0, order=order))
    assert global_order(5, shuffle=False, order=order).tolist() == [0, 1, 2, 3, 4]


def test_order_is_the_same_on_every_machine():
    # Golden values: if these change, every saved checkpoint resumes in a different order.
    assert global_order(12, seed=0, epoch=0).tolist() == GOLDEN_RANDOM
    assert global_order(12, seed=0, epoch=0, order="block", block_size=3, window=2).tolist() == GOLDEN_BLOCK


GOLDEN_RANDOM = [6, 7, 1, 0, 4, 10, 11, 8, 9, 2, 3, 5]
GOLDEN_BLOCK = [6, 7, 8, 0, 1, 2, 9, 3, 10, 4, 11, 5]


def test_a_block_past_the_end_costs_what_the_dataset_does():
    """block_size=10**12 (one block: plain sequential blocks) asked for an 8 TB grid; the
    order is that of one block of the whole dataset."""
    for window in (1, 4):
        huge = global_order(23, seed=5, order="block", block_size=10 ** 12, window=window)
        assert huge.tolist() == global_order(23, seed=5, order="block", block_size=23,
                                             window=window).tolist()


def test_block_order_reads_few_blocks_at_a_time_each_ascending():
    n, bs, win = 10_000, 50, 8
    p = global_order(n, seed=3, order="block", block_size=bs, window=win).tolist()
    assert p != sorted(p)
    for lo in range(0, n, bs * win):
        part = p[lo:lo + bs * win]
        blocks = {}
        for i in part:
            blocks.setdefault(i // bs, []).append(i)
        assert len(blocks) <= win  # a window holds `window` whole blocks...
        for records in blocks.values():  # ...each read front to back
            assert records == sorted(records) and len(records) == bs
        # ...interleaved, not one after the other
        assert len({i // bs for i in part[:bs]}) > 1


# -- DDP splits ------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["random", "block"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_equal_counts_and_no_overlap_for_every_world_size(n, drop_last, order):
    for w in range(1, 9):
        samplers = ranks(n, w, drop_last=drop_last, order=order, seed=11, block_size=8, window=3)
        parts = [list(s) for s in samplers]
        expected = n // w if drop_last else -(-n // w)
        assert [len(s) for s in samplers] == [expected] * w
        assert [len(p) for p in parts] == [expected] * w
        flat = [i for p in parts for i in p]
        if drop_last:
            assert len(set(flat)) == len(flat)  # no sample on two ranks
        else:
            assert set(flat) == set(range(n))  # every sample, padding repeats only the start
            assert len(flat) - n == expected * w - n < w
        # batches per rank are equal too
        for bs in (1, 3, 8):
            assert len({len(DataLoader(range(n), batch_size=bs, sampler=s)) for s in samplers}) == 1


def test_world_from_torch_distributed(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        s = PackedSampler(range(10))
        assert (s.num_replicas, s.rank) == (1, 0)
    finally:
        dist.destroy_process_group()
    assert (PackedSampler(range(10)).num_replicas, PackedSampler(range(10)).rank) == (1, 0)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="order must be one of"):
        PackedSampler(range(5), order="quasi")
    with pytest.raises(ValueError, match="rank must be in"):
        PackedSampler(range(5), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas"):
        PackedSampler(range(5), num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="block_size"):
        PackedSampler(range(5), order="block", block_size=0)
    s = PackedSampler(range(5))
    with pytest.raises(ValueError, match="same dataset"):
        s.load_state_dict({"seed": 0, "epoch": 0, "consumed": 1, "size": 6})
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"yielded": 3})
    with pytest.raises(ValueError, match="consumed"):
        s.state_dict(consumed=-1)


# -- epochs ----------------------------------------------------------------------------------

def test_set_epoch_changes_order_and_reaches_persistent_workers():
    n = 64
    s = PackedSampler(range(n), seed=1)
    dl = DataLoader(range(n), batch_size=8, sampler=s, num_workers=2, persistent_workers=True)
    seen = []
    for epoch in range(3):
        s.set_epoch(epoch)
        got = [i for b in dl for i in b.tolist()]
        assert got == global_order(n, seed=1, epoch=epoch).tolist()
        seen.append(got)
    assert seen[0] != seen[1] != seen[2]
    assert list(s) == seen[2]  # without set_epoch an epoch repeats (as DistributedSampler)


# -- resume ----------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["random", "block"])
def test_state_is_a_few_numbers_and_resume_skips_nothing_and_replays_nothing(order):
    n, w = 1001, 3
    full = [list(s) for s in ranks(n, w, seed=4, order=order)]
    samplers = ranks(n, w, seed=4, order=order)
    heads = [take(s, 100) for s in samplers]
    state = samplers[0].state_dict()
    arranged = {"order": order, "shuffle": True, **({"block_size": 256, "window": 16}
                                                     if order == "block" else {})}
    assert state == {"seed": 4, "epoch": 0, "consumed": 300, "size": n, "arrangement": arranged}
    assert all(s.state_dict() == state for s in samplers)  # ranks agree: save rank 0's
    resumed = ranks(n, w, seed=999, order=order)  # the state's seed wins
    for s in resumed:
        s.load_state_dict(state)
    assert [len(s) for s in resumed] == [len(f) - 100 for f in full]
    assert [h + list(s) for h, s in zip(heads, resumed)] == full
    # the next pass (next epoch, or this one again) starts from the top
    assert [list(s) for s in resumed] == full


def test_set_epoch_after_resume_keeps_position_only_for_the_restored_epoch():
    s = PackedSampler(range(50), seed=2)
    s.set_epoch(3)
    head = take(s, 20)
    state = s.state_dict()
    r = PackedSampler(range(50), seed=2)
    r.load_state_dict(state)
    r.set_epoch(3)  # the usual `for epoch in range(start_epoch, ...): set_epoch(epoch)`
    assert head + list(r) == global_order(50, seed=2, epoch=3).tolist()
    r.load_state_dict(state)
    r.set_epoch(4)
    assert list(r) == global_order(50, seed=2, epoch=4).tolist()


def test_finished_epoch_state_resumes_to_an_empty_pass():
    """A state saved after the epoch's last sample: the resumed loop sees nothing more of
    that epoch (it would see every sample twice otherwise: the exactly-once test caught it),
    the pass after starts from the top, and set_epoch(epoch + 1) starts the next at once."""
    s = PackedSampler(range(10), num_replicas=3, rank=1, drop_last=True)
    full = list(s)
    assert s.state_dict()["consumed"] == 9
    r = PackedSampler(range(10), num_replicas=3, rank=1, drop_last=True)
    r.load_state_dict(s.state_dict())
    assert len(r) == 0 and list(r) == []
    assert list(r) == full
    r.load_state_dict(s.state_dict())
    r.set_epoch(0)  # the same epoch: still done
    assert list(r) == []
    r.load_state_dict(s.state_dict())
    r.set_epoch(1)
    n = PackedSampler(range(10), num_replicas=3, rank=1, drop_last=True)
    n.set_epoch(1)
    assert list(r) == list(n)


@pytest.mark.parametrize("workers", [0, 2])
def test_finished_epoch_state_then_the_next_pass_reads_everything_through_make_loader(workers):
    """make_loader's loader (its epoch stream) after that state: one empty pass,
    then whole ones, as a plain DataLoader gives; an empty pass once kept it empty forever."""
    ds = list(range(10))
    state = {"seed": 3, "epoch": 2, "consumed": 10, "size": 10}
    passes = []
    for loader_of in (lambda s: DataLoader(ds, 4, sampler=s),
                      lambda s: make_loader(ds, 4, sampler=s, num_workers=workers,
                                            pin_memory=False)):
        s = PackedSampler(ds, seed=3)
        s.load_state_dict(state)
        loader = loader_of(s)
        passes.append([sum(len(b) for b in loader) for _ in range(3)])
    assert passes[0] == passes[1] == [0, 10, 10]


RESUME_SCRIPT = textwrap.dedent("""
    import json, sys
    from packer.reading.sampler import PackedSampler
    n, w, order, state = json.loads(sys.argv[1])
    out = []
    for r in range(w):
        s = PackedSampler(range(n), num_replicas=w, rank=r, order=order, block_size=16)
        s.load_state_dict(state)
        s.set_epoch(state["epoch"])
        out.append(list(s))
    print(json.dumps(out))
""")


def fresh_process(script, *args):
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ["random", "block"])
def test_resume_in_a_fresh_process_equals_an_uninterrupted_run(order):
    n, w, bs, k = 777, 2, 16, 9  # save after k steps of a per-rank batch size bs
    samplers = ranks(n, w, seed=8, order=order, block_size=16)
    for s in samplers:
        s.set_epoch(5)
    full = [list(s) for s in samplers]
    loaders = [DataLoader(range(n), batch_size=bs, sampler=s) for s in samplers]
    its = [iter(dl) for dl in loaders]
    heads = [[i for _ in range(k) for i in next(it).tolist()] for it in its]
    # num_workers=0: nothing prefetched, the sampler's own count is exact...
    state = samplers[0].state_dict()
    # ...and equals the documented formula for prefetching loaders
    assert state == samplers[0].state_dict(consumed=k * bs * w)
    state = dict(state, seed=8)
    rest = fresh_process(RESUME_SCRIPT, json.dumps([n, w, order, state]))
    assert [h + r for h, r in zip(heads, rest)] == full


def test_elastic_resume_w4_to_w2_continues_the_same_global_batches():
    n, global_batch, steps = 1000, 32, 10
    old = ranks(n, 4, seed=3)
    old_batches = [list(DataLoader(range(n), batch_size=global_batch // 4, sampler=s)) for s in old]
    # global step t = the union of every rank's step-t batch
    uninterrupted = [sorted(i for r in range(4) for i in old_batches[r][t].tolist())
                     for t in range(len(old_batches[0]))]
    state = old[0].state_dict(consumed=steps * global_batch)  # saved after `steps` steps
    new = ranks(n, 2, seed=0)
    for s in new:
        s.load_state_dict(state)
    new_batches = [list(DataLoader(range(n), batch_size=global_batch // 2, sampler=s)) for s in new]
    assert len(new_batches[0]) == len(new_batches[1]) == len(uninterrupted) - steps
    continued = [sorted(i for r in range(2) for i in new_batches[r][t].tolist())
                 for t in range(len(new_batches[0]))]
    assert continued == uninterrupted[steps:]
    seen = {i for t in uninterrupted[:steps] for i in t}
    assert seen.isdisjoint(i for t in continued for i in t)
    assert seen | {i for t in continued for i in t} == set(range(n))


def test_prefetching_loader_overcounts_unless_told_consumed():
    n, bs = 200, 4
    s = PackedSampler(range(n), seed=6)
    full = list(s)
    dl = DataLoader(range(n), batch_size=bs, sampler=s, num_workers=2, prefetch_factor=2)
    it = iter(dl)
    head = [i for _ in range(5) for i in next(it).tolist()]
    assert s.state_dict()["consumed"] > 5 * bs  # drawn ahead by the workers' prefetch
    state = s.state_dict(consumed=5 * bs)
    del it
    r = PackedSampler(range(n), seed=6)
    r.load_state_dict(state)
    assert head + list(r) == full


# -- torchdata StatefulDataLoader ------------------------------------------------------------

SDL_SCRIPT = textwrap.dedent("""
    import json, sys
    from torchdata.stateful_dataloader import StatefulDataLoader
    from packer.reading.sampler import PackedSampler
    n, w, bs, workers, state = json.loads(sys.argv[1])
    out = []
    for r in range(w):
        s = PackedSampler(range(n), num_replicas=w, rank=r, seed=21)
        dl = StatefulDataLoader(range(n), batch_size=bs, sampler=s, num_workers=workers)
        dl.load_state_dict(state)
        out.append([b.tolist() for b in dl])
    print(json.dumps(out))
""")


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_round_trip(workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    n, w, bs, k = 203, 2, 4, 7
    full = [list(s) for s in ranks(n, w, seed=21)]
    full = [[f[i:i + bs] for i in range(0, len(f), bs)] for f in full]
    dls = [sdl.StatefulDataLoader(range(n), batch_size=bs, sampler=s, num_workers=workers)
           for s in ranks(n, w, seed=21)]
    its = [iter(dl) for dl in dls]
    heads = [[next(it).tolist() for _ in range(k)] for it in its]  # workers prefetch beyond k
    if workers:
        assert dls[0].sampler.state_dict()["consumed"] > k * bs * w
    states = [dl.state_dict() for dl in dls]
    sampler_state = states[0]
    for key in ("_snapshot", "_main_snapshot", "_sampler_iter_state", "sampler_state"):
        sampler_state = sampler_state.get(key, sampler_state)
    assert sampler_state == {"seed": 21, "epoch": 0, "consumed": k * bs * w, "size": n,
                             "arrangement": {"order": "random", "shuffle": True}}
    del its
    rest = fresh_process(SDL_SCRIPT, json.dumps([n, w, bs, workers, states[0]]))  # rank 0's state
    assert [h + r for h, r in zip(heads, rest)] == full


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_stateful_dataloader_elastic_w4_to_w2():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    n, steps = 1000, 10

    def loaders(w, bs):
        return [sdl.StatefulDataLoader(range(n), batch_size=bs, num_workers=2,
                                       sampler=PackedSampler(range(n), num_replicas=w, rank=r, seed=3))
                for r in range(w)]

    full = [list(s) for s in ranks(n, 4, seed=3)]
    uninterrupted = [sorted(i for f in full for i in f[t:t + 8]) for t in range(0, len(full[0]), 8)]
    old = loaders(4, 8)
    its = [iter(dl) for dl in old]
    for _ in range(steps):
        for it in its:
            next(it)
    state = old[0].state_dict()  # same num_workers on resume: StatefulDataLoader requires it
    del its
    new = loaders(2, 16)
    for dl in new:
        dl.load_state_dict(state)
    batches = [[b.tolist() for b in dl] for dl in new]
    assert [sorted(a + b) for a, b in zip(*batches)] == uninterrupted[steps:]


# -- aspect-ratio grouped batches ----------------------------------------------------------------

class _Ratios:
    """A dataset stand-in with aspect ratios (PackedDataset reads them from its columns)."""

    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.r = torch.where(torch.rand(n, generator=g) < 0.6, 4 / 3, 3 / 4).double()
        self.r[::7] = 16 / 9

    def __len__(self):
        return len(self.r)

    def aspect_ratios(self):
        return self.r


def _batches(seq, b):
    return [seq[i:i + b] for i in range(0, len(seq), b)]


@pytest.mark.parametrize("world, factor", [(1, 0), (2, 0), (3, 3)])
def test_grouped_batches_hold_one_aspect_group_on_every_rank(world, factor):
    from packer.reading.sampler import aspect_group_ids
    ds, b = _Ratios(203), 4
    groups = aspect_group_ids(ds.aspect_ratios(), factor)
    outs = [list(PackedSampler(ds, num_replicas=world, rank=r, seed=3, aspect_groups=factor,
                               batch_size=b)) for r in range(world)]
    assert len({len(o) for o in outs}) == 1  # equal on every rank (DDP-exact)
    seen = sorted(i for o in outs for i in o)
    assert set(seen) == set(range(len(ds)))  # every sample, padding repeats only the start
    mixed = 0
    for o in outs:
        for batch in _batches(o, b):
            mixed += len({int(groups[i]) for i in batch}) > 1
    # Only the batches made of the groups' remainders mix: at most one run per group.
    assert mixed <= (int(groups.max()) + 1) * world


def test_grouped_order_depends_on_the_global_batch_and_resumes():
    ds = _Ratios(150)
    one = list(PackedSampler(ds, num_replicas=1, rank=0, aspect_groups=0, batch_size=8, seed=1))
    two = [list(PackedSampler(ds, num_replicas=2, rank=r, aspect_groups=0, batch_size=4, seed=1))
           for r in range(2)]
    interleaved = [i for pair in zip(*two) for i in pair]
    assert interleaved[:len(one)] == one[:len(interleaved)]  # same global batches
    s = PackedSampler(ds, aspect_groups=0, batch_size=8, seed=1)
    s.load_state_dict({"seed": 1, "epoch": 0, "consumed": 40})
    assert list(s) == one[40:]  # O(1) resume: the same order, from the next unseen sample
    assert list(PackedSampler(ds, aspect_groups=0, batch_size=8, seed=2)) != one


def test_a_state_resumes_only_into_the_order_it_was_saved_for():
    """The rest of an epoch is exactly the unseen samples only in the same arrangement: a
    state from another order, block size or (grouped) global batch is refused; another
    world size with the same global batch, or without groups, resumes."""
    ds = _Ratios(200)
    ranks = [PackedSampler(ds, seed=0, num_replicas=4, rank=r, aspect_groups=2, batch_size=8)
             for r in range(4)]
    its = [iter(s) for s in ranks]
    seen = [next(it) for _ in range(3) for it in its for _ in range(8)]  # 3 global batches
    state = ranks[0].state_dict()
    with pytest.raises(ValueError, match="same batch_size x world size"):
        PackedSampler(ds, seed=0, num_replicas=2, rank=0, aspect_groups=2,
                      batch_size=8).load_state_dict(state)
    rest = []
    for r in range(2):  # 2 ranks x 16: the same global batch
        s = PackedSampler(ds, seed=0, num_replicas=2, rank=r, aspect_groups=2, batch_size=16)
        s.load_state_dict(state)
        rest += list(s)
    assert sorted(seen + rest) == list(range(200))
    block = PackedSampler(range(100), order="block", block_size=8, seed=1)
    take(block, 10)  # mid-epoch
    with pytest.raises(ValueError, match="arranged as"):
        PackedSampler(range(100), seed=1).load_state_dict(block.state_dict())
    with pytest.raises(ValueError, match="arranged as"):
        PackedSampler(range(100), order="block", block_size=16, seed=1).load_state_dict(block.state_dict())
    elastic = PackedSampler(range(100), order="block", block_size=8, seed=1, num_replicas=3, rank=0)
    elastic.load_state_dict(block.state_dict())  # another world size: fine
    # At an epoch's edge nothing of the old order is left; unshuffled, every order is 0..n-1.
    edge = dict(state, consumed=0)
    PackedSampler(ds, seed=0, num_replicas=8, rank=0, aspect_groups=2, batch_size=8).load_state_dict(edge)
    plain = PackedSampler(range(100), order="block", shuffle=False)
    take(plain, 10)
    PackedSampler(range(100), shuffle=False).load_state_dict(plain.state_dict())


def test_grouping_needs_batch_size_and_ratios():
    with pytest.raises(ValueError, match="batch_size"):
        PackedSampler(_Ratios(10), aspect_groups=0)
    with pytest.raises(ValueError, match="aspect_ratios"):
        PackedSampler(list(range(10)), aspect_groups=0, batch_size=2)
