"""Building on a Ray cluster (``build(src, dst, engine="ray")``; ``--ray``): each task runs
``worker.write_shard`` into DST (a shared filesystem); the driver takes shards only from returned
results, so the dataset is the local build's byte for byte and no retry leaves a half shard.
Tasks are stopped through a file in DST, not ``ray.cancel``: a cancel racing a task's reply
can abort the driver inside Ray (ray-project/ray#54846)."""
from __future__ import annotations

import copy
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Deque, Dict, Iterator, List, Optional, Tuple

from .. import __version__
from .._util.fsio import remove_own
from ..errors import PackerError
from ..format.manifest import SHARD_PATTERN
from ..sources.base import ImageList
from ..storage.files import RemoteFolder
from .worker import ShardDone, ShardJob, ShardTask, remove_untaken, write_shard


def need_ray():
    """The ``ray`` module, or a PackerError naming the pip command."""
    try:
        import ray
    except ImportError:
        raise PackerError("building on Ray needs Ray installed: pip install 'packer-lmdb[ray]' "
                          "(or pip install ray)") from None
    return ray


def check_reachable(address: str, where: str) -> None:
    """A PackerError unless something answers at a ``host:port`` address (any scheme), where
    ``ray.init`` would wait without end; others ("auto", "local") Ray resolves itself."""
    host, sep, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise PackerError(f"no Ray cluster answers at {address} (from {where}: "
                          f"{e.strerror or e}): start one there (`ray start --head`) or fix "
                          f"the address; without one, --ray starts a local cluster") from None


STOP_NAME = ".shard-stop"  # in DST while the tasks must stop; a ".shard-*" name, so a build
# resuming after a driver killed mid-stop removes it with the other temp files


class StopFile:
    """``write_shard``'s stop flag for tasks on any node: set once ``path`` exists, looked at no
    more than every ``every`` seconds. Each look opens the folder first: on NFS an open
    revalidates the folder's cached attributes (close-to-open), on which a cached "no such
    file" depends. ``set`` creates it (a task failing a strict build stops the others); False
    where it cannot (a full or read-only disk), for the driver to stop the tasks otherwise."""

    def __init__(self, path: Path, every: float = 1.0):
        self.path, self.every, self.seen, self.next = path, every, False, 0.0

    def is_set(self) -> bool:
        if not self.seen and time.monotonic() >= self.next:
            self.next = time.monotonic() + self.every
            try:
                os.close(os.open(self.path.parent, os.O_RDONLY))
            except OSError:
                pass  # the folder gone: the build is over anyway; exists() says False
            self.seen = self.path.exists()
        return self.seen

    def set(self) -> bool:
        try:
            self.path.touch()
            return True
        except OSError:
            return False


@dataclass
class RayEngine:
    """Shards written by Ray tasks (``num_cpus=1`` each) on the cluster this process is connected
    to, else ``address``, else ``RAY_ADDRESS``, else a new local one. The nodes need this
    version of packer and DST at the same path."""
    address: Optional[str] = None
    max_retries: int = 3

    def __post_init__(self):
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) \
                or self.max_retries < 0:  # Ray reads -1 as "retry for ever"
            raise PackerError(f"RayEngine(max_retries=...) must be a count >= 0, got "
                              f"{self.max_retries!r}")
        if not need_ray().is_initialized():  # fail before the build lists its source
            check_reachable(*self.target())

    def target(self) -> Tuple[str, str]:
        """(address, where it comes from) of the cluster to connect to when none is."""
        if self.address:
            return self.address, "address="
        if os.environ.get("RAY_ADDRESS"):
            return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
        return "local", "the default"

    def shards(self, tasks: List[ShardTask], job: ShardJob, bar) -> Iterator[ShardDone]:
        """``write_shard`` for each task on the cluster; the results in task order."""
        ray = need_ray()
        started = not ray.is_initialized()
        if started:
            address = self.target()[0]
            extra = {"include_dashboard": False} if address == "local" else {}
            ray.init(address=address, logging_level="WARNING", **extra)
        try:
            write = ray.remote(num_cpus=1, max_retries=self.max_retries)(write_part)
            yield from _in_order(ray, write, tasks, job, bar)
        finally:
            if started:
                ray.shutdown()


def _in_order(ray, write, tasks: List[ShardTask], job: ShardJob, bar) -> Iterator[ShardDone]:
    """The tasks' results in order, a window at a time; on close the rest are stopped and
    waited for (``write_shard`` removes its temp files) and finished shards not taken removed."""
    pending: Deque = deque()  # (task, ref), in plan order
    ready: Dict = {}          # ref -> its ShardDone, finished out of order
    todo = iter(tasks)
    done: Optional[ShardDone] = None  # handed out, not yet taken
    stop = StopFile(Path(os.path.abspath(job.dst)) / STOP_NAME)  # one left over: gone with
    # the temp files before a resumed build starts (journal.load), refused in a fresh DST
    try:
        while True:
            window = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
            while len(pending) < window and (task := next(todo, None)) is not None:
                pending.append((task, write.remote(*_slice(job, task, stop), __version__)))
            if not pending:
                break
            while pending[0][1] not in ready:
                running = [ref for _, ref in pending if ref not in ready]
                for ref in ray.wait(running, num_returns=1)[0]:
                    task = next(t for t, r in pending if r == ref)
                    ready[ref] = _result(ray, ref, task)
                    bar.update(len(ready[ref].samples))
            done = ready.pop(pending.popleft()[1])
            yield done
            done = None
    finally:
        left = [ref for _, ref in pending if ref not in ready]
        if left and stop.set():  # running tasks give up at their next image, queued at their first
            left = list(set(left) - set(ray.wait(left, num_returns=len(left), timeout=60)[0]))
        if left:  # stuck for a minute, or no stop file: cancel as a last resort
            for ref in left:
                ray.cancel(ref)
            left = list(set(left) - set(ray.wait(left, num_returns=len(left), timeout=60)[0]))
        remove_untaken(job.dst, [done, *ready.values()])
        for task, ref in pending:  # one stopped as it finished has its shard and no result taken
            if ref not in ready:
                remove_own(job.dst, SHARD_PATTERN.format(task.index))
        if not left:  # else the stragglers still read it; the next run removes it (".shard-*")
            remove_own(job.dst, STOP_NAME)


def _result(ray, ref, task: ShardTask) -> ShardDone:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:  # raised in the task: a full disk, a bad install
        if isinstance(e.cause, PackerError):
            raise e.cause from None
        raise
    except ray.exceptions.RayError as e:  # its worker or node died more than max_retries times
        raise PackerError(f"Ray could not write shard {task.index} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0]}); the shards finished before it are kept: "
                          f"re-run the same build to resume") from e


def _slice(job: ShardJob, task: ShardTask, stop: StopFile):
    """(job, local task, task) for one shard: a job holding only the task's entries and rows,
    with absolute paths (a Ray worker's folder is not the driver's), stopped by ``stop``."""
    src, a, e = job.fields.source, task.start, task.end
    ann = src.annotations
    if ann is not None:
        ann = replace(ann, rows=list(ann.rows[a:e]), dropped=[], extra={})
    fields = copy.copy(job.fields)
    entries = src.entries[a:e]
    root = src.root.subset(rel for rel, _ in entries) if isinstance(src.root, RemoteFolder) \
        else Path(os.path.abspath(src.root))
    fields.source = ImageList(root, src.classes, entries, ann)
    return (replace(job, dst=Path(os.path.abspath(job.dst)), fields=fields, stop=stop),
            ShardTask(task.index, 0, e - a, task.expected_bytes), task)


def write_part(job: ShardJob, local: ShardTask, task: ShardTask, version: str) -> ShardDone:
    """One shard, in a Ray task: ``write_shard`` over the sliced job, numbered as in the plan."""
    if version != __version__:
        raise PackerError(f"the Ray worker runs packer {__version__}, the build packer "
                          f"{version}: install the same version on every node")
    done = write_shard(local, job)
    done.task = task
    done.samples = [(task.start + i, kept, extra) for i, kept, extra in done.samples]
    return done
