"""The threads behind ``GPUDecoder``: each on its own CUDA stream, joined by bounded queues;
batches come out in the loader's order; errors travel to the consumer.
"""
from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from contextlib import nullcontext

import torch

from .._util.threads import END, Raised, drain, stoppable_get, stoppable_put


class Pipeline:
    """The decode threads, each on its own stream, joined to the consumer by a bounded queue;
    batches go out in the order taken from the loader. ``close`` stops and joins them."""

    def __init__(self, dec, it, base: int):
        """``dec``: the ``GPUDecoder`` whose ``decode_batch``/``augment_batch`` the threads run;
        batch n's crops come from seed ``base + n``, whichever thread augments it."""
        self.stop, self.stats = threading.Event(), dec.stats
        self.out: queue.Queue = queue.Queue(dec.options.queue_depth)
        lock, count = threading.Lock(), itertools.count()
        snapshot = getattr(dec.loader, "state_dict", None)
        self.states: dict = {}  # batch number -> the loader's state right after it was drawn

        def src():  # one batch and its number (and the loader's state then), atomically
            with lock:
                n, batch = next(count), next(it)
                if snapshot is not None:
                    self.states[n] = snapshot()
                return n, batch
        threads = dec.decode_threads
        self._ordered = self._in_order(self.out, threads)
        self.threads = [threading.Thread(
            target=self._run, args=(src, functools.partial(_both, dec, dec.decoders[k], base),
                                    dec.streams[k]),
            daemon=True, name=f"packer-gpu-decode-{k}") for k in range(threads)]
        for t in self.threads:
            t.start()

    def _in_order(self, q, producers: int):
        """Items of ``q`` in their numbers' order; the end once every producer has ended and
        nothing is left."""
        held, want, ended = {}, [0], [0]

        def get():
            while want[0] not in held:
                item = self._get(q)
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
            return want[0] - 1, held.pop(want[0] - 1)
        return get

    def _run(self, source, fn, stream) -> None:
        # Seconds waiting for the loader, working, and waiting for room in the queue: the
        # stage that neither waits nor is blocked is the bottleneck.
        where = "decode+augment"
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                clock, add = time.perf_counter, self.stats.add_time
                while not self.stop.is_set():
                    t0 = clock()
                    try:
                        n, item = source()
                    except StopIteration:
                        break
                    t1 = clock()
                    res = fn(n, item)
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

    def _get(self, q):
        return stoppable_get(q, self.stop)

    def get(self):
        try:  # several threads put finished batches: hand them out in the loader's order
            item = self._ordered()[1]
        except StopIteration:
            item = END
        except _Forward as f:
            item = f.raised
        if isinstance(item, Raised):
            item.reraise()
        return item

    def close(self, timeout: float = 60.0) -> None:
        self.stop.set()
        for t in self.threads:
            waited = 0.0
            while t.is_alive() and waited < timeout:  # a stuck loader leaves a daemon thread
                drain(self.out)
                t.join(0.05)
                waited += 0.05
        drain(self.out)
        self._ordered = None  # its closure holds batches and this object: no cycle left for
        # the garbage collector, which could run in a DataLoader worker forked later and
        # free CUDA memory there (CUDA cannot be used in a forked child: the worker aborts)


def _both(dec, decoder, base, n, batch):
    return dec.augment_batch(dec.decode_batch(batch, decoder=decoder), base + n)


class _Forward(Exception):
    def __init__(self, raised: Raised):
        super().__init__(raised.where)
        self.raised = raised
