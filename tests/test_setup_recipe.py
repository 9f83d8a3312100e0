"""The end state README.md's set-up promises: a torch + torchvision pair that import together
(torchvision's C++ ops included), Triton, and Pillow-SIMD active last — judged from the
imported module, as `packer doctor` does. On CI, after `scripts/setup.sh`, every part must
hold; elsewhere the parts that are not installed are skipped."""
from __future__ import annotations

import os

import pytest
import torch

from packer._util.system import pil_info

ON_CI = bool(os.environ.get("CI"))


def test_torch_and_torchvision_import_together():
    if not ON_CI:
        pytest.importorskip("torchvision")
    import torchvision
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]])
    keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)  # a C++ op
    assert keep.tolist() == [0, 2]
    major = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2])  # noqa: E731
    # torchvision 0.N pairs with torch 2.(N - 15): 0.29 with 2.14, 0.26 with 2.11.
    assert major(torchvision.__version__)[1] - 15 == major(torch.__version__)[1]


def test_triton_is_there():
    if not ON_CI:
        pytest.importorskip("triton")
    import triton
    assert triton.__version__


def test_pillow_simd_is_the_imported_pil():
    info = pil_info()
    if not ON_CI and not info["simd"]:
        pytest.skip("this environment runs stock Pillow (scripts/install_pillow_simd.sh)")
    assert info["simd"] and not info["mismatch"], info
    assert info["simd_kernel"] or ".post" in info["version"]
