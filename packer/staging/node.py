"""Staging once per node under ``torch.distributed`` (:func:`stage_once_per_node`): local
rank 0 copies, the other ranks of the node wait.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from .._util.system import fs_type, meminfo
from ..errors import PackerError
from ..format.manifest import read_manifest
from ..storage import is_url, redact
from ..storage.remote import dataset_files
from .results import StageResult
from .stager import stage


def local_rank_from_env() -> Optional[int]:
    """This process's rank within its node, from torchrun, SLURM or Open MPI variables."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        value = os.environ.get(var)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise PackerError(f"{var}={value!r} is not an integer") from None
    return None


def stage_once_per_node(src: os.PathLike, target: os.PathLike, *, local_rank: Optional[int] = None,
                        timeout: float = 4 * 3600, **kwargs) -> StageResult:
    """Stage once per node under ``torch.distributed``: local rank 0 copies, the others wait.

    Call it on every rank (a collective once torch.distributed is initialised) with a
    node-local ``target`` such as ``/dev/shm/train``, then ``PackedDataset(res.target)``. The
    wait is an all-reduce over a gloo group with ``timeout`` seconds (4 h: a big copy outlasts
    the default); it carries failure, so every rank raises instead of hanging. Without
    torch.distributed it simply stages. ``local_rank`` defaults to ``local_rank_from_env()``;
    other keyword arguments go to ``stage``; non-zero local ranks get ``waited=True``.
    """
    import datetime

    try:
        import torch
        import torch.distributed as dist
        active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:  # pragma: no cover - torch is a dependency
        active = False
    if not active:
        return stage(src, target, **kwargs)
    if local_rank is None:
        local_rank = local_rank_from_env()
    if local_rank is None:
        raise PackerError("stage_once_per_node needs this process's rank within its node: "
                          "launch with torchrun (sets LOCAL_RANK) or pass local_rank=")
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    try:
        result: Optional[StageResult] = None
        error: Optional[BaseException] = None
        if local_rank == 0:
            try:
                result = stage(src, target, **kwargs)
            except Exception as e:  # reported to every rank below, re-raised here
                error = e
        flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    finally:
        dist.destroy_process_group(group)
    if error is not None:
        raise error
    if int(flag.item()) == 0:
        raise PackerError(f"staging {src} to {target} failed on local rank 0 of this or another "
                          f"node (see that rank's error); fix it and restart the job")
    if result is not None:
        return result
    man = read_manifest(target)  # cheap: local rank 0 just verified every byte
    files = dataset_files(man)
    return StageResult(source=redact(src) if is_url(src) else Path(src),  # never credentials
                       target=Path(target), waited=True, fstype=fs_type(target),
                       swap=meminfo().get("SwapTotal", 0) > 0, kept=[f["path"] for f in files],
                       bytes_total=sum(int(f.get("bytes", 0)) for f in files))
