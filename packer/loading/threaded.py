"""``BackgroundIterator``: iterate anything in a background thread, a few items ahead."""
from __future__ import annotations

import contextlib
import queue
import threading
from typing import Iterable, Iterator, Optional

from .._util.threads import END, Raised, drain, stoppable_put

__all__ = ["BackgroundIterator", "background"]


class BackgroundIterator:
    """Iterate ``iterable`` in a thread, keeping up to ``depth`` items ready. An exception in the
    thread is re-raised as the same object; stopping early (``close()``, ``with``, dropping it)
    stops the thread and closes the source. One pass."""

    def __init__(self, iterable: Iterable, depth: int = 2):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1 (items kept ready), got {depth!r}")
        try:
            self._len: Optional[int] = len(iterable)
        except TypeError:
            self._len = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        # The thread must not reference self, or an abandoned iterator could never be freed.
        self._thread = threading.Thread(target=_produce, args=(iter(iterable), self._queue, self._stop),
                                        name=f"packer-background-{id(self):x}", daemon=True)
        self._thread.start()

    def __iter__(self) -> "BackgroundIterator":
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is END or isinstance(item, Raised):
            self._done = True
            self._thread.join()
            if item is END:
                raise StopIteration
            item.reraise()
        return item

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError("the wrapped iterable has no len()")
        return self._len

    def close(self, timeout: Optional[float] = 10.0) -> None:
        """Stop the thread (it finishes the item it is producing) and release queued items."""
        self._done = True
        self._stop.set()
        if threading.current_thread() is not self._thread:  # else collected by GC inside it
            self._thread.join(timeout)  # past it, the source is stuck in its own next()
            drain(self._queue)

    def __enter__(self) -> "BackgroundIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def background(iterable: Iterable, depth: int = 2) -> BackgroundIterator:
    """``for batch in background(loader):`` — the next items are produced in a thread."""
    return BackgroundIterator(iterable, depth)


def _produce(it: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            try:
                item = next(it)
            except StopIteration:
                stoppable_put(q, END, stop)
                return
            except BaseException as e:  # noqa: B902 - everything reaches the consumer
                where = "the producer thread of packer.loading.BackgroundIterator"
                stoppable_put(q, Raised(e, where), stop)
                return
            stoppable_put(q, item, stop)
            del item
    finally:
        close = getattr(it, "close", None)  # run a generator's finally blocks, here, not in GC
        if close is not None and stop.is_set():
            with contextlib.suppress(Exception):
                close()
