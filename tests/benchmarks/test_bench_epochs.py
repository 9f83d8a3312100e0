"""The epoch-boundary benchmark (benchlib.figures) runs and reports both loaders."""
from __future__ import annotations

import pytest
import torch

from packer import PackedDataset, build
from packer.bench.epochs import VARIANTS, one_run
from benchlib.figures import CudaStep, bench_epochs, epochs_table
from packer.transforms.decode import DecodeRandomResizedCrop


def test_bench_epochs_dry_run(photo_src, tmp_path):
    dst = tmp_path / "d"
    build(photo_src, dst, progress=False, workers=0)
    lines = []
    res = bench_epochs(dst, batch_size=8, workers=2, epochs=2, rounds=1, size=64,
                       log=lines.append)
    assert set(res) == set(VARIANTS) and all(len(r) == 1 for r in res.values())
    for runs in res.values():
        run = runs[0]
        assert len(run.first_waits) == 2 and run.images == 2 * 48 and 0 < run.kept <= 1.0
        assert len(run.waits) == 2 * (48 // 8 - 1)
    table = epochs_table(res)
    assert all(name in table for name in VARIANTS) and "stand-in step" in lines[0]
    assert "in-epoch wait, median / mean ms" in table and "start / in-epoch" in table


def test_a_real_training_step_fed_across_epochs(photo_src, tmp_path):
    """CudaStep trains a model on each batch through CUDAPrefetcher (here the CPU stands in for
    the GPU) and counts each batch's ideal time from the resident-batch calibration."""
    dst = tmp_path / "d"
    build(photo_src, dst, progress=False, workers=0)
    ds = PackedDataset(dst, decode=DecodeRandomResizedCrop(32))
    step = CudaStep("tiny", batch_size=8, size=32, device="cpu")
    assert step.calibrate(steps=2) > 0
    before = [p.detach().clone() for p in step.step.net.parameters()]
    run = one_run(ds, True, batch_size=8, workers=2, epochs=2, step=step)
    assert run.images == 2 * 48 and len(run.first_waits) == 2
    assert abs(run.steps - 2 * 48 / 8 * step.seconds) < 1e-9 and run.kept > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, step.step.net.parameters()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_resnet_step_on_the_gpu_across_epochs(photo_src, tmp_path):
    dst = tmp_path / "d"
    build(photo_src, dst, progress=False, workers=0)
    res = bench_epochs(dst, batch_size=16, workers=2, epochs=2, rounds=1, size=64,
                       cuda_model="resnet50", log=lambda s: None)
    assert all(0 < runs[0].kept <= 1.05 for runs in res.values())
