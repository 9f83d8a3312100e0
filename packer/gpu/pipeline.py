"""The threads behind ``GPUDecoder``: each decodes and augments whole batches on its own CUDA
stream; batches come out in the loader's order and errors reach the consumer."""
from __future__ import annotations

import itertools
import queue
import threading
import time
from contextlib import nullcontext

import torch

from .._util.threads import END, Raised, drain, stoppable_get, stoppable_put


class Pipeline:
    """The decode threads of ``dec`` (a ``GPUDecoder``) joined to the consumer by a bounded
    queue; batch n's crops come from seed ``base + n``, whichever thread augments it."""

    def __init__(self, dec, it, base: int):
        self.dec, self.it, self.base = dec, it, base
        self.stop, self.stats = threading.Event(), dec.stats
        self.out: queue.Queue = queue.Queue(dec.options.queue_depth)
        self.lock, self.count = threading.Lock(), itertools.count()
        self.snapshot = getattr(dec.loader, "state_dict", None)
        self.states: dict = {}  # batch number -> the loader's state right after it was drawn
        self.held: dict = {}  # batch number -> a batch finished before its turn
        self.want = self.ended = 0
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True,
                                         name=f"packer-gpu-decode-{k}")
                        for k in range(dec.decode_threads)]
        for t in self.threads:
            t.start()

    def _draw(self):
        """One batch and its number (and the loader's state then), atomically."""
        with self.lock:
            n, batch = next(self.count), next(self.it)
            if self.snapshot is not None:
                self.states[n] = self.snapshot()
            return n, batch

    def _run(self, k: int) -> None:
        # Seconds waiting for the loader, working, and waiting for room in the queue: the
        # stage that neither waits nor is blocked is the bottleneck.
        dec, stream, where = self.dec, self.dec.streams[k], "decode+augment"
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                clock, add = time.perf_counter, self.stats.add_time
                while not self.stop.is_set():
                    t0 = clock()
                    try:
                        n, batch = self._draw()
                    except StopIteration:
                        break
                    t1 = clock()
                    res = dec.augment_batch(dec.decode_batch(batch, dec.decoders[k]), self.base + n)
                    t2 = clock()
                    event = None
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                    stoppable_put(self.out, (n, (res, event)), self.stop)
                    add("loader", t1 - t0)
                    add(where, t2 - t1)
                    add(f"{where} blocked", clock() - t2)
                    del batch, res
            stoppable_put(self.out, END, self.stop)
        except BaseException as e:  # noqa: B902 - everything reaches the consumer
            stoppable_put(self.out, Raised(e, f"packer's GPU {where} thread"), self.stop)

    def get(self):
        """The next ``(batch, event)`` in the loader's order, ``END`` after the last; a
        thread's error is raised here."""
        while self.want not in self.held:
            item = stoppable_get(self.out, self.stop)
            if isinstance(item, Raised):
                item.reraise()
            if item is END:
                self.ended += 1
                if self.ended < len(self.threads):
                    continue
                if self.held:
                    raise RuntimeError("packer GPU pipeline: batches lost between threads")
                return END
            n, rest = item
            self.held[n] = rest
        self.want += 1
        return self.held.pop(self.want - 1)

    def close(self, timeout: float = 60.0) -> None:
        """Stop the threads and join them (a stuck loader leaves a daemon thread)."""
        self.stop.set()
        for t in self.threads:
            waited = 0.0
            while t.is_alive() and waited < timeout:
                drain(self.out)
                t.join(0.05)
                waited += 0.05
        drain(self.out)
        self.held.clear()
