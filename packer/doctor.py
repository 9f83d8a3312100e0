"""``packer doctor``: the environment as facts and as lines to act on; torch only with cuda=True."""
from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Dict, List, Optional

from . import __version__
from ._util.system import PILLOW_SIMD_HINT, pil_info, pil_summary, usable_cores

# Optional packages: what each adds, and the command that installs it.
OPTIONAL = {
    "torchvision": ("GPU decoding with nvJPEG, tv_tensors detection targets, bench --model",
                    "pip install torchvision"),
    "triton": ("GPU decoding: its fused augment kernel", "pip install triton"),
    "torchdata": ("make_loader(stateful=True): mid-epoch resume", "pip install torchdata"),
    "matplotlib": ("packer bench --plot", "pip install matplotlib"),
}


def doctor(cuda: bool = False) -> Dict[str, object]:
    """PIL, torch (with ``cuda=True`` its GPU's name, or False), optional packages, cores."""
    try:
        pil: Optional[dict] = pil_info()
        summary = pil_summary()
    except ImportError:  # PIL is a dependency; say so instead of failing
        pil, summary = None, "not installed: pip install Pillow"
    return {"packer": __version__, "python": sys.version.split()[0], "pil": pil,
            "pil_summary": summary, "torch": installed("torch"),
            "cuda": cuda_device() if cuda else None, "triton": installed("triton"),
            "optional": {name: installed(name) for name in OPTIONAL},
            "cores": usable_cores(), "cpu_count": os.cpu_count()}


def installed(dist: str) -> Optional[str]:
    """The installed version of distribution ``dist`` (None if absent), without importing it."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cuda_device():
    """The first GPU's name, or False when torch sees none (or torch is not installed)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else False


def format_doctor(d: Dict[str, object]) -> str:
    lines: List[str] = [f"packer   {d['packer']}", f"python   {d['python']}",
                        f"PIL      {d['pil_summary']}"]
    pil = d["pil"]
    if pil and pil.get("mismatch"):
        lines.append(f"         pip lists {', '.join(pil['installed'])}, but the PIL imported from "
                     f"{pil['module']} is stock Pillow (a package that requires Pillow "
                     f"overwrote Pillow-SIMD); fix: {PILLOW_SIMD_HINT}")
    elif pil and not pil["simd"]:
        lines.append(f"         Pillow-SIMD has SIMD resize and convert: {PILLOW_SIMD_HINT}")
    if d["torch"] is None:
        lines.append("torch    not installed: pip install torch (training needs it: "
                     "PackedDataset, make_loader)")
    else:
        cuda = {None: "not checked (packer doctor --cuda checks it)", False: "not available"}
        lines.append(f"torch    {d['torch']}; CUDA "
                     f"{cuda[d['cuda']] if d['cuda'] in cuda else 'available: ' + d['cuda']}")
    if d["triton"]:
        lines.append(f"triton   {d['triton']}: GPU decoding augments in one fused kernel")
    else:
        lines.append("triton   not available: GPU decoding needs it for its fused augment kernel "
                     "(pip install triton); the CPU path does not")
    optional = d.get("optional") or {}
    lines += [f"{name:<8} not installed: {hint} (for {what})" for name, (what, hint)
              in OPTIONAL.items() if name != "triton" and not optional.get(name)]
    lines.append(f"cores    {d['cores']} usable of {d['cpu_count']}")
    return "\n".join(lines)
