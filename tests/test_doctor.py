"""packer/doctor.py: the environment as facts (doctor) and as lines (format_doctor, `packer doctor`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import torch
from click.testing import CliRunner

import packer
from packer._util.system import pil_info, usable_cores
from packer.cli import main
from packer.doctor import doctor, format_doctor


def test_doctor_facts():
    d = doctor()
    assert set(d) == {"packer", "python", "pil", "pil_summary", "torch", "cuda", "triton",
                      "optional", "cores", "cpu_count"}
    assert d["packer"] == packer.__version__
    assert d["python"] == "%d.%d.%d" % sys.version_info[:3]
    assert d["pil"] == pil_info()
    assert d["torch"] == metadata.version("torch") == torch.__version__.split("+")[0]
    assert d["cuda"] is None  # not asked: torch is not imported for it
    assert (doctor(cuda=True)["cuda"] is False) == (not torch.cuda.is_available())
    assert d["triton"] is None or isinstance(d["triton"], str)
    assert set(d["optional"]) == {"torchvision", "triton", "torchdata", "matplotlib"}
    assert d["cores"] == usable_cores() and 1 <= d["cores"] <= d["cpu_count"] == os.cpu_count()


def test_format_doctor_lines():
    d = doctor()
    lines = format_doctor(d).splitlines()
    assert lines[0] == f"packer   {packer.__version__}"
    assert lines[1] == f"python   {d['python']}"
    assert lines[2] == f"PIL      {d['pil_summary']}"
    assert lines[-1] == f"cores    {d['cores']} usable of {d['cpu_count']}"
    torch_line = next(line for line in lines if line.startswith("torch    "))
    assert torch_line == f"torch    {d['torch']}; CUDA not checked (packer doctor --cuda checks it)"
    d = doctor(cuda=True)
    torch_line = next(ln for ln in format_doctor(d).splitlines() if ln.startswith("torch    "))
    assert ("CUDA not available" in torch_line) == (d["cuda"] is False)
    assert sum(line.startswith("triton   ") for line in lines) == 1


def test_format_doctor_for_other_environments():
    base = doctor()
    simd = dict(base, pil=dict(base["pil"], simd=True), cuda="NVIDIA H100", triton="3.1.0")
    text = format_doctor(simd)
    assert "torch    " in text and "CUDA available: NVIDIA H100" in text
    assert "triton   3.1.0: GPU decoding augments in one fused kernel" in text
    assert "pillow-simd" not in text  # no hint when Pillow-SIMD is there
    stock = dict(base, pil=dict(base["pil"], simd=False), cuda=False, triton=None,
                 optional={"torchvision": None, "triton": None, "torchdata": "0.11",
                           "matplotlib": None})
    text = format_doctor(stock)
    assert "CUDA not available" in text
    assert "triton   not available" in text and "pip install triton" in text
    assert ("torchvision not installed: pip install torchvision (for GPU decoding with nvJPEG, "
            "tv_tensors detection targets, bench --model)") in text.splitlines()
    assert "matplotlib not installed: pip install matplotlib (for packer bench --plot)" in text
    assert "torchdata" not in text
    bare = format_doctor(dict(stock, torch=None, pil=None, pil_summary="not installed: pip install Pillow"))
    assert "torch    not installed: pip install torch (training needs it: PackedDataset, " \
        "make_loader)" in bare.splitlines()
    assert "PIL      not installed: pip install Pillow" in bare.splitlines()
    assert ("Pillow-SIMD has SIMD resize and convert: pip uninstall -y pillow pillow-simd && "
            "CC='cc -mavx2' pip install --no-cache-dir --no-binary pillow-simd pillow-simd") in text
    # pip says pillow-simd, the imported module is stock Pillow: one line names it and the fix.
    lying = dict(base, pil=dict(base["pil"], simd=False, mismatch=True, flavour="Pillow",
                                installed=["pillow-simd 9.5.0.post1"], module="/x/PIL"))
    line = next(ln for ln in format_doctor(lying).splitlines() if "pip lists" in ln)
    assert "pip lists pillow-simd 9.5.0.post1, but the PIL imported from /x/PIL is stock Pillow" in line
    assert "fix: pip uninstall -y pillow pillow-simd" in line


def test_pil_info_judges_the_imported_module(tmp_path, monkeypatch):
    """Stock Pillow's files over Pillow-SIMD's (what installing torchvision does): pip still
    lists pillow-simd, the imported extension lacks Pillow-SIMD's SIMD kernel."""
    info = pil_info()
    assert info["simd"] == (info["simd_kernel"] or ".post" in info["version"])
    fake = tmp_path / "_imaging.so"
    fake.write_bytes(b"\x7fELF stock pillow without the kernel")
    import PIL._imaging
    monkeypatch.setattr(PIL._imaging, "__file__", str(fake))
    monkeypatch.setattr(PIL, "__version__", "12.1.1")
    stock = pil_info()
    assert stock["flavour"] == "Pillow" and not stock["simd"] and not stock["simd_kernel"]
    assert stock["mismatch"] == any("simd" in d.lower() for d in stock["installed"])


def test_packer_doctor_command():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"packer   {packer.__version__}\n")
    assert "PIL      " in result.output and "cores    " in result.output


def test_packer_doctor_json_and_no_torch():
    """``packer doctor --json`` in a fresh interpreter: one JSON object, and torch is not
    imported for it (its version comes from the package metadata)."""
    code = ("import sys, runpy; sys.argv = ['packer', 'doctor', '--json']\n"
            "try:\n    runpy.run_module('packer', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch imported' if 'torch' in sys.modules else '', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "torch imported" not in out.stderr, out.stderr
    d = json.loads(out.stdout)
    assert d["torch"] == metadata.version("torch") and d["cuda"] is None
    assert d["pil"]["flavour"] in ("Pillow", "Pillow-SIMD") and d["cores"] >= 1
