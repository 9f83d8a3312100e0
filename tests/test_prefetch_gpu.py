"""CUDAPrefetcher on a GPU: numerics against the CPU path, pinned uint8 batches from
make_loader, and the two cross-stream races it must prevent (each shown to be caught by
running the same scenario against a deliberately broken variant)."""
import itertools

import pytest
import torch

from packer.loading.loader import make_loader
from packer.loading.prefetch import CUDAPrefetcher, iter_tensors, record_uses

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep: ~50-70 ms at H100/H200 clocks


def _batches(n, shape=(16, 3, 64, 48), seed=0, pinned=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        nn, c, h, w = shape
        x = torch.randint(0, 256, (nn, h, w, c), dtype=torch.uint8, generator=g).permute(0, 3, 1, 2)
        y = torch.randint(0, 1000, (nn,), generator=g)
        out.append((x.pin_memory(), y.pin_memory()) if pinned else (x, y))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [True, False])
def test_gpu_output_equals_cpu_reference(dtype, channels_last):
    batches = _batches(4)
    gpu = CUDAPrefetcher(batches, dtype=dtype, channels_last=channels_last)
    cpu = CUDAPrefetcher(batches, dtype=dtype, channels_last=channels_last, device="cpu")
    assert gpu.device.type == "cuda" and gpu.stream is not None
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for epoch in range(2):
        got = list(gpu)
        assert len(got) == 4
        for (gx, gy), (cx, cy) in zip(got, cpu):
            assert gx.is_cuda and gy.is_cuda and gx.dtype == dtype
            assert gx.is_contiguous(memory_format=fmt)
            tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
            torch.testing.assert_close(gx.cpu(), cx, **tol)
            assert torch.equal(gy.cpu(), cy)


def test_one_side_stream_for_life():
    pf = CUDAPrefetcher(_batches(2))
    stream = pf.stream
    for _ in range(3):
        assert len(list(pf)) == 2 and pf.stream is stream


def test_unpinned_batches_work_with_a_warning():
    batches = _batches(2, pinned=False)
    with pytest.warns(UserWarning, match="pageable"):
        got = list(CUDAPrefetcher(batches))
    ref = list(CUDAPrefetcher(batches, device="cpu"))
    for (gx, _), (cx, _) in zip(got, ref):
        torch.testing.assert_close(gx.cpu(), cx, rtol=1e-6, atol=1e-6)


def test_packed_dataset_through_make_loader(tmp_path):
    from packer import build
    from packer.reading.dataset import PackedDataset
    from packer.demo import make_image_folder
    from packer.transforms.decode import DecodeCenterCrop

    make_image_folder(tmp_path / "src", images=24, classes=3)
    build(tmp_path / "src", tmp_path / "packed", workers=0, progress=False)
    ds = PackedDataset(tmp_path / "packed", decode=DecodeCenterCrop(64))
    loader = make_loader(ds, 8, shuffle=False, num_workers=2)
    assert loader.pin_memory
    x, _ = next(iter(loader))
    assert x.is_pinned() and x.is_contiguous(memory_format=torch.channels_last)
    pf = CUDAPrefetcher(loader, dtype=torch.bfloat16)
    cpu = CUDAPrefetcher(make_loader(ds, 8, shuffle=False, num_workers=0, pin_memory=False),
                         dtype=torch.bfloat16, device="cpu")
    for _ in range(2):
        n = 0
        for (gx, gy), (cx, cy) in zip(pf, cpu):
            assert gx.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(gx.cpu(), cx)
            assert torch.equal(gy.cpu(), cy)
            n += 1
        assert n == len(pf) == 3


# -- the races ---------------------------------------------------------------------------------

class NoWait(CUDAPrefetcher):
    """Broken on purpose: the consumer stream does not wait for the copy."""

    def _handoff(self, batch, stream):
        for t in iter_tensors(batch):
            t.record_stream(stream)


class NoRecordStream(CUDAPrefetcher):
    """Broken on purpose: a handed-out batch's memory can go to the next copy while the
    consumer stream still has kernels queued that read it."""

    def _handoff(self, batch, stream):
        stream.wait_stream(self.stream)


_values = itertools.count(1)


def _filled(n, shape=(32, 3, 256, 256)):
    """Pinned uint8 batches, each one value (fresh values per call: stale memory never matches)."""
    vals = [(next(_values) * 37) % 251 + 1 for _ in range(n)]
    return vals, [(torch.full(shape, v, dtype=torch.uint8).pin_memory(), torch.zeros(shape[0]))
                  for v in vals]


def _wrong(x, v):
    """Elements of x (= batch / 255) not equal to v, counted on the current stream, now."""
    return (torch.round(x * 255) != v).sum()


def read_at_once(cls) -> int:
    """The consumer reads each batch as soon as it has it, while the copy may be in flight
    (made certain here by a long kernel queued on the side stream ahead of the copies)."""
    vals, batches = _filled(4)
    pf = cls(batches, mean=None, std=None)
    with torch.cuda.stream(pf.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    wrong = [_wrong(x, v) for (x, _), v in zip(pf, vals)]
    torch.cuda.synchronize()
    return int(sum(w.item() for w in wrong))


def free_while_in_use(cls) -> int:
    """A long kernel on the consumer stream (the training step) delays its reads of a batch;
    the batch is dropped meanwhile and the next copy lands while those reads are pending."""
    vals, batches = _filled(5)
    pf = cls(batches, mean=None, std=None)
    it = iter(pf)
    wrong = []
    x, _ = next(it)
    for i in range(1, len(vals)):
        torch.cuda._sleep(SLEEP_CYCLES)  # "the step", on the consumer stream
        wrong.append(_wrong(x, vals[i - 1]))  # queued behind it
        del x  # freed while the consumer stream has yet to read it
        x, _ = next(it)  # hands out batch i, starts copying batch i + 1
    wrong.append(_wrong(x, vals[-1]))
    torch.cuda.synchronize()
    return int(sum(w.item() for w in wrong))


def test_batches_made_on_the_gpu_are_waited_for():
    """Inputs written on the consumer stream (late, behind a long kernel) must be complete
    before the side stream normalizes them."""
    vals = [(next(_values) * 37) % 251 + 1 for _ in range(3)]

    def made_on_gpu():
        for v in vals:
            torch.cuda._sleep(SLEEP_CYCLES)
            yield torch.full((8, 3, 128, 128), v, dtype=torch.uint8, device="cuda"), v

    pf = CUDAPrefetcher(made_on_gpu(), mean=None, std=None)
    wrong = [_wrong(x, v) for x, v in pf]
    torch.cuda.synchronize()
    assert len(wrong) == 3 and sum(w.item() for w in wrong) == 0


@pytest.mark.parametrize("scenario", [read_at_once, free_while_in_use])
def test_no_cross_stream_race(scenario):
    assert scenario(CUDAPrefetcher) == 0


@pytest.mark.parametrize("scenario, broken", [(read_at_once, NoWait),
                                              (free_while_in_use, NoRecordStream)])
def test_race_scenarios_catch_broken_variants(scenario, broken):
    """The scenarios above are only evidence if they fail without the safeguard."""
    assert scenario(broken) > 0


def test_a_batch_that_raised_raises_in_its_turn_on_the_gpu_too():
    from test_prefetch import batch_errors_in_turn
    want = [[0, 1], [2, 3], "KeyError", [6, 7], [8, 9]]
    assert batch_errors_in_turn("cuda") == ([want, want], 2)


def test_record_uses_holds_each_storage_of_a_batch_until_the_stream_passes_it():
    """Views of one storage (a detection batch's per-image targets) and a tensor of its own,
    tv_tensors among them: none of their memory is handed out again while the stream they
    were recorded on has work queued; without the recording it is at once."""
    tv_tensors = pytest.importorskip("torchvision.tv_tensors")
    side = torch.cuda.Stream()

    def freed_then_reused(record: bool) -> bool:
        torch.cuda.empty_cache()  # no other cached block of the size to hand out
        base = torch.zeros(1 << 20, device="cuda")
        own = torch.zeros(1 << 20, device="cuda")
        views = [tv_tensors.BoundingBoxes(v.view(-1, 4), format="XYXY", canvas_size=(8, 8))
                 for v in base.split(1 << 18)]
        batch = ([{"boxes": b, "labels": own} for b in views], own)
        ptrs = {base.data_ptr(), own.data_ptr()}
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
        if record:
            record_uses(batch, side)
        del base, own, views, batch
        again = [torch.zeros(1 << 20, device="cuda") for _ in range(2)]
        reused = bool(ptrs & {t.data_ptr() for t in again})
        side.synchronize()
        return reused

    assert freed_then_reused(record=False)  # the scenario shows reuse without it
    assert not freed_then_reused(record=True)
