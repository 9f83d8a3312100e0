"""A stranger's file that PIL would hand to a decoder running another program (EPS and
PostScript go through Ghostscript) never reaches it: not at build, not at verify, not at
``PackedDataset[i]``. A fake ``gs`` first on PATH records any launch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from packer import PackedDataset, build, verify
from packer.demo import make_image_folder
from packer.errors import FormatError
from packer.format.images import IMAGE_FORMATS
from packer.format.records import pack_record

from helpers import rewrite_first_record

EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\n"
       b"newpath 0 0 moveto 64 64 lineto stroke showpage\n%%EOF\n")


@pytest.fixture
def gs_trap(tmp_path, monkeypatch) -> Path:
    """A ``gs`` first on PATH (for this process and its children) that leaves a marker."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "gs-ran"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (bin_dir / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return marker


def test_build_skips_postscript_named_jpg_without_running_it(tmp_path, gs_trap):
    src = make_image_folder(tmp_path / "src", images=6, classes=2)
    (src / "class_00" / "drawing.jpg").write_bytes(EPS)
    proc = subprocess.run([sys.executable, "-m", "packer", "build", str(src), str(tmp_path / "ds"),
                           "--json", "-j", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    skipped = json.loads(proc.stdout)["skipped"]
    assert [s["path"] for s in skipped] == ["class_00/drawing.jpg"]
    assert skipped[0]["reason"].startswith("not an image packer opens")
    assert not gs_trap.exists()


def test_a_postscript_record_is_refused_at_read_and_verify(tmp_path, gs_trap):
    src = make_image_folder(tmp_path / "src", images=4, classes=2)
    ds = tmp_path / "ds"
    build(src, ds, workers=0, progress=False)
    first = PackedDataset(ds).load(0)  # the record it replaces, so only the image differs
    rewrite_first_record(ds, pack_record(EPS, path=first["path"], width=first["width"],
                                         height=first["height"], format="JPEG", mode="RGB",
                                         fields={"label": first["label"]}))
    with pytest.raises(FormatError, match="not in a format packer opens"):
        PackedDataset(ds)[0]
    rep = verify(ds, progress=False)
    assert not rep.ok and any("not an image packer opens" in p for p in rep.problems)
    assert not gs_trap.exists()


def test_the_allowed_formats_are_the_documented_ones():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text("utf-8")
    assert all(f in doc for f in IMAGE_FORMATS) and "Ghostscript" in doc
