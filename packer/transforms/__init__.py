"""Image work on the CPU that moves annotations with it: fused PIL decoders that crop
while decoding (``decode``) and batched box maths (``boxes``)."""
from .._util.lazy import lazy_names

_WHERE = {".decode": ["DecodeCenterCrop", "DecodeLetterbox", "DecodeRandomResizedCrop"]}
__all__ = ["DecodeCenterCrop", "DecodeLetterbox", "DecodeRandomResizedCrop"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
