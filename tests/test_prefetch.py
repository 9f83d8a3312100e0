"""CUDAPrefetcher on the CPU (its pass-through mode), so it is tested in CI; the GPU side is in
test_prefetch_gpu.py."""
from collections import namedtuple

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from packer.loading.loader import make_loader
from packer.loading.prefetch import IMAGENET_MEAN, IMAGENET_STD, CUDAPrefetcher

# On a GPU machine these run through CUDA, fed from pageable memory on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:CUDAPrefetcher got a batch in pageable memory")

Pair = namedtuple("Pair", "image label")


def _batch(n=4, h=6, w=5, seed=0, channels_last=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=g).permute(0, 3, 1, 2)
    x = x if channels_last else x.contiguous()
    return x, torch.arange(n)


def reference(x, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """The float64 truth: torchvision's ToTensor + Normalize."""
    m = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
    return (x.double() / 255 - m) / s


class Images(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return _batch(1, 8, 8, seed=i)[0][0], i


# -- numerics ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 2e-6),
                                        (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("input_channels_last", [True, False])
def test_numerics_against_float64(dtype, tol, channels_last, input_channels_last):
    x, y = _batch(8, 16, 12, channels_last=input_channels_last)
    x[0, :, 0, 0], x[0, :, 0, 1] = 0, 255  # the extremes
    pf = CUDAPrefetcher([(x, y)], dtype=dtype, channels_last=channels_last)
    (out, labels), = list(pf)
    assert pf.device == torch.device("cpu") or torch.cuda.is_available()
    assert out.dtype == dtype and out.shape == x.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)
    ref = reference(x)
    err = (out.double().cpu() - ref).abs() / ref.abs().clamp(min=1)
    assert err.max().item() < tol
    assert torch.equal(labels.cpu(), y)


def test_custom_and_no_normalization():
    x, y = _batch()
    (out, _), = list(CUDAPrefetcher([(x, y)], mean=(0.5,), std=(0.25,), device="cpu"))
    torch.testing.assert_close(out, reference(x, (0.5,) * 3, (0.25,) * 3).float())
    (out, _), = list(CUDAPrefetcher([(x, y)], mean=None, std=None, device="cpu"))
    torch.testing.assert_close(out, (x.double() / 255).float())


# -- structure ---------------------------------------------------------------------------------

def test_nested_batches_keep_their_shape():
    x, y = _batch()
    mask = torch.zeros(4, 6, 5, dtype=torch.uint8)  # uint8 but not 4-D: not an image
    batch = {"views": [x, x], "pair": Pair(x, y), "mask": mask, "name": "b0", "k": 3}
    out, = list(CUDAPrefetcher([batch], device="cpu"))
    assert set(out) == set(batch) and isinstance(out["views"], list)
    assert isinstance(out["pair"], Pair)
    for img in (*out["views"], out["pair"].image):
        assert img.dtype == torch.float32
        torch.testing.assert_close(img, reference(x).float())
    assert out["pair"].label is y or torch.equal(out["pair"].label, y)
    assert out["mask"].dtype == torch.uint8 and out["name"] == "b0" and out["k"] == 3


def test_iterator_protocol_over_two_epochs():
    batches = [_batch(seed=s) for s in range(3)]
    pf = CUDAPrefetcher(batches, device="cpu")
    assert len(pf) == 3
    for _ in range(2):
        it = iter(pf)
        got = [next(it) for _ in range(3)]
        with pytest.raises(StopIteration):
            next(it)
        for (x, y), (ox, oy) in zip(batches, got):
            torch.testing.assert_close(ox, reference(x).float())
            assert torch.equal(oy, y)
    assert [len(list(pf)) for _ in range(2)] == [3, 3]


def test_loader_attributes_pass_through_and_set_epoch():
    ds = Images()
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = make_loader(ds, 2, sampler=sampler, num_workers=0, pin_memory=False)
    pf = CUDAPrefetcher(loader)
    assert pf.dataset is ds and pf.sampler is sampler and pf.batch_sampler is loader.batch_sampler
    assert len(pf) == len(loader) == 3
    orders = []
    for epoch in range(3):
        pf.set_epoch(epoch)
        assert sampler.epoch == epoch
        orders.append(torch.cat([y for _, y in pf]).tolist())
    assert orders[0] != orders[1] or orders[1] != orders[2]
    for x, _ in pf:
        assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)


def test_set_epoch_reaches_a_custom_batch_sampler():
    class BatchSampler:
        epoch = None

        def __iter__(self):
            return iter([[0, 1]])

        def __len__(self):
            return 1

        def set_epoch(self, e):
            self.epoch = e

    bs = BatchSampler()
    pf = CUDAPrefetcher(make_loader(Images(), None, batch_sampler=bs, num_workers=0))
    pf.set_epoch(7)
    assert bs.epoch == 7


def test_any_iterable_and_errors_propagate():
    def gen():
        yield _batch()
        raise RuntimeError("loader broke")

    pf = CUDAPrefetcher(gen(), device="cpu")
    it = iter(pf)
    next(it)
    with pytest.raises(RuntimeError, match="loader broke"):
        next(it)
    with pytest.raises(TypeError):
        len(pf)
    it = iter(CUDAPrefetcher([_batch(), _batch()], device="cpu"))
    next(it)
    it.close()  # as a generator's: the pass ends
    with pytest.raises(StopIteration):
        next(it)



class OneBad(Images):
    def __getitem__(self, i):
        if i == 5:
            raise KeyError("sample 5 cannot be read")
        return super().__getitem__(i)


def batch_errors_in_turn(device):
    """Per pass: the labels handed out and "KeyError" where a batch raised."""
    loader = make_loader(OneBad(), 2, shuffle=False, num_workers=0, pin_memory=False)
    pf, passes = CUDAPrefetcher(loader, device=device), []
    for _ in range(2):
        it, seen = iter(pf), []
        while True:
            try:
                seen.append(next(it)[1].tolist())
            except StopIteration:
                break
            except KeyError:
                seen.append("KeyError")
        passes.append(seen)
    return passes, loader.sampler.epoch


def test_a_batch_that_raised_raises_in_its_turn_and_the_pass_goes_on():
    # the pass ended at the error (and the next one replayed the epoch); on CUDA the batch
    # before it was lost too (tests/test_prefetch_gpu.py)
    want = [[0, 1], [2, 3], "KeyError", [6, 7], [8, 9]]
    assert batch_errors_in_turn("cpu") == ([want, want], 2)

# -- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": torch.int32}, "dtype"),
    ({"mean": (0.5,) * 3, "std": None}, "both"),
    ({"mean": (124.0, 116.0, 104.0), "std": (58.0, 57.0, 57.0)}, "0..1 scale"),
    ({"mean": (0.5, 0.5), "std": (0.2, 0.2, 0.2)}, "one value per channel"),
    ({"std": (0.2, 0.0, 0.2)}, "positive"),
    ({"device": "mps"}, "CUDA device or the CPU"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CUDAPrefetcher([], **kwargs)


def test_channel_mismatch():
    x = torch.zeros(2, 1, 4, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1 channels"):
        list(CUDAPrefetcher([(x, 0)], device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(ValueError, match="device=None"):
        CUDAPrefetcher([], device="cuda")
