"""packer: pack image datasets into LMDB shards once, then feed GPUs without waiting on input.

Every name is imported on first use, so ``import packer`` and the CLI's inspection commands
never import torch. ``docs/architecture.md`` maps the tree."""
from typing import TYPE_CHECKING

from ._util.lazy import lazy_names

__version__ = "0.1.0"

if TYPE_CHECKING:  # the names of __all__ (tests/test_layout.py checks the lists agree)
    from .errors import FormatError, PackerError
    from .gpu import GPUDecoder
    from .info import verify
    from .loading.loader import make_loader
    from .loading.prefetch import CUDAPrefetcher
    from .reading.dataset import PackedDataset
    from .reading.iterable import PackedIterableDataset
    from .reading.mixture import Mixture
    from .reading.sampler import PackedSampler
    from .staging import stage, stage_once_per_node, unstage
    from .transforms.decode import DecodeCenterCrop, DecodeLetterbox, DecodeRandomResizedCrop
    from .writing.builder import build
    from .writing.check import Checks, Transcode
    from .writing.merger import merge
    from .writing.python import DatasetWriter, write

_WHERE = {
    ".errors": ["FormatError", "PackerError"],
    ".gpu": ["GPUDecoder"],
    ".info": ["verify"],
    ".loading.loader": ["make_loader"],
    ".loading.prefetch": ["CUDAPrefetcher"],
    ".reading.dataset": ["PackedDataset"],
    ".reading.iterable": ["PackedIterableDataset"],
    ".reading.mixture": ["Mixture"],
    ".reading.sampler": ["PackedSampler"],
    ".staging": ["stage", "stage_once_per_node", "unstage"],
    ".transforms.decode": ["DecodeCenterCrop", "DecodeLetterbox", "DecodeRandomResizedCrop"],
    ".writing.builder": ["build"],
    ".writing.check": ["Checks", "Transcode"],
    ".writing.merger": ["merge"],
    ".writing.python": ["DatasetWriter", "write"],
}
# the subpackages too, so ``import packer`` is enough for ``packer.gpu.make_gpu_loader(...)``
for _sub in ("format", "gpu", "loading", "reading", "sources", "staging", "storage",
             "transforms", "writing"):
    _WHERE.setdefault(f".{_sub}", []).append(_sub)
del _sub

__all__ = ["CUDAPrefetcher", "Checks", "DatasetWriter", "DecodeCenterCrop", "DecodeLetterbox",
           "DecodeRandomResizedCrop", "FormatError", "GPUDecoder", "Mixture", "PackedDataset",
           "PackedIterableDataset", "PackedSampler", "PackerError", "Transcode", "build",
           "make_loader", "merge", "stage", "stage_once_per_node", "unstage", "verify", "write"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
