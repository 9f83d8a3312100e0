"""Mixture: each source's exact share of every epoch, exactly once within it, seeded, DDP-exact,
resumable (also at another world size), each source's decoder and targets kept; through
PackedSampler, make_loader, CUDAPrefetcher and GPUDecoder (on the CPU here)."""
from __future__ import annotations

import io
import shutil
from collections import Counter

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import packer
from packer import CUDAPrefetcher, DecodeCenterCrop, Mixture, PackedDataset, PackedSampler, make_loader
from packer.reading.mixture import share_counts, source_draws

from helpers import cuda, pil_decoder

NA, NB, UID_B = 40, 12, 1000


def jpeg(size, shade) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (shade, 255 - shade, 90)).save(out, "JPEG", quality=90)
    return out.getvalue()


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """Two classification sets with a unique ``uid`` per image (A landscape, B portrait) and
    a detection set."""
    tmp = tmp_path_factory.mktemp("mixture")
    packer.write(tmp / "a", [{"image": jpeg((32, 24), 5 * i), "uid": i, "label": i % 3}
                             for i in range(NA)], progress=False, workers=1)
    packer.write(tmp / "b", [{"image": jpeg((24, 32), 20 * i), "uid": UID_B + i, "label": i % 2}
                             for i in range(NB)], progress=False, workers=1)
    packer.write(tmp / "det", [{"image": jpeg((32, 32), 9 * i), "boxes": [[1.0, 2.0, 20.0, 30.0]],
                                "labels": [i + 1], "image_id": i} for i in range(6)],
                 progress=False, workers=1)
    return tmp


def zeros16(data: bytes) -> torch.Tensor:
    """B's own decoder: a black image, so its samples are recognisable in a batch."""
    return torch.zeros(3, 16, 16, dtype=torch.uint8)


def uid_mixture(root, weights=(3, 1), epoch_size=None, decode_b=zeros16):
    a = PackedDataset(root / "a", decode=DecodeCenterCrop(16), target_fields="uid")
    b = PackedDataset(root / "b", decode=decode_b, target_fields="uid")
    return Mixture([a, b], weights=weights, epoch_size=epoch_size)


def source_of(mix, i):
    return mix.locate(int(i))[0]


# -- the counts and the order -----------------------------------------------------------------

def test_largest_remainder_counts_are_exact_and_sum_to_the_epoch():
    assert share_counts([0.7, 0.3], 10) == [7, 3]
    assert share_counts([1, 1, 1], 10) == [4, 3, 3]  # ties: the earlier source
    assert share_counts([1, 2, 3], 7) == [1, 2, 4]  # exact 7/6, 14/6, 21/6
    assert share_counts([0.1] * 10, 3) == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    for w in ([0.3, 0.3, 0.4], [5, 0, 2], [1e-9, 1.0]):
        for total in (1, 9, 1000, 12345):
            counts = share_counts(w, total)
            assert sum(counts) == total
            assert all(abs(c - x * total / sum(w)) < 1 for c, x in zip(counts, w))


@pytest.mark.parametrize("n,count", [(40, 15), (40, 40), (12, 35), (7, 1), (5, 11)])
def test_each_source_share_is_exact_and_once_within_an_epoch(n, count):
    for epoch in range(6):
        d = source_draws(n, count, seed=4, epoch=epoch, source=0).tolist()
        assert len(d) == count
        times = Counter(d)
        assert set(times) <= set(range(n))
        # every sample count // n times, count % n of them once more: no repeat beyond that
        full, rest = divmod(count, n)
        expected = {full: n - rest, full + 1: rest}
        assert Counter(times.values()) == {k: v for k, v in expected.items() if k and v}


def test_a_small_share_walks_through_its_source_before_repeating():
    n, share = 40, 15  # a round: ceil(40 / 15) = 3 epochs
    epochs = [source_draws(n, share, seed=1, epoch=e, source=0).tolist() for e in range(6)]
    assert not set(epochs[0]) & set(epochs[1])
    assert set(epochs[0] + epochs[1] + epochs[2]) == set(range(n))
    assert epochs[3][:10] != epochs[0][:10]  # the next round: a new permutation
    assert set(epochs[3] + epochs[4] + epochs[5]) == set(range(n))


def test_sampler_gives_each_source_its_counts_every_epoch():
    mix = Mixture([range(NA), range(NB)], weights=[0.3, 0.7], epoch_size=50)
    assert mix.counts == [15, 35] and len(mix) == NA + NB
    s = PackedSampler(mix, seed=2)
    assert len(s) == 50
    orders = []
    for epoch in range(3):
        s.set_epoch(epoch)
        order = list(s)
        orders.append(order)
        by_source = Counter(source_of(mix, i) for i in order)
        assert by_source == {0: 15, 1: 35}
        a = [i for i in order if i < NA]
        assert len(set(a)) == 15  # a share below the source's size: no repeat
        b = Counter(i for i in order if i >= NA)
        assert sorted(Counter(b.values()).items()) == [(2, 1), (3, 11)]  # 35 = 2 x 12 + 11
    assert orders[0] != orders[1] != orders[2]


def test_default_weights_read_every_sample_once_per_epoch():
    mix = Mixture([range(NA), range(NB)])
    assert mix.epoch_size == NA + NB and mix.counts == [NA, NB]
    assert sorted(PackedSampler(mix, seed=0)) == list(range(NA + NB))
    assert list(PackedSampler(mix, shuffle=False)) == list(range(NA + NB))


def test_order_is_seeded_and_the_same_on_every_machine():
    mix = Mixture([range(5), range(3)], weights=[1, 1], epoch_size=6)
    assert torch.equal(mix.epoch_order(7, 1), mix.epoch_order(7, 1))
    assert not torch.equal(mix.epoch_order(7, 1), mix.epoch_order(8, 1))
    assert not torch.equal(mix.epoch_order(7, 1), mix.epoch_order(7, 2))
    # Golden values: if these change, every saved mixture checkpoint resumes in another order.
    assert mix.epoch_order(0, 0).tolist() == GOLDEN


GOLDEN = [1, 6, 2, 0, 7, 5]


# -- DDP, resume, elastic resume --------------------------------------------------------------

@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ddp_ranks_cover_the_epoch_exactly_once(world, drop_last):
    mix = Mixture([range(NA), range(NB)], weights=[2, 1], epoch_size=47)
    epoch = mix.epoch_order(9, 3).tolist()
    parts = []
    for r in range(world):
        s = PackedSampler(mix, seed=9, num_replicas=world, rank=r, drop_last=drop_last)
        s.set_epoch(3)
        parts.append(list(s))
    assert len({len(p) for p in parts}) == 1
    merged = [p[k] for k in range(len(parts[0])) for p in parts]  # global position order
    kept = 47 // world * world if drop_last else 47
    assert merged[:kept] == epoch[:kept]
    assert merged[kept:] == epoch[:len(merged) - kept]  # padding repeats the start


def test_elastic_resume_w2_to_w3_continues_the_same_global_batches():
    mix = Mixture([range(NA), range(NB)], weights=[0.6, 0.4], epoch_size=60)
    global_batch, steps = 6, 4

    def global_steps(world, state=None):
        batches = []
        for r in range(world):
            s = PackedSampler(mix, seed=5, num_replicas=world, rank=r)
            if state:
                s.load_state_dict(state)
            batches.append(list(DataLoader(mix, batch_size=global_batch // world, sampler=s)))
        return [sorted(i for b in batches for i in b[t].tolist()) for t in range(len(batches[0]))]

    uninterrupted = global_steps(2)
    state = PackedSampler(mix, seed=5).state_dict(consumed=steps * global_batch)
    assert global_steps(3, state) == uninterrupted[steps:]
    assert len(uninterrupted) == 10


def test_resume_mid_epoch_through_make_loader_and_prefetcher_equals_the_uninterrupted_run(roots):
    def feed(state=None):
        mix = uid_mixture(roots, epoch_size=30)
        loader = make_loader(mix, 4, sampler=PackedSampler(mix, seed=11), num_workers=0)
        out = CUDAPrefetcher(loader, device="cpu")
        if state:
            out.load_state_dict(state)
        return out

    full = [uid.tolist() for _, uid in feed()]
    part = feed()
    it = iter(part)
    head = [next(it)[1].tolist() for _ in range(3)]
    state = part.state_dict()
    rest = [uid.tolist() for _, uid in feed(state)]
    assert head + rest == full
    uids = [u for b in full for u in b]
    assert Counter(u >= UID_B for u in uids) == {False: 23, True: 7}  # 3:1 of 30: 22.5 rounds up first
    assert len(set(u for u in uids if u < UID_B)) == 23


# -- each source's samples --------------------------------------------------------------------

def test_each_source_keeps_its_decoder_and_targets(roots, tmp_path):
    for name in ("a", "b"):  # fresh copies: workers open shards the parent never opened
        shutil.copytree(roots / name, tmp_path / name)
    mix = uid_mixture(tmp_path, weights=(1, 1), epoch_size=24)
    loader = make_loader(mix, 6, sampler=PackedSampler(mix, seed=3), num_workers=2)
    seen = 0
    for images, uids in loader:
        assert images.shape[1:] == (3, 16, 16) and images.dtype == torch.uint8
        for image, uid in zip(images, uids.tolist()):
            assert (image.max() == 0) == (uid >= UID_B)  # B's decoder: black; A's: a photo
            seen += 1
    assert seen == 24
    a, b = mix.sources
    assert mix[3][1] == a[3][1] == 3 and mix[NA + 2][1] == b[2][1] == UID_B + 2
    assert mix[-1][1] == UID_B + NB - 1


def test_detection_sources_batch_as_detection(roots):
    det = PackedDataset(roots / "det", decode=DecodeCenterCrop(16))
    mix = Mixture([det, det], weights=[1, 1], epoch_size=10)
    assert mix.task == "detection"
    images, targets = next(iter(make_loader(mix, 5, num_workers=0)))
    assert images.shape == (5, 3, 16, 16) and isinstance(targets, list)
    assert set(targets[0]) == {"boxes", "labels", "image_id"}


def test_aspect_groups_keep_each_batch_to_one_source_shape(roots):
    mix = uid_mixture(roots, weights=(1, 1), epoch_size=32)  # A landscape, B portrait
    s = PackedSampler(mix, seed=1, aspect_groups=0, batch_size=4)
    order = list(s)
    assert Counter(source_of(mix, i) for i in order) == {0: 16, 1: 16}
    assert all(len({source_of(mix, i) for i in order[k:k + 4]}) == 1 for k in range(0, 32, 4))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])])
def test_gpu_decoder_reads_a_mixture(roots, device):
    from packer.gpu import GPUDecoder, GPUOptions, make_gpu_loader
    mix = uid_mixture(roots, epoch_size=12, decode_b=DecodeCenterCrop(16))
    loader = make_gpu_loader(mix, 4, sampler=PackedSampler(mix, seed=0), num_workers=0)
    assert isinstance(mix.sources[0].decode, DecodeCenterCrop)  # the caller's sources kept
    options = GPUOptions(decoder=pil_decoder) if device == "cpu" else None  # PIL for nvJPEG
    feed = GPUDecoder(loader, size=16, device=device, dtype=torch.uint8, options=options)
    batches = [(x, uid.tolist()) for x, uid in feed]
    assert all(x.shape == (4, 3, 16, 16) and x.device.type == device for x, _ in batches)
    uids = [u for _, uid in batches for u in uid]
    assert Counter(u >= UID_B for u in uids) == {False: 9, True: 3}
    state = feed.state_dict()["loader"]["sampler"]  # after the pass: the next one's start
    assert (state["epoch"], state["consumed"]) == (1, 0) and state["mixture"] == mix.layout


# -- what is refused --------------------------------------------------------------------------

def test_mixing_target_kinds_is_refused_with_what_to_do(roots):
    cls = PackedDataset(roots / "a", decode=DecodeCenterCrop(16))
    det = PackedDataset(roots / "det", decode=DecodeCenterCrop(16))
    with pytest.raises(ValueError, match=r"same kind of target.*gives dicts of the fields.*gives "
                                         r"detection targets \(boxes, labels, image_id\)"):
        Mixture([cls, det])
    uid = PackedDataset(roots / "a", decode=DecodeCenterCrop(16), target_fields="uid")
    with pytest.raises(ValueError, match="the field 'uid'.*target_transform="):
        Mixture([uid, det])
    Mixture([uid, PackedDataset(roots / "det", decode=DecodeCenterCrop(16),
                                target_transform=lambda t: t["image_id"])])  # the user's call


def test_bad_arguments_say_what_to_do(roots):
    with pytest.raises(ValueError, match="at least one"):
        Mixture([])
    with pytest.raises(ValueError, match="2 datasets and 1 weights"):
        Mixture([range(3), range(4)], weights=[1])
    for bad in ([0, 0], [-1, 2], [float("nan"), 1]):
        with pytest.raises(ValueError, match="finite, >= 0 and not all 0"):
            Mixture([range(3), range(4)], weights=bad)
    with pytest.raises(ValueError, match="source 1 has no samples"):
        Mixture([range(3), range(0)], weights=[1, 1])
    assert Mixture([range(3), range(0)], weights=[1, 0]).counts == [3, 0]
    with pytest.raises(ValueError, match="epoch_size must be a positive int"):
        Mixture([range(3)], epoch_size=0)
    with pytest.raises(ValueError, match="order='block' does not apply to a Mixture"):
        PackedSampler(Mixture([range(3)]), order="block")
    with pytest.raises(IndexError):
        Mixture([range(3)])[3]
    with pytest.raises(ValueError, match="source 1 is a PackedIterableDataset: use PackedDataset"):
        Mixture([range(3), packer.PackedIterableDataset(roots / "a")])
    a = PackedDataset(roots / "a")  # PIL images: refused before any worker starts
    with pytest.raises(ValueError, match="returns PIL images"):
        make_loader(Mixture([a]), 4, num_workers=0)
    state = PackedSampler(Mixture([range(3)], epoch_size=10)).state_dict()
    with pytest.raises(ValueError, match="10 samples"):
        PackedSampler(Mixture([range(3)], epoch_size=11)).load_state_dict(state)
    state = PackedSampler(Mixture([range(3), range(5)], [1, 1], epoch_size=10)).state_dict()
    assert state["mixture"] == [[3, 5], [5, 5]]
    with pytest.raises(ValueError, match=r"mixture of \[\[3, 5\], \[5, 5\]\].*same sources, weights"):
        PackedSampler(Mixture([range(3), range(5)], [2, 1], epoch_size=10)).load_state_dict(state)
    with pytest.raises(ValueError, match="this one is not a mixture"):
        PackedSampler(range(10)).load_state_dict(state)


def test_a_mixture_inside_a_mixture_is_refused_not_read_uniformly():
    """The outer mixture would draw the inner one's index space uniformly: its weights and
    epoch_size ignored, a source it gave weight 0 read anyway."""
    inner = Mixture([range(4), range(6)], weights=[1, 0], epoch_size=5)
    with pytest.raises(ValueError, match="source 0 is itself a Mixture.*list its sources"):
        Mixture([inner, range(3)])
