"""packer/_threads.py: END, Raised, drain, stoppable_put/get, with real threads."""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback

import pytest

from packer._util.threads import END, Raised, drain, stoppable_get, stoppable_put


def _failing_producer(out: list):
    try:
        {}["missing"]
    except KeyError as e:
        out.append(Raised(e, "the producer thread"))


def test_reraise_keeps_the_exception_object():
    box: list = []
    t = threading.Thread(target=_failing_producer, args=(box,))
    t.start()
    t.join()
    carried = box[0]
    original = carried.exc
    with pytest.raises(KeyError) as info:
        carried.reraise()
    assert info.value is original
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_failing_producer" in frames  # the producer's traceback is still attached
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == ["(raised in the producer thread)"]
    assert carried.where == "the producer thread"


def test_raised_has_no_dict():
    r = Raised(ValueError("x"), "w")
    with pytest.raises(AttributeError):
        r.other = 1


def test_drain_empties():
    q: queue.Queue = queue.Queue()
    for i in range(5):
        q.put(i)
    drain(q)
    assert q.empty() and q.qsize() == 0
    drain(q)  # an empty queue is fine
    assert q.empty()


def test_drain_unblocks_a_producer_on_a_full_queue():
    q: queue.Queue = queue.Queue(maxsize=1)
    q.put("first")
    done = threading.Event()

    def produce():
        q.put("second")  # blocks: the queue is full
        done.set()

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    assert not done.wait(0.1)
    drain(q)
    assert done.wait(5)
    t.join(5)
    assert q.get_nowait() == "second"


def test_stoppable_put():
    q: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    assert stoppable_put(q, 1, stop) is True
    result = []
    t = threading.Thread(target=lambda: result.append(stoppable_put(q, 2, stop, poll=0.01)))
    t.start()
    time.sleep(0.1)
    assert t.is_alive() and not result  # waiting on the full queue
    stop.set()
    t.join(5)
    assert not t.is_alive() and result == [False]
    assert q.get_nowait() == 1 and q.empty()  # the item was not put
    assert stoppable_put(queue.Queue(), 3, stop) is False  # stopped before it began


def test_stoppable_put_waits_for_room():
    q: queue.Queue = queue.Queue(maxsize=1)
    q.put("a")
    stop = threading.Event()
    result = []
    t = threading.Thread(target=lambda: result.append(stoppable_put(q, "b", stop, poll=0.01)))
    t.start()
    time.sleep(0.05)
    assert q.get(timeout=5) == "a"
    t.join(5)
    assert result == [True] and q.get_nowait() == "b"


def test_stoppable_get():
    q: queue.Queue = queue.Queue()
    stop = threading.Event()
    got = []
    t = threading.Thread(target=lambda: got.append(stoppable_get(q, stop, poll=0.01)))
    t.start()
    time.sleep(0.1)
    assert t.is_alive() and not got  # waiting on the empty queue
    stop.set()
    t.join(5)
    assert not t.is_alive() and got == [END]
    q.put("x")
    assert stoppable_get(q, stop) == "x"  # stopped, but queued items still come first
    assert stoppable_get(q, stop) is END


def test_producer_consumer_with_stop():
    q: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    sent = []

    def produce():
        for i in range(1000):
            if not stoppable_put(q, i, stop, poll=0.01):
                return
            sent.append(i)
        stoppable_put(q, END, stop)

    t = threading.Thread(target=produce)
    t.start()
    received = [stoppable_get(q, stop) for _ in range(10)]
    assert received == list(range(10))
    stop.set()
    drain(q)
    t.join(5)
    assert not t.is_alive()
    assert len(sent) < 1000
