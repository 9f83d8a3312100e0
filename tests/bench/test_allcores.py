"""``packer.bench.allcores``: the loop runs in one separate process per share, all at once."""
import os
import time

import pytest

from packer.bench.allcores import median_rate_on_all_cores, rates_on_all_cores


def test_each_share_runs_in_its_own_process_at_the_same_time():
    start = time.monotonic()

    def fn(share):
        time.sleep(0.5)  # concurrent: the whole call takes ~0.5 s, not 1.5 s
        return float(os.getpid() * 1000 + sum(share))

    out = rates_on_all_cores(fn, [[1], [2], [3]])
    assert time.monotonic() - start < 1.4
    pids = {int(v // 1000) for v in out}
    assert [int(v % 1000) for v in out] == [1, 2, 3]
    assert len(pids) == 3 and os.getpid() not in pids


def test_median_over_interleaved_shares():
    assert median_rate_on_all_cores(lambda share: float(len(share)), list(range(10)), 3) == 3.0


def test_a_failing_loop_is_an_error():
    def fn(share):
        raise ValueError("broken")
    with pytest.raises(RuntimeError, match="2 of 2 measuring processes failed"):
        rates_on_all_cores(fn, [[1], [2]])
