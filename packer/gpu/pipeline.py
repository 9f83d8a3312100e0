"""The threads behind ``GPUDecoder``. Threads beyond the first decode only while the consumer
starves: beside an eager training loop every busy thread takes interpreter time from the loop
(docs/gpu_decode.md, "How many decode threads work")."""
from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from contextlib import nullcontext
from typing import Callable

import torch

from .._util.threads import END, Raised, drain, stoppable_get, stoppable_put


CALM = 8  # batches in a row that find the consumer fed before one decode thread rests


class NextPass:
    """Where one pass ends and the next, begun early, starts; ``key`` says what that pass was
    started as, for the consumer to check before it uses it; ``begun``: set once it does."""
    __slots__ = ("key", "begun")

    def __init__(self, key, begun: threading.Event):
        self.key, self.begun = key, begun


class Pipeline:
    """The decode threads, each on its own stream, joined to the consumer by a bounded queue;
    batches go out in the order taken from ``items``, errors reach the consumer. ``active``
    threads take batches: one more each time the consumer waited so long that its GPU ran dry,
    one fewer after ``CALM`` batches in a row without that. ``close`` stops and joins them."""

    def __init__(self, dec, items, stop: threading.Event, active: int = 1):
        """``dec``: the ``GPUDecoder`` (a weak proxy) the threads run; ``items``: ``(crop seed,
        batch)`` pairs and ``NextPass`` markers, which pass through; ``stop``: what ``close``
        sets (``items`` may wait on it); ``active``: threads decoding at the start."""
        self.stop, self.stats = stop, dec.stats
        self.active, self.calm = max(1, min(active, dec.decode_threads)), 0
        self.turn, self.exhausted, self.started = threading.Condition(), False, False
        self.out: queue.Queue = queue.Queue(dec.options.queue_depth)
        lock, count = threading.Lock(), itertools.count()
        snapshot = getattr(dec.loader, "state_dict", None)
        self.states: dict = {}  # item number -> the loader's state right after it was drawn
        self.handed = -1  # the number of the last item handed out

        def src():  # one batch and its number (and the loader's state then), atomically
            with lock:
                if self.exhausted:
                    raise StopIteration
                try:
                    n, batch = next(count), next(items)
                except StopIteration:
                    self.exhausted = True
                    with self.turn:  # resting threads wake to end too
                        self.turn.notify_all()
                    raise
                if snapshot is not None:
                    self.states[n] = snapshot()
                return n, batch
        threads = dec.decode_threads
        self._ordered = self._in_order(self.out, threads)
        self.threads = [threading.Thread(
            target=self._run, args=(k, src, functools.partial(_both, dec, dec.decoders[k]),
                                    dec.streams[k]),
            daemon=True, name=f"packer-gpu-decode-{k}") for k in range(threads)]
        for t in self.threads:
            t.start()

    def _in_order(self, q, producers: int):
        """Items of ``q`` in their numbers' order; the end once every producer has ended and
        nothing is left."""
        held, want, ended = {}, [0], [0]

        def get():  # (number, item, whether nothing was ready, in order or not)
            starved = False
            while want[0] not in held:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    starved = starved or not held  # later ones waiting: this one is being put
                    item = stoppable_get(q, self.stop)
                if isinstance(item, Raised):
                    raise _Forward(item)
                if item is END:
                    ended[0] += 1
                    if ended[0] == producers:
                        if held:
                            raise RuntimeError("packer GPU pipeline: batches lost between threads")
                        raise StopIteration
                    continue
                n, rest = item
                held[n] = rest
            want[0] += 1
            return want[0] - 1, held.pop(want[0] - 1), starved
        return get

    def _run(self, k: int, source, fn, stream) -> None:
        # Seconds waiting for the loader, working, and waiting for room in the queue: the
        # stage that neither waits nor is blocked is the bottleneck.
        where = "decode+augment"
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                clock, add = time.perf_counter, self.stats.add_time
                while not self.stop.is_set():
                    with self.turn:  # a resting thread holds no batch and takes no interpreter time
                        while k >= self.active and not (self.stop.is_set() or self.exhausted):
                            self.turn.wait(0.05)
                    t0 = clock()
                    try:
                        n, item = source()
                    except StopIteration:
                        break
                    if isinstance(item, NextPass):
                        self._put(self.out, (n, item))
                        continue
                    t1 = clock()
                    res = fn(*item)
                    t2 = clock()
                    event = None
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                    self._put(self.out, (n, (res, event)))
                    add("loader", t1 - t0)
                    add(where, t2 - t1)
                    add(f"{where} blocked", clock() - t2)
                    del item, res
            self._put(self.out, END)
        except _Forward as f:
            self._put(self.out, f.raised)
        except BaseException as e:  # noqa: B902 - everything reaches the consumer
            self._put(self.out, Raised(e, f"packer's GPU {where} thread"))

    def _put(self, q, item) -> None:
        stoppable_put(q, item, self.stop)

    def get(self, ran_dry: Callable[[], bool] = lambda: True):
        """The next batch in order (``END`` after the last); ``ran_dry()``: whether the
        consumer's GPU has finished all it was given: a wait that let it run dry asks for
        another thread, one hidden behind queued work does not."""
        starved = False
        try:  # several threads put finished batches: hand them out in the loader's order
            self.handed, item, starved = self._ordered()
        except StopIteration:
            item = END
        except _Forward as f:
            item = f.raised
        if isinstance(item, Raised):
            item.reraise()
        if self.started and item is not END and not isinstance(item, NextPass):
            # a pipeline's first batch waits for the threads
            self._pace(starved=starved and ran_dry())
        self.started = True
        return item

    def _pace(self, starved: bool) -> None:
        """One more decode thread when the consumer starved, one fewer after ``CALM`` calm
        batches: a loop that needs one thread keeps one, the pipeline alone gets them all."""
        self.calm = 0 if starved else self.calm + 1
        want = (min(len(self.threads), self.active + 1) if starved else
                self.active - 1 if self.calm >= CALM and self.active > 1 else self.active)
        if want != self.active:
            self.calm = 0
            with self.turn:
                self.active = want
                self.turn.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        self.stop.set()
        for t in self.threads:
            if t is threading.current_thread():  # the decoder's last reference went here
                continue
            waited = 0.0
            while t.is_alive() and waited < timeout:  # a stuck loader leaves a daemon thread
                drain(self.out)
                t.join(0.05)
                waited += 0.05
        drain(self.out)
        # Its closure holds batches and this object: a cycle the garbage collector could free
        # in a DataLoader worker forked later, where CUDA cannot run (the worker aborts).
        self._ordered = None


def _both(dec, decoder, seed, batch):
    return dec.augment_batch(dec.decode_batch(batch, decoder=decoder), seed)


class _Forward(Exception):
    def __init__(self, raised: Raised):
        super().__init__(raised.where)
        self.raised = raised
