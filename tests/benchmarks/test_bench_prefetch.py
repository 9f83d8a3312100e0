"""``benchlib.prefetch`` (``benchmarks/bench_prefetch.py``) on the CPU with the tiny model:
every feeding mode from synthetic batches and from a packed dataset, and the table."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packer import build
from benchlib.prefetch import MODES, PrefetchOptions, Source, bench_prefetch, check_modes, prefetch_table, synthetic
from packer.demo import make_image_folder
from packer.loading.prefetch import IMAGENET_MEAN, IMAGENET_STD, normalize_affine

REPO = Path(__file__).resolve().parents[2]
QUICK = dict(model="tiny", batch=4, size=32, steps=2, repeats=1, warmup=1, pool=2, device="cpu")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_prefetch")
    src = make_image_folder(tmp / "src", images=40, classes=4)
    build(src, tmp / "packed", workers=0, progress=False)
    return tmp / "packed"


def test_check_modes():
    assert check_modes("plain,,prefetcher") == ["plain", "prefetcher"]
    with pytest.raises(ValueError, match="unknown mode 'bogus'"):
        check_modes("plain,bogus")


def test_synthetic_batches_are_channels_last_uint8():
    (x, y), = synthetic(1, 3, 8)
    assert x.shape == (3, 3, 8, 8) and x.dtype == torch.uint8
    assert x.is_contiguous(memory_format=torch.channels_last) and y.shape == (3,)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_normalized_float_batches(mode, packed):
    scale, shift = normalize_affine(IMAGENET_MEAN, IMAGENET_STD)
    for opts in (PrefetchOptions(**QUICK), PrefetchOptions(**QUICK, dataset=str(packed), workers=0)):
        x, y = Source(mode, opts, torch.device("cpu"), scale, shift).next()
        assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (4,)
        assert -3 < float(x.min()) and float(x.max()) < 3  # normalized, not 0..255


def test_bench_prefetch_synthetic():
    lines = []
    res = bench_prefetch(PrefetchOptions(**QUICK), log=lines.append)
    assert list(res) == list(MODES)  # resident first
    for mode, (step_s, wait_s) in res.items():
        assert step_s > 0 and wait_s >= 0, mode
    assert lines[0].startswith("# tiny, batch 4, 32px, bf16 autocast") and "pre-made CPU tensors" in lines[0]
    table = prefetch_table(res, 4).splitlines()
    assert table[0].startswith("| mode | images/s | step ms | data wait ms/step | starvation |")
    assert [row.split(" | ")[0] for row in table[2:]] == [f"| {m}" for m in MODES]
    assert "| 0.0 | 0.0% |" in table[2]  # resident: no wait by definition


def test_bench_prefetch_from_a_dataset(packed):
    opts = PrefetchOptions(**dict(QUICK, modes=("plain", "prefetcher")), dataset=str(packed), workers=0)
    lines = []
    res = bench_prefetch(opts, log=lines.append)
    assert list(res) == ["resident", "plain", "prefetcher"]
    assert f"PackedDataset {packed}" in lines[0]


def test_script_help_and_bad_mode():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    script = str(REPO / "benchmarks" / "bench_prefetch.py")
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--modes" in proc.stdout and "--dataset" in proc.stdout
    proc = subprocess.run([sys.executable, script, "--modes", "bogus"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "unknown mode 'bogus'" in proc.stderr
