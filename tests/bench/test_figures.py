"""The windows and counts behind ``packer bench``'s figures (the figures themselves, end to end:
tests/test_bench_figures.py)."""
import time

import torch
from torch.utils.data import Dataset

from packer.bench.epochs import loader_batch_time
from packer.bench.phases import figure_plan


class Sleepy(Dataset):
    """Each sample takes ``delay`` seconds: a known rate for a worker."""

    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.zeros(3, 2, 2, dtype=torch.uint8), i


def test_loader_batch_time_leaves_out_the_first_wave():
    """2 workers, batches of 4 samples of 20 ms: a batch every 40 ms once both run. With two
    batches per worker (what figure_plan gives), the second batch of the first wave arrives
    with the first: counting it in the window would make the loader look 1.5x faster than
    it is, and the epoch-boundary figure's stand-in step too short for it."""
    t = loader_batch_time(Sleepy(16, 0.02), 4, 2)
    assert 0.034 < t < 0.06, t


def test_figure_plan_gives_no_worker_nothing_to_do():
    """More workers than images: the empty workers' rate (0) went into the median of "one
    core's rate with all busy" (halved it on 2 cores; 0, a ZeroDivisionError, on 16)."""
    for cores, images in ((2, 1), (16, 4), (16, 9)):
        got, workers, batch = figure_plan(100, images, None, [cores], 64, cores)
        assert (got, workers, batch) == (images, images, 1)
    assert figure_plan(3, 500, None, [2], 64, 2) == (3, 2, 1)  # as many as the cores allow
