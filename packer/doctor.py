"""``packer doctor``: the environment packer runs in, as facts a script can read and a line each
a person can act on."""
from __future__ import annotations

import os
import sys
from typing import Dict, List

from . import __version__
from ._util.system import PILLOW_SIMD_HINT, pil_info, pil_summary, usable_cores


def doctor() -> Dict[str, object]:
    """PIL flavour and JPEG library, torch and CUDA, Triton, usable cores."""
    import torch
    cuda = torch.cuda.is_available()
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # ImportError, or a Triton that cannot set itself up
        triton_version = None
    return {"packer": __version__, "python": sys.version.split()[0], "pil": pil_info(),
            "pil_summary": pil_summary(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if cuda else None, "triton": triton_version,
            "cores": usable_cores(),
            "cpu_count": os.cpu_count()}


def format_doctor(d: Dict[str, object]) -> str:
    lines: List[str] = [f"packer   {d['packer']}", f"python   {d['python']}",
                        f"PIL      {d['pil_summary']}"]
    pil = d["pil"]
    if pil.get("mismatch"):
        lines.append(f"         pip lists {', '.join(pil['installed'])}, but the PIL imported from "
                     f"{pil['module']} is stock Pillow (a package that requires Pillow "
                     f"overwrote Pillow-SIMD); fix: {PILLOW_SIMD_HINT}")
    elif not pil["simd"]:
        lines.append(f"         Pillow-SIMD has SIMD resize and convert: {PILLOW_SIMD_HINT}")
    cuda = f"available: {d['cuda']}" if d["cuda"] else "not available"
    lines.append(f"torch    {d['torch']}; CUDA {cuda}")
    if d["triton"]:
        lines.append(f"triton   {d['triton']}: GPU decoding augments in one fused kernel")
    else:
        lines.append("triton   not available: GPU decoding needs it for its fused augment kernel "
                     "(pip install triton); the CPU path does not")
    lines.append(f"cores    {d['cores']} usable of {d['cpu_count']}")
    return "\n".join(lines)
