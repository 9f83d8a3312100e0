"""Staging: a verified copy of a dataset on fast storage (a tmpfs, ``/dev/shm``), once per node.

``stage`` copies and verifies (``stager.py``), one file at a time through ``copy.py``;
``unstage`` (``unstager.py``) removes only what staging wrote; ``stage_once_per_node`` (``node.py``) runs it on
local rank 0 under ``torch.distributed`` while the node's other ranks wait.
"""
from .node import local_rank_from_env, stage_once_per_node
from .copy import TMP_SUFFIX
from .results import RAM_FS, StageResult, UnstageResult
from .stager import stage
from .unstager import STAGE_LOCK, STAGE_MARKER, unstage

__all__ = ["RAM_FS", "STAGE_LOCK", "STAGE_MARKER", "StageResult", "TMP_SUFFIX", "UnstageResult",
           "local_rank_from_env", "stage", "stage_once_per_node", "unstage"]
