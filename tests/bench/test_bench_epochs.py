"""The epoch-boundary benchmark (packer.bench.epochs) runs and reports both loaders."""
from __future__ import annotations

from packer import build
from packer.bench.epochs import VARIANTS, bench_epochs, epochs_table


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
    table = epochs_table(res)
    assert all(name in table for name in VARIANTS) and "stand-in step" in lines[0]
