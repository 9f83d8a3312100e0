"""Exactly-once resume through the whole pipeline: a training loop in a real second process,
fed by ``make_loader`` over a ``PackedSampler`` + ``CUDAPrefetcher`` (on the CPU here), is killed with
SIGKILL at random steps and restarted from its last checkpoint, until the epoch ends; the
samples the checkpoints say were consumed must then be the dataset exactly once — with one
rank and with two (gloo). The GPU path (``GPUDecoder``) runs the same check on a CUDA machine.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from packer import write
from packer.demo.images import load_photos, make_image

from helpers import cuda

N = 64

LOOP = textwrap.dedent('''
    import os, sys, json, torch
    from pathlib import Path
    import packer
    root, ckpt, device = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    gpu = device == "gpu"
    if gpu:
        from packer.gpu import EncodedImage
    decode = EncodedImage() if gpu else packer.DecodeCenterCrop(32)
    ds = packer.PackedDataset(root, decode=decode, target_fields="uid")
    sampler = packer.PackedSampler(ds, seed=7, num_replicas=world, rank=rank)
    if gpu:
        loader = packer.gpu.make_gpu_loader(ds, 4, sampler=sampler, num_workers=2)
        feed = packer.GPUDecoder(loader, size=32)
    else:
        loader = packer.make_loader(ds, 4, sampler=sampler, num_workers=2)
        feed = packer.CUDAPrefetcher(loader, device="cpu")
    consumed = []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state.get("done"):  # this rank finished the epoch before the kill: a real loop
            print("done", json.dumps(state["consumed"]), flush=True)  # would go on to the next
            sys.exit(0)
        feed.load_state_dict(state["feed"])
        consumed = state["consumed"]
    for step, (x, uid) in enumerate(feed):
        consumed += uid.tolist()
        if step % 2 == 0:  # checkpoint every other step, atomically
            torch.save({"feed": feed.state_dict(), "consumed": consumed}, str(ckpt) + ".tmp")
            os.replace(str(ckpt) + ".tmp", ckpt)
        print("step", step, flush=True)
    torch.save({"feed": feed.state_dict(), "consumed": consumed, "done": True}, str(ckpt) + ".tmp")
    os.replace(str(ckpt) + ".tmp", ckpt)
    print("done", json.dumps(consumed), flush=True)
''')


@pytest.fixture(scope="module")
def uid_dataset(tmp_path_factory):
    """N small real-photo JPEGs, each with a unique ``uid`` field."""
    rng, photos = random.Random(0), load_photos()
    dst = tmp_path_factory.mktemp("uids") / "ds"
    write(dst, [{"image": make_image(rng, photos), "uid": i} for i in range(N)], progress=False)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(script: Path, root: Path, ckpt: Path, device: str, rank: int, world: int, port: int):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(script), str(root), str(ckpt), device],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def run_until_done(tmp_path: Path, root: Path, device: str, world: int, seed: int) -> list:
    """Run the loop on ``world`` ranks, SIGKILL-ing all of them after a random number of
    steps, restarting from the checkpoints, until every rank finishes; what each consumed."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    ckpts = [tmp_path / f"rank{r}.pt" for r in range(world)]
    rng, kills = random.Random(seed), 0
    while True:
        port = free_port()
        procs = [start(script, root, ckpts[r], device, r, world, port) for r in range(world)]
        kill_after = rng.randint(1, 6) if kills < 3 else None
        finished = [None] * world
        for r, p in enumerate(procs):
            for line in p.stdout:
                if line.startswith("done"):
                    finished[r] = json.loads(line[5:])
                    break
                if kill_after is not None and r == 0 and line.startswith(f"step {kill_after}"):
                    break  # rank 0 is mid-epoch: kill everyone now
            if kill_after is not None and finished[r] is None:
                break
        if all(f is not None for f in finished):
            for p in procs:
                p.wait(timeout=60)
            return finished
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)  # the loop and its DataLoader workers at once
            p.wait(timeout=60)
            err = p.stderr.read()
            assert "Traceback" not in err, err
        kills += 1


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_killed_and_resumed_loop_sees_every_sample_once(uid_dataset, tmp_path, world):
    consumed = run_until_done(tmp_path, uid_dataset, "cpu", world, seed=world)
    every = [u for rank in consumed for u in rank]
    assert sorted(every) == list(range(N)), (len(every), sorted(set(range(N)) - set(every)))
    assert len({len(c) for c in consumed}) == 1  # equal shares on every rank


@pytest.mark.gpu
@cuda
def test_gpu_decoder_resume_sees_every_sample_once(uid_dataset, tmp_path):
    consumed = run_until_done(tmp_path, uid_dataset, "gpu", 1, seed=5)
    assert sorted(consumed[0]) == list(range(N))


def test_prefetcher_state_counts_what_the_consumer_received(uid_dataset):
    """The loader runs a batch ahead of the consumer; the saved state must not."""
    from packer import CUDAPrefetcher, DecodeCenterCrop, PackedDataset, PackedSampler, make_loader
    ds = PackedDataset(uid_dataset, decode=DecodeCenterCrop(32), target_fields="uid")

    def feed():
        loader = make_loader(ds, 4, sampler=PackedSampler(ds, seed=1), num_workers=0)
        return CUDAPrefetcher(loader, device="cpu")
    first = feed()
    got = []
    for step, (_, uid) in enumerate(first):
        got += uid.tolist()
        if step == 2:
            state = first.state_dict()
            break
    second = feed()
    second.load_state_dict(state)
    rest = [u for _, uid in second for u in uid.tolist()]
    assert sorted(got + rest) == list(range(N)) and len(got) == 12
    other = make_loader(ds, 4, sampler=torch.utils.data.SequentialSampler(ds), num_workers=0)
    with pytest.raises(TypeError, match="stateful=True"):
        CUDAPrefetcher(other, device="cpu").state_dict()
    assert torch.is_tensor(torch.zeros(1))


@pytest.mark.parametrize("overlap,passes", [(1, 0), (2, 0), (2, 1)])
def test_gpu_decoder_state_counts_what_the_consumer_received(uid_dataset, overlap, passes):
    """The decode threads draw batches well ahead of the consumer, into the next epoch once
    one ends (PIL stands in for nvJPEG on the CPU here); the state must count only what the
    consumer got."""
    from packer import GPUDecoder, PackedDataset, PackedSampler
    from packer.gpu import GPUOptions, make_gpu_loader
    from helpers import pil_decoder
    ds = PackedDataset(uid_dataset, target_fields="uid")

    def feed():
        loader = make_gpu_loader(ds, 4, sampler=PackedSampler(ds, seed=1), num_workers=0)
        opts = GPUOptions(decoder=pil_decoder, overlap=overlap, queue_depth=3)
        return GPUDecoder(loader, size=32, device="cpu", options=opts)
    first, got = feed(), []
    for _ in range(passes):  # the threads go on into the next epoch after each
        assert sorted(u for _, uid in first for u in uid.tolist()) == list(range(N))
    it = iter(first)
    for _ in range(3):
        got += next(it)[1].tolist()
    state = first.state_dict()
    assert len(first.loader.state_dict()) and first.state_dict() == state
    del it
    second = feed()
    second.load_state_dict(state)
    rest = [u for _, uid in second for u in uid.tolist()]
    assert sorted(got + rest) == list(range(N)), (len(got), len(rest))


@pytest.mark.parametrize("feeder", ["prefetcher", "gpu0", "gpu2"])
def test_a_state_saved_after_a_pass_resumes_at_the_next_pass(uid_dataset, feeder):
    """A loop without set_epoch that saves after a pass ended: the resumed loop's next pass is
    a whole epoch, as when resuming from the loader's own state (the saved state was the last
    batch's, mid-epoch 0 at its end: the next pass came out empty)."""
    from packer import (CUDAPrefetcher, DecodeCenterCrop, GPUDecoder, PackedDataset,
                        PackedSampler, make_loader)
    from packer.gpu import GPUOptions, make_gpu_loader
    from helpers import pil_decoder

    def feed():
        if feeder == "prefetcher":
            ds = PackedDataset(uid_dataset, decode=DecodeCenterCrop(32), target_fields="uid")
            loader = make_loader(ds, 4, sampler=PackedSampler(ds, seed=1), num_workers=0)
            return CUDAPrefetcher(loader, device="cpu")
        ds = PackedDataset(uid_dataset, target_fields="uid")
        loader = make_gpu_loader(ds, 4, sampler=PackedSampler(ds, seed=1), num_workers=0)
        opts = GPUOptions(decoder=pil_decoder, overlap=int(feeder[-1]))
        return GPUDecoder(loader, size=32, device="cpu", options=opts)
    first = feed()
    assert sorted(u for _, uid in first for u in uid.tolist()) == list(range(N))
    state = first.state_dict()
    assert state["loader"] == first.loader.state_dict()
    second = feed()
    second.load_state_dict(state)
    for _ in range(2):
        assert sorted(u for _, uid in second for u in uid.tolist()) == list(range(N))
