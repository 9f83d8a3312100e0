"""Many machines: the Ray build and DDP reads, each shown for real:
ranks as torchrun starts them (gloo), the packer CLI with Ray, torchdata's StatefulDataLoader."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import packer_cmd, packer_env
from packer.demo import make_image_folder
from packer.errors import PackerError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- PackedSampler under torchrun, before init_process_group ----------------------------------

RANK_SCRIPT = textwrap.dedent("""
    import json, torch.distributed as dist
    from packer.reading.sampler import PackedSampler
    out = {}
    try:  # made before the process group, as torchrun started it
        out["early"] = list(PackedSampler(range(10), seed=1))
    except ValueError as e:
        out["early"] = str(e)
    dist.init_process_group("gloo")
    s = PackedSampler(range(10), seed=1)
    out["world"], out["samples"] = [s.num_replicas, s.rank], list(s)
    dist.destroy_process_group()
    print(json.dumps(out))
""")


def test_a_sampler_made_before_init_process_group_under_torchrun_is_refused(tmp_path):
    """Two ranks as torchrun starts them (RANK, WORLD_SIZE...): a PackedSampler made before
    ``init_process_group`` took (1, 0) and gave every rank the whole dataset (each sample
    twice an epoch, silently); DistributedSampler refuses, and so does it now, saying what to
    do. After the init the ranks split the epoch exactly."""
    port, script = free_port(), tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    procs = []
    for rank in range(2):
        env = dict(packer_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for o in outs:
        assert isinstance(o["early"], str), f"every rank read {o['early']}"
        assert "init_process_group() before making the sampler" in o["early"]
    assert [o["world"] for o in outs] == [[2, 0], [2, 1]]
    assert sorted(outs[0]["samples"] + outs[1]["samples"]) == list(range(10))


def test_num_replicas_without_rank_is_refused_outside_a_process_group():
    from packer.reading.sampler import PackedSampler
    with pytest.raises(ValueError, match=r"4 ranks \(num_replicas\).*pass both"):
        PackedSampler(range(10), num_replicas=4)
    assert (PackedSampler(range(10), num_replicas=1).num_replicas,
            PackedSampler(range(10), num_replicas=4, rank=3).rank) == (1, 3)


# -- packer build --ray at an address nothing answers at -----------------------------------------

def test_ray_build_at_an_unreachable_address_is_one_line_at_once(tmp_path):
    """RAY_ADDRESS naming a port nothing listens on (a head not started yet, a typo): Ray's
    client retried for ever, printing log lines (over 200 s here, never ending); now one
    error line naming what to do, in seconds, before DST is made."""
    pytest.importorskip("ray")
    src = make_image_folder(tmp_path / "src", images=4, classes=2)
    address = f"127.0.0.1:{free_port()}"
    env = dict(packer_env(), RAY_ADDRESS=address)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(packer_cmd("build", src, tmp_path / "dst", "--ray"), env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"packer build --ray with RAY_ADDRESS={address} still waiting after 60 s")
    assert proc.returncode == 1 and time.monotonic() - t0 < 60
    assert proc.stderr.startswith(f"Error: no Ray cluster answers at {address} (from "
                                  f"RAY_ADDRESS: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "ray start --head" in proc.stderr and not (tmp_path / "dst").exists()
    from packer.writing.ray_engine import RayEngine
    with pytest.raises(PackerError, match=r"no Ray cluster answers at ray://127\.0\.0\.1:\d+ "
                                          r"\(from address="):
        RayEngine(address="ray://" + address)
    for bad in (-1, True, 1.5):  # Ray reads -1 as retrying a crashing shard for ever
        with pytest.raises(PackerError, match=r"max_retries=\.\.\.\) must be a count >= 0"):
            RayEngine(address="ray://" + address, max_retries=bad)


# -- StatefulDataLoader: a checkpoint at an epoch's end, resumed in the usual set_epoch loop ----

@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_checkpoint_at_an_epochs_end_resumes_the_next_epoch(workers):
    """Epoch 0 ends, the loader's state is saved, the job restarts and runs ``for epoch in
    range(1, 3): sampler.set_epoch(epoch)``. StatefulDataLoader loads the sampler's state only
    at ``iter()``, after that set_epoch: the state (epoch 0, all consumed) put the sampler back
    in epoch 0, so epoch 1 came out empty (workers=0) or as epoch 0's order again (workers=2),
    where DistributedSampler gives epoch 1. Each rank must see epoch 1's own samples."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    from packer.reading.sampler import PackedSampler
    n, w, bs = 22, 2, 4

    def run(r, state=None, epochs=(0, 1, 2)):
        s = PackedSampler(range(n), num_replicas=w, rank=r, seed=9)
        dl = sdl.StatefulDataLoader(range(n), batch_size=bs, sampler=s, num_workers=workers)
        if state is not None:
            dl.load_state_dict(state)
        out = []
        for epoch in epochs:
            s.set_epoch(epoch)
            out.append([i for b in dl for i in b.tolist()])
        return out, dl.state_dict()

    whole = [run(r)[0] for r in range(w)]
    first = [run(r, epochs=(0,)) for r in range(w)]
    for r in range(w):
        rest, _ = run(r, first[0][1], epochs=(1, 2))  # rank 0's state restores every rank
        assert rest == whole[r][1:], f"rank {r}: epoch 1 was {rest[0]}, not {whole[r][1]}"
    assert sorted(i for r in range(w) for i in whole[r][1]) == sorted(list(range(n)))
    # Saved at epoch 0's last step and resumed at epoch 0 (the loop restarts at the
    # checkpoint's epoch): still nothing twice, then epoch 1
    s = PackedSampler(range(n), num_replicas=w, rank=0, seed=9)
    dl = sdl.StatefulDataLoader(range(n), batch_size=bs, sampler=s, num_workers=workers)
    it = iter(dl)
    for _ in range(len(dl)):
        next(it)
    state = dl.state_dict()
    del it
    assert run(0, state, epochs=(0, 1))[0] == [[], whole[0][1]]


def test_a_ray_build_s_stop_file_is_seen_by_every_task_within_its_look_interval(tmp_path):
    """Ray tasks stop through a file in DST (``ray.cancel`` racing a task's reply can abort
    the driver): unset until the file exists, then set for good; looked at no more than
    every ``every`` seconds; ``set`` (a task failing a strict build) creates it, and says
    False where it cannot."""
    from packer.writing.ray_engine import StopFile
    path = tmp_path / ".shard-stop"
    slow, fresh = StopFile(path, every=3600), StopFile(path, every=0.0)
    assert not slow.is_set() and not fresh.is_set()
    assert fresh.set() is True
    assert path.exists() and fresh.is_set()
    assert not slow.is_set()  # not looked at again within the hour
    late = StopFile(path, every=3600)
    assert late.is_set()  # a task's first look
    path.unlink()
    assert late.is_set() and fresh.is_set()  # once seen, stopped
    assert StopFile(tmp_path / "gone" / ".shard-stop").set() is False
