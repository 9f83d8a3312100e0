"""BackgroundIterator: any iterable, a few items ahead in a thread (CPU; runs in CI)."""
import gc
import threading
import time

import pytest

from packer.loading.threaded import BackgroundIterator, background


def _no_packer_threads(timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not [t for t in threading.enumerate() if t.name.startswith("packer-background")]:
            return True
        time.sleep(0.01)
    return False


def test_background_yields_everything_in_order():
    it = background(range(100), depth=3)
    assert len(it) == 100
    assert list(it) == list(range(100))
    with pytest.raises(StopIteration):
        next(it)
    assert _no_packer_threads()


def test_background_runs_ahead_by_depth_only():
    produced = []

    def source():
        for i in range(50):
            produced.append(i)
            yield i

    it = BackgroundIterator(source(), depth=2)
    time.sleep(0.2)
    # depth items queued, plus one produced and waiting for room.
    assert len(produced) == 3
    assert next(it) == 0
    it.close()
    assert _no_packer_threads()


def _fail_at(n):
    for i in range(n):
        yield i
    raise KeyError(f"bad item {n}")


def test_background_reraises_with_the_producer_traceback():
    import traceback
    it = background(_fail_at(3))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad item 3") as info:
        next(it)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_fail_at" in frames  # where it happened, in the thread
    with pytest.raises(StopIteration):
        next(it)
    assert _no_packer_threads()


@pytest.mark.parametrize("how", ["close", "with", "del", "break"])
def test_background_stops_when_the_consumer_does(how):
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    if how == "close":
        it = background(endless())
        next(it)
        it.close()
    elif how == "with":
        with background(endless()) as it:
            next(it)
    elif how == "del":
        it = background(endless())
        next(it)
        del it
        gc.collect()
    else:
        for i in background(endless()):
            if i == 5:
                break
        gc.collect()
    assert _no_packer_threads()
    assert closed.wait(5), "the source generator was not closed"


def test_background_rejects_bad_depth():
    with pytest.raises(ValueError, match="depth"):
        background([], depth=0)
