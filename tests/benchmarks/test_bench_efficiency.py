"""The loader-efficiency benchmark (benchlib.figures) runs and reports its ratio."""
from __future__ import annotations

from packer import build
from benchlib.figures import bench_efficiency, efficiency_table


def test_bench_efficiency_dry_run(photo_src, tmp_path):
    dst = tmp_path / "d"
    build(photo_src, dst, progress=False, workers=0)
    lines = []
    res = bench_efficiency(dst, workers=2, batch_size=8, samples=48, rounds=1, size=64,
                           log=lines.append)
    assert all(len(v) == 1 and v[0] > 0 for v in res.values())
    assert abs(res["efficiency"][0] - res["loader"][0] / (2 * res["core"][0])) < 1e-9
    assert abs(res["efficiency_loaded"][0] - res["loader"][0] / (2 * res["core_loaded"][0])) < 1e-9
    assert "efficiency = loader / (2 x one core)" in efficiency_table(res, 2)
    assert "efficiency vs all cores busy" in efficiency_table(res, 2)
    assert abs(res["in_order_gain"][0] - res["loader"][0] / res["in_order"][0]) < 1e-9
    assert "batches to the workers in turn" in efficiency_table(res, 2)
    assert 0 < res["loader_main_cores"][0] < 2 and "main-process CPU" in efficiency_table(res, 2)
    assert lines[0].startswith("round 1/1: one core")


def test_one_core_rate_runs_on_one_torch_thread():
    """As a DataLoader worker does: a torch resize inside ``ds[i]`` must not fan out."""
    import torch
    from packer.bench.efficiency import one_core_rate
    seen = []

    class Probe:
        def __getitem__(self, i):
            seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert one_core_rate(Probe(), [0, 1, 2]) > 0
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
