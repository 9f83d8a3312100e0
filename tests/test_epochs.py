"""``make_loader`` over a ``PackedSampler`` (``packer.loading.epochs``): the workers run on into the
next epoch, and every epoch still holds exactly the batches a plain DataLoader over the same
``PackedSampler`` gives — with ``set_epoch``, without it, abandoned midway, resumed, split
across ranks, and with the sampler ``make_loader`` makes when given none."""
from __future__ import annotations

import os
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from packer import PackedSampler, make_loader
from packer.loading import PackedLoader, collate_uint8


class Indices(Dataset):
    """Returns its index as a uint8-image-shaped sample (make_loader batches those), and,
    when ``log`` is given, when it was loaded."""

    def __init__(self, n: int, delay: float = 0.0, log=None):
        self.n, self.delay, self.log = n, delay, log

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{i} {time.monotonic()}\n")
        return torch.zeros(3, 2, 2, dtype=torch.uint8), i


def epochs_of(loader, epochs, set_epoch=True):
    out = []
    for e in range(epochs):
        if set_epoch:
            loader.sampler.set_epoch(e) if isinstance(loader, DataLoader) else loader.set_epoch(e)
        out.append([y.tolist() for _, y in loader])
    return out


def plain(ds, sampler, bs, drop_last=False):
    return DataLoader(ds, bs, sampler=sampler, num_workers=2, drop_last=drop_last,
                      collate_fn=collate_uint8)


@pytest.mark.parametrize("n, bs, world, drop_last", [(50, 8, 1, False), (50, 8, 2, True),
                                                     (33, 4, 3, False)])
def test_same_batches_as_a_plain_loader_every_epoch(n, bs, world, drop_last):
    ds = Indices(n)
    for rank in range(world):
        mk = lambda: PackedSampler(ds, seed=3, num_replicas=world, rank=rank,  # noqa: E731
                                   drop_last=drop_last)
        fast = make_loader(ds, bs, sampler=mk(), num_workers=2, drop_last=drop_last,
                           pin_memory=False)
        assert isinstance(fast, PackedLoader) and fast.stream is not None
        assert len(fast) == len(plain(ds, mk(), bs, drop_last))
        want = epochs_of(plain(ds, mk(), bs, drop_last), 5)
        assert epochs_of(fast, 3) == want[:3]
        # Without set_epoch each complete pass is the next epoch (3, then 4).
        assert epochs_of(fast, 2, set_epoch=False) == want[3:]


def test_abandoned_epoch_and_resume_restart_the_stream_where_the_sampler_is():
    ds, bs = Indices(40), 4
    s = PackedSampler(ds, seed=1)
    fast = make_loader(ds, bs, sampler=s, num_workers=2, pin_memory=False)
    it = iter(fast)
    first = [next(it)[1].tolist() for _ in range(3)]
    state = s.state_dict()
    assert state["consumed"] == 12  # what the loop received, not what the workers fetched
    del it
    rest = [y.tolist() for _, y in fast]  # abandoned midway: the epoch restarts from the top
    assert rest[:3] == first and len(rest) == 10
    s2 = PackedSampler(ds, seed=1)
    s2.load_state_dict(state)
    resumed = make_loader(ds, bs, sampler=s2, num_workers=2, pin_memory=False)
    assert [y.tolist() for _, y in resumed] == rest[3:]
    s2.set_epoch(1)
    assert [y.tolist() for _, y in resumed] == epochs_of(plain(ds, PackedSampler(ds, seed=1), bs),
                                                         2)[1]


def test_next_epochs_first_batches_are_loaded_before_this_epoch_ends(tmp_path):
    log = tmp_path / "loads.txt"
    ds, bs = Indices(32, delay=0.01, log=log), 4
    s = PackedSampler(ds, seed=2)
    fast = make_loader(ds, bs, sampler=s, num_workers=2, pin_memory=False)
    s.set_epoch(0)
    for _ in fast:
        time.sleep(0.02)  # the training step
    end_of_epoch0 = time.monotonic()
    time.sleep(0.3)  # the end of epoch work (evaluation, checkpoint): the workers go on
    s.set_epoch(1)
    epoch1 = [y.tolist() for _, y in fast]
    first = set(epoch1[0])
    loads = [line.split() for line in log.read_text().splitlines()]
    # Epoch 1's first batch was loaded (by the workers, ahead) before epoch 0 was over for
    # the loop: each index is loaded once per epoch, so its second load is epoch 1's (the
    # workers have run on into epoch 2 since).
    when = {}
    for i, t in loads:
        when.setdefault(int(i), []).append(float(t))
    assert all(when[i][1] < end_of_epoch0 + 0.3 for i in first)
    assert sum(1 for i, t in loads if float(t) < end_of_epoch0) > 32  # beyond epoch 0's 32
    assert os.getpid()


class OneSlowWorker(Dataset):
    """Sample i: (image-shaped zeros, i, the id of the worker that loaded it); worker 0
    takes ``delay`` seconds per sample, the others none (a worker sharing its core)."""

    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        worker = torch.utils.data.get_worker_info().id
        if worker == 0:
            time.sleep(self.delay)
        return torch.zeros(3, 2, 2, dtype=torch.uint8), i, worker


def test_a_slow_worker_gets_fewer_batches_and_they_still_come_in_order():
    """In order, DataLoader gives batch k to worker k mod W, so every worker waits for the
    slowest; here the batches go to the workers with room and come back in the sampler's
    order all the same, epoch after epoch."""
    ds = OneSlowWorker(240, delay=0.01)
    sampler = PackedSampler(ds, shuffle=False)
    loader = make_loader(ds, 4, sampler=sampler, num_workers=2, pin_memory=False)
    made_by = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = [(y.tolist(), w.tolist()) for _, y, w in loader]
        assert [i for y, _ in seen for i in y] == list(range(240))
        made_by += [w[0] for _, w in seen]
    slow_share = made_by.count(0) / len(made_by)
    assert slow_share < 0.3, f"the slow worker made {slow_share:.0%} of the batches (1/2 in turn)"


class Opened(Dataset):
    """Labels come from ``offset``, which a ``worker_init_fn`` sets in each worker (the way
    datasets open handles per worker)."""

    def __init__(self, n: int):
        self.n, self.offset = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.zeros(3, 2, 2, dtype=torch.uint8), self.offset + i


def open_in_worker(_):
    torch.utils.data.get_worker_info().dataset.offset = 1000


def test_worker_init_fn_reaches_the_dataset_through_the_epoch_stream():
    """``get_worker_info().dataset`` is the stream's wrapper; what a ``worker_init_fn`` sets
    on it must land on the caller's dataset, as with a plain DataLoader."""
    ds = Opened(8)
    loader = make_loader(ds, 4, sampler=PackedSampler(ds, shuffle=False), num_workers=1,
                         worker_init_fn=open_in_worker, pin_memory=False)
    assert isinstance(loader, PackedLoader) and loader.dataset is ds
    assert loader.collate_fn.func.__name__ == "collate_uint8"  # the caller's, not the stream's
    assert [y.tolist() for _, y in loader] == [[1000, 1001, 1002, 1003], [1004, 1005, 1006, 1007]]


def test_an_iterable_dataset_with_a_packed_sampler_is_refused_when_made():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

        def __len__(self):
            return 4

    with pytest.raises(ValueError, match="IterableDataset"):
        make_loader(Stream(), 2, sampler=PackedSampler(range(4)), num_workers=1)


def test_without_a_sampler_the_loader_makes_a_seeded_packed_sampler():
    """``make_loader(ds, B)``: the fast path, seeded from torch's generator (or
    ``generator=``) as RandomSampler is, the whole dataset in this process, each pass the
    next epoch; ``shuffle=False`` reads in order."""
    ds = Indices(40)
    torch.manual_seed(5)
    fast = make_loader(ds, 4, num_workers=2, pin_memory=False)
    torch.manual_seed(5)
    serial = make_loader(ds, 4, num_workers=0)
    assert isinstance(fast.sampler, PackedSampler) and fast.stream is not None
    assert (fast.sampler.num_replicas, fast.sampler.rank) == (1, 0)
    got = epochs_of(fast, 3, set_epoch=False)
    assert got == epochs_of(serial, 3, set_epoch=False)
    assert got[0] != got[1] != got[2] and sorted(i for b in got[1] for i in b) == list(range(40))
    fast.set_epoch(1)  # set_epoch honoured: epoch 1 again
    assert epochs_of(fast, 1, set_epoch=False) == got[1:2]
    seeded = make_loader(ds, 4, num_workers=0, generator=torch.Generator().manual_seed(1))
    again = make_loader(ds, 4, num_workers=0, generator=torch.Generator().manual_seed(1))
    assert seeded.sampler.seed == again.sampler.seed != fast.sampler.seed
    ordered = make_loader(ds, 4, shuffle=False, num_workers=0)
    assert [i for b in epochs_of(ordered, 1)[0] for i in b] == list(range(40))


def test_the_default_loader_resumes_after_the_last_batch_it_handed_out():
    ds = Indices(40)
    first = make_loader(ds, 4, num_workers=2, pin_memory=False)
    it = iter(first)
    head = [next(it)[1].tolist() for _ in range(4)]  # the workers have made more by now
    state = first.state_dict()
    assert state == {"sampler": {"seed": first.sampler.seed, "epoch": 0, "consumed": 16,
                                 "size": 40, "arrangement": {"order": "random", "shuffle": True}}}
    second = make_loader(ds, 4, num_workers=2, pin_memory=False)
    second.load_state_dict(state)
    rest = [y.tolist() for _, y in second]
    assert sorted(i for b in head + rest for i in b) == list(range(40)) and len(rest) == 6
    with pytest.raises(ValueError, match="PackedSampler"):
        second.load_state_dict({"_snapshot": {}})


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_loader_that_cannot_resume_has_no_state_dict():
    """Over a foreign sampler, ``hasattr(loader, "state_dict")`` is False (how the prefetcher
    and training frameworks ask), and the attribute error says what resumes."""
    ds = Indices(8)
    other = make_loader(ds, 4, sampler=torch.utils.data.SequentialSampler(ds), num_workers=0)
    assert other.stream is None and not other.resumable and not hasattr(other, "state_dict")
    with pytest.raises(AttributeError, match="PackedSampler .* or with stateful=True"):
        other.load_state_dict({})
    assert [y.tolist() for _, y in other] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    pytest.importorskip("torchdata")
    stateful = make_loader(ds, 4, sampler=torch.utils.data.SequentialSampler(ds),
                           num_workers=0, stateful=True)
    assert stateful.resumable and "_num_yielded" in str(stateful.state_dict())


class SomeBad(Dataset):
    """Sample i: an image-shaped tensor and label i; a label of None (which no collate
    takes) for the indices in ``bad``."""

    def __init__(self, n: int, bad=()):
        self.n, self.bad = n, set(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 13:
            raise KeyError("sample 13 cannot be read")
        return torch.zeros(3, 2, 2, dtype=torch.uint8), None if i in self.bad else i


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_that_raises_raises_in_its_turn_and_the_epoch_goes_on(workers):
    """As with a DataLoader: reading (index 13) or collating (a None label) a batch raised;
    that batch raises the same type when its turn comes, and the next ``next()`` goes on
    with the batch after it, counted as handed out."""
    ds = SomeBad(40, bad={4, 28})
    loader = make_loader(ds, 4, shuffle=False, num_workers=workers, pin_memory=False)
    it, seen = iter(loader), []
    for k in range(10):
        try:
            seen.append(next(it)[1].tolist())
        except (TypeError, KeyError) as e:
            seen.append("KeyError" if isinstance(e, KeyError) else type(e).__name__)
            assert k != 3 or "sample 13 cannot be read" in str(e)
            # from a worker, its traceback as lines (a KeyError's str() is one escaped line)
            assert k != 3 or not workers or str(e).splitlines()[1].startswith("Original Trace")
    for _ in range(2):  # and goes on saying so: the next epoch is the next pass's
        with pytest.raises(StopIteration):
            next(it)
    want = [list(range(i, i + 4)) for i in range(0, 40, 4)]
    want[1], want[3], want[7] = "TypeError", "KeyError", "TypeError"
    assert seen == want and loader.sampler.epoch == 1


class DiesOnce(Dataset):
    """Sample i: label i; the worker that first reads sample 9 exits (an OOM kill, say)."""

    def __init__(self, flag):
        self.flag = flag

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == 9 and torch.utils.data.get_worker_info() is not None and not self.flag.exists():
            self.flag.touch()
            os._exit(3)
        return torch.zeros(3, 2, 2, dtype=torch.uint8), i


def test_a_worker_that_dies_is_one_error_and_the_epoch_goes_on_with_new_workers(tmp_path):
    # the stream waited for the dead worker's batches for ever, piling up the others'
    loader = make_loader(DiesOnce(tmp_path / "died"), 4, shuffle=False, num_workers=2,
                         pin_memory=False)
    for epoch in range(2):
        it, got, errors = iter(loader), [], 0
        while True:
            try:
                got += next(it)[1].tolist()
            except StopIteration:
                break
            except RuntimeError as e:
                assert "exited unexpectedly" in str(e)
                errors += 1
                assert errors == 1, "the stream should restart, not fail again"
        assert sorted(got) == list(range(40)) and errors == (epoch == 0)



def test_a_pass_abandoned_at_a_dead_worker_is_followed_by_one_with_new_workers(tmp_path):
    # a for loop ends at the error: the next iter() reused the kept, broken workers for good
    loader = make_loader(DiesOnce(tmp_path / "died"), 4, shuffle=False, num_workers=2,
                         pin_memory=False)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        for _ in loader:
            pass
    for epoch in range(2):  # the rest of the epoch, then a whole one
        got = [i for _, labels in loader for i in labels.tolist()]
        assert len(got) == len(set(got)) and loader.sampler.epoch == epoch + 1
    assert len(got) == 40


def test_a_loader_dropped_after_a_batch_raised_stops_its_workers_at_once():
    # the exception's traceback held the stream in a cycle until the collector ran
    import gc
    import multiprocessing
    loader = make_loader(SomeBad(40), 4, shuffle=False, num_workers=2, pin_memory=False)
    it = iter(loader)
    for _ in range(4):
        try:
            next(it)
        except KeyError:
            pass
    workers = {p.pid for p in multiprocessing.active_children()}
    assert workers
    gc.disable()
    try:
        del it, loader
        deadline = time.time() + 10
        while workers & {p.pid for p in multiprocessing.active_children()}:
            assert time.time() < deadline, "the workers outlived their loader"
            time.sleep(0.05)
    finally:
        gc.enable()


def test_the_batch_sampler_is_one_epoch_of_batches_and_leaves_the_sampler_be():
    loader = make_loader(SomeBad(10), 3, shuffle=True, num_workers=0)
    before = loader.sampler.state_dict()
    batches = list(loader.batch_sampler)
    assert len(batches) == len(loader.batch_sampler) == len(loader) == 4
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert loader.sampler.state_dict() == before
