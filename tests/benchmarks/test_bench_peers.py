"""``benchlib.peers``: every peer loader reads each stored image exactly once per epoch,
decoded by the same decoder, and the benchmark reports packer against each."""
from __future__ import annotations

import importlib.util
import multiprocessing
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from packer import PackedDataset, build
from benchlib.peers import PACKER, PEERS, bench_peers, peers_table
from packer.transforms.decode import DecodeRandomResizedCrop


def in_child(fn, *args):
    """Run ``fn`` in a forked child: FFCV's numba dispatchers raise KeyError from their
    finalizers whenever they are collected, which in this process would be during some later,
    unrelated test. A forked child ends with ``os._exit``, so they are never collected. (Not
    spawn: FFCV's writer then spawns its own workers, which hang re-importing the test.)"""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(fn, *args).result()


@pytest.fixture(scope="module")
def packed(photo_src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("peers") / "d"
    build(photo_src, dst, progress=False, workers=0)
    return dst


def read_every_image(packed, tmp_path, name):
    module, write, loader = PEERS[name]
    decode = DecodeRandomResizedCrop(32)
    ds = PackedDataset(packed, decode=decode)
    items = [(ds.load(i)["image"], int(ds.target(i))) for i in range(len(ds))]
    state = write(items, tmp_path, 2)
    labels, images = Counter(), 0
    for x, y in loader(state, decode, 8, 2):
        assert x.dtype == torch.uint8 and tuple(x.shape[1:]) == (3, 32, 32)
        labels.update(int(v) for v in y)
        images += len(x)
    assert images == len(ds)
    assert labels == Counter(int(ds.target(i)) for i in range(len(ds)))


@pytest.mark.parametrize("name", list(PEERS))
def test_each_peer_reads_every_image_once(packed, tmp_path, name):
    if importlib.util.find_spec(PEERS[name][0]) is None:  # not imported here: see in_child
        pytest.skip(f"{PEERS[name][0]} is not installed")
    in_child(read_every_image, packed, tmp_path, name)


def bench_logged(packed, tmp_path):
    lines = []
    res = bench_peers(packed, tmp_path, workers=2, batch_size=8, rounds=1, size=32,
                      log=lines.append)
    return res, lines


def test_bench_peers_rows_and_table(packed, tmp_path):
    res, lines = in_child(bench_logged, packed, tmp_path)
    assert list(res["rows"])[0] == PACKER
    assert set(res["rows"]) | set(res["skipped"]) == {PACKER, *PEERS}
    assert all(len(v) == 1 and v[0] > 0 for v in res["rows"].values())
    table = peers_table(res)
    assert "| packer: PackedDataset + make_loader |" in table and "1.00x |" in table
    for name, reason in res["skipped"].items():
        assert f"| {name} | skipped: {reason}" in table
    assert lines[0].startswith("round 1/1: packer")
