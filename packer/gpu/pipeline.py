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
    """The decode thread(s), each augmenting its own batches, or feeding an augment thread
    (``GPUOptions.augment_thread``); one thread for ``overlap=1``; joined by bounded queues.

    Several decode threads take batches from the loader in turn, numbered; the consumer
    (or the augment thread) puts them back in that order. Threads hold no reference to the
    consumer's generator, so an abandoned loop can be collected; ``close`` stops them,
    drains the queues and joins, before the loader's iterator may be reused (persistent
    workers reset the same iterator object).
    """

    def __init__(self, dec, it, base: int):
        """``dec``: the ``GPUDecoder`` whose ``decode_batch``/``augment_batch`` the threads run."""
        # Batch n's crops come from seed base + n, whichever thread augments it.
        self.stop, self.stats = threading.Event(), dec.stats
        depth = dec.options.queue_depth
        self.out: queue.Queue = queue.Queue(depth)
        self.queues = [self.out]
        streams, lock, count = dec.streams, threading.Lock(), itertools.count()

        snapshot = getattr(dec.loader, "state_dict", None)
        self.states: dict = {}  # batch number -> the loader's state right after it was drawn

        def src():  # one batch and its number (and the loader's state then), atomically
            with lock:
                n, batch = next(count), next(it)
                if snapshot is not None:
                    self.states[n] = snapshot()
                return n, batch
        self._ordered = None
        if dec.options.overlap == 1:
            stages = [("decode+augment", src, functools.partial(_both, dec, dec.decoders[0], base),
                       streams[0], self.out, False)]
        elif not dec.options.augment_thread:  # each decode thread augments its own batches
            stages = [("decode+augment", src, functools.partial(_both, dec, dec.decoders[k], base),
                       streams[k], self.out, True) for k in range(dec.decode_threads)]
            self._ordered = self._in_order(self.out, dec.decode_threads)
        else:
            mid: queue.Queue = queue.Queue(depth + dec.decode_threads - 1)
            self.queues.append(mid)
            s_aug = streams[-1]

            def handoff(n, item):  # decoded on a decode stream, augmented on s_aug
                (images, sizes, labels), event = item
                if event is not None:
                    s_aug.wait_event(event)
                    for t in images.tensors():
                        t.record_stream(s_aug)
                    labels.record_stream(s_aug)
                return dec.augment_batch((images, sizes, labels), base + n)
            stages = [("decode", src, functools.partial(_decode_only, dec, dec.decoders[k]),
                       streams[k], mid, True) for k in range(dec.decode_threads)]
            stages.append(("augment", self._in_order(mid, dec.decode_threads), handoff, s_aug,
                           self.out, False))
        self.threads = [threading.Thread(target=self._run, args=st, daemon=True,
                                         name=f"packer-gpu-{st[0]}-{k}") for k, st in enumerate(stages)]
        for t in self.threads:
            t.start()

    def _in_order(self, q, producers: int):
        """Items of ``q`` in their numbers' order (the augment thread's source, or the
        consumer's); the end once every producer has ended and nothing is left."""
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

    def _run(self, where, source, fn, stream, q, numbered) -> None:
        # Seconds per stage: waiting for input ("loader" for the decode threads, "<stage>
        # waits" for the augment thread), working ("<stage>"), and waiting for room in the
        # next queue ("<stage> blocked"): the stage that neither waits nor is blocked is
        # the bottleneck.
        wait = "loader" if where.startswith("decode") else f"{where} waits"
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
                    self._put(q, (n, (res, event)) if numbered else (res, event))
                    add(wait, t1 - t0)
                    add(where, t2 - t1)
                    add(f"{where} blocked", clock() - t2)
                    del item, res
            self._put(q, END)
        except _Forward as f:
            self._put(q, f.raised)
        except BaseException as e:  # noqa: B902 - everything reaches the consumer
            self._put(q, Raised(e, f"packer's GPU {where} thread"))

    def _put(self, q, item) -> None:
        stoppable_put(q, item, self.stop)

    def _get(self, q):
        return stoppable_get(q, self.stop)

    def get(self):
        if self._ordered is None:
            item = self._get(self.out)
        else:  # several threads put finished batches: hand them out in the loader's order
            try:
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
                for q in self.queues:
                    drain(q)
                t.join(0.05)
                waited += 0.05
        for q in self.queues:
            drain(q)
        self._ordered = None  # its closure holds batches and this object: no cycle left for
        # the garbage collector, which could run in a DataLoader worker forked later and
        # free CUDA memory there (CUDA cannot be used in a forked child: the worker aborts)


def _decode_only(dec, decoder, n, batch):
    return dec.decode_batch(batch, decoder=decoder)


def _both(dec, decoder, base, n, batch):
    return dec.augment_batch(dec.decode_batch(batch, decoder=decoder), base + n)


class _Forward(Exception):
    def __init__(self, raised: Raised):
        super().__init__(raised.where)
        self.raised = raised
