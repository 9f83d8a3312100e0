"""Thread plumbing: an end marker, an error carried between threads, stoppable queue calls."""
from __future__ import annotations

import queue
import threading
from contextlib import suppress
from typing import Any

END = object()  # "no more items": put by a producer, returned by stoppable_get when stopped


class Raised:
    """An exception on its way from a producer thread to the consumer, with where it happened."""
    __slots__ = ("exc", "where")

    def __init__(self, exc: BaseException, where: str = ""):
        self.exc, self.where = exc, where

    def reraise(self) -> None:
        """Raise the original exception object (type and traceback intact), noting the thread;
        once (it is forgotten, so no cycle through its traceback keeps this frame alive)."""
        if self.where and hasattr(self.exc, "add_note"):
            self.exc.add_note(f"(raised in {self.where})")
        try:
            raise self.exc
        finally:
            self.exc = None


def drain(q: queue.Queue) -> None:
    """Drop everything queued now: unblocks a producer waiting on a full queue."""
    with suppress(queue.Empty):
        while True:
            q.get_nowait()


def stoppable_put(q: queue.Queue, item: Any, stop: threading.Event, poll: float = 0.05) -> bool:
    """Put ``item`` unless ``stop`` is set first; True if it was put."""
    while not stop.is_set():
        with suppress(queue.Full):
            q.put(item, timeout=poll)
            return True
    return False


def stoppable_get(q: queue.Queue, stop: threading.Event, poll: float = 0.05) -> Any:
    """The next item, or ``END`` once ``stop`` is set and nothing is queued."""
    while True:
        try:
            return q.get(timeout=poll)
        except queue.Empty:
            if stop.is_set():
                return END
