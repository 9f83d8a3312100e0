"""Staging: a verified copy of a dataset on fast storage (a tmpfs, ``/dev/shm``): ``stage``,
``unstage`` (only what staging wrote) and ``stage_once_per_node`` under torch.distributed."""
from .copy import TMP_SUFFIX
from .results import RAM_FS, StageResult, UnstageResult
from .stager import local_rank_from_env, stage, stage_once_per_node
from .unstager import STAGE_LOCK, STAGE_MARKER, unstage

__all__ = ["RAM_FS", "STAGE_LOCK", "STAGE_MARKER", "StageResult", "TMP_SUFFIX", "UnstageResult",
           "local_rank_from_env", "stage", "stage_once_per_node", "unstage"]
