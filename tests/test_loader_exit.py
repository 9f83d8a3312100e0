"""make_loader's workers are shut down at interpreter exit before multiprocessing's own exit
handler gets to them (pytorch#81794: with persistent workers and pin memory under CUDA that
handler waits on each worker in turn; measured 25 s vs 7 s to exit, docs/benchmarks.md)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from packer import build
from packer.sources import Coco

SCRIPT = textwrap.dedent('''
    import atexit, multiprocessing, sys
    import packer
    from packer import PackedDataset, PackedSampler, DecodeCenterCrop, make_loader
    from torch.utils.data import SequentialSampler
    ds = PackedDataset(sys.argv[1], decode=DecodeCenterCrop(32))
    sampler = None if sys.argv[2] == "epochs" else SequentialSampler(ds)

    def check():  # registered before make_loader's hook: atexit runs it after that hook
        alive = len(multiprocessing.active_children())
        print("alive after exit hooks:", alive, flush=True)

    atexit.register(check)
    loader = make_loader(ds, 8, sampler=sampler, num_workers=2, persistent_workers=True)
    for x, y in loader:
        pass
    next(iter(loader))
    print("workers:", len(multiprocessing.active_children()), flush=True)
''')


@pytest.fixture(scope="module")
def packed(photo_src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("exit") / "d"
    build(photo_src, dst, progress=False, workers=0)
    return dst


def run_script(tmp_path, text: str, *args, timeout: int = 120) -> subprocess.CompletedProcess:
    """``text`` run as a script in a fresh interpreter with ``args``; it must exit 0."""
    script = tmp_path / "script.py"
    script.write_text(text)
    r = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("kind", ["plain", "epochs"])
def test_persistent_workers_are_stopped_before_the_interpreter_waits_on_them(packed, tmp_path,
                                                                             kind):
    r = run_script(tmp_path, SCRIPT, packed, kind)
    assert "workers: 2" in r.stdout
    assert "alive after exit hooks: 0" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("kind", ["plain", "epochs"])
def test_a_dropped_loader_and_its_workers_go_at_once(packed, kind):
    """The exit hook adds no reference cycle: ``del loader`` frees the loader and stops its
    persistent workers right away, not at some later garbage collection (which could run in
    a later loader's forked worker and fail there)."""
    import gc
    import multiprocessing
    import weakref

    from torch.utils.data import SequentialSampler

    from packer import DecodeCenterCrop, PackedDataset, make_loader
    ds = PackedDataset(packed, decode=DecodeCenterCrop(32))
    sampler = None if kind == "epochs" else SequentialSampler(ds)
    gc.disable()
    try:
        before = set(multiprocessing.active_children())
        loader = make_loader(ds, 8, sampler=sampler, num_workers=2, persistent_workers=True,
                             pin_memory=False)
        for _ in loader:
            pass
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == 2
        ref = weakref.ref(loader.loader)
        del loader
        assert ref() is None, "the loader outlived its last reference"
        for w in workers:
            w.join(timeout=10)
        assert not any(w.is_alive() for w in workers)
    finally:
        gc.enable()


CONTEXT_SCRIPT = textwrap.dedent('''
    import multiprocessing, sys
    from packer import DecodeCenterCrop, PackedDataset, make_loader
    if __name__ == "__main__":
        if sys.argv[2] != "none":
            multiprocessing.set_start_method(sys.argv[2])
        ds = PackedDataset(sys.argv[1], decode=DecodeCenterCrop(32))
        for given in (None, "spawn"):
            loader = make_loader(ds, 8, num_workers=2, multiprocessing_context=given)
            ctx = loader.multiprocessing_context
            print(given, "->", ctx.get_start_method() if ctx is not None else None)
''')


@pytest.mark.parametrize("start, want", [("spawn", "forkserver"), ("none", "None"),
                                         ("fork", "None")])
def test_workers_of_a_spawned_process_start_by_forkserver(packed, tmp_path, start, want):
    """Where the process's own default is spawn, make_loader's workers use forkserver unless
    the caller names a start method (which is kept)."""
    r = run_script(tmp_path, CONTEXT_SCRIPT, packed, start)
    assert f"None -> {want}" in r.stdout and "spawn -> spawn" in r.stdout, r.stdout


EPOCH_SCRIPT = textwrap.dedent('''
    import multiprocessing, sys
    from packer import PackedDataset, PackedSampler, make_loader
    from packer.transforms.decode import DecodeLetterbox
    if __name__ == "__main__":
        multiprocessing.set_start_method("spawn")
        ds = PackedDataset(sys.argv[1], decode=DecodeLetterbox(480))
        loader = make_loader(ds, 16, sampler=PackedSampler(ds), num_workers=2,
                             pin_memory=False, persistent_workers=False)
        print("batches:", sum(1 for _ in loader), flush=True)
''')


def test_an_epoch_loader_in_a_spawned_process_exits_cleanly(tmp_path):
    """A stream's workers (over a PackedSampler) are always mid-stream when the process ends; started by
    spawn they aborted at exit ("terminate called without an active exception", in 2 of 3
    runs on the 2-core box); by forkserver they exit at once. Two runs, a clean exit each."""
    from packer.demo.scenes import make_detection_folder
    src = make_detection_folder(tmp_path / "scenes", images=96, seed=2)
    build(Coco(src / "images", src / "annotations.json"), tmp_path / "d", progress=False,
          workers=0)
    for _ in range(2):
        r = run_script(tmp_path, EPOCH_SCRIPT, tmp_path / "d", timeout=180)
        assert "batches: 6" in r.stdout
        assert "terminate called" not in r.stderr and "Aborted" not in r.stderr, r.stderr


SPAWN_SCRIPT = textwrap.dedent('''
    import atexit, os, sys
    from packer import PackedDataset, make_loader
    from packer.transforms.decode import DecodeCenterCrop

    def mark():  # every process that finalizes its interpreter leaves its pid
        with open(sys.argv[2], "a") as f:
            f.write(f"{os.getpid()}\\n")

    def hello(worker_id):  # the caller's own worker_init_fn; printed without a flush
        print("worker init", worker_id)

    atexit.register(mark)  # at import: in the parent, and in each spawned worker
    if __name__ == "__main__":
        ds = PackedDataset(sys.argv[1], decode=DecodeCenterCrop(32))
        loader = make_loader(ds, 8, num_workers=2, multiprocessing_context="spawn",
                             pin_memory=False, worker_init_fn=hello)
        for epoch in range(2):
            n = sum(1 for _ in loader)
        print("batches:", n, "pid", os.getpid(), flush=True)
''')


def test_spawned_workers_exit_as_forked_ones_do(packed, tmp_path):
    """A caller may name spawn. Its workers then end with ``os._exit`` as forked and
    forkserver workers do, not by finalizing the interpreter, where a feeder thread still in
    torch's C++ made a mid-stream worker abort ("terminate called without an active
    exception": 3 of 24 loaders on the 2-core box before; a race, so this test checks the
    mechanism): the workers' import-time exit hooks do not run, the caller's worker_init_fn
    does and its output is flushed."""
    marks = tmp_path / "marks"
    r = run_script(tmp_path, SPAWN_SCRIPT, packed, marks)
    assert "batches: 6 pid" in r.stdout and r.stdout.count("worker init") == 2, r.stdout
    assert marks.read_text().split() == [r.stdout.split("pid")[-1].strip()]  # the parent only
    assert "terminate called" not in r.stderr and "Aborted" not in r.stderr, r.stderr
