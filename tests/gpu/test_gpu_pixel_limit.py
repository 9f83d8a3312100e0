"""The GPU path's pixel limit: a JPEG header claiming more pixels than ``max_pixels`` is
refused in the DataLoader worker, from the header alone, before anything is decoded or
allocated on the GPU (issue: a 634-byte header claiming 65000 x 65000 reached nvJPEG).

The crafted file is real: a PIL-encoded 8x8 baseline JPEG whose frame header (SOF0) says
65000 x 65000. The end-to-end cases pack real JPEGs, then rewrite one record's bytes in the
shard file as a stranger's dataset could (same length; CRCs are not checked by default).
"""
import io
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from packer import PackedDataset, build
from packer.errors import FormatError
from packer.gpu import EncodedImage, GPUDecoder, GPUOptions, make_gpu_loader
from packer.gpu.encoded import gpu_decodable, jpeg_info
from packer.writing.check import DEFAULT_MAX_PIXELS

from helpers import cuda, pil_decoder

HUGE = 65000


def small_jpeg(shade: int = 0) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30 + shade, 60)).save(out, "JPEG", quality=90)
    return out.getvalue()


def crafted(data: bytes, side: int = HUGE) -> bytes:
    """``data`` with its SOF0 frame header claiming ``side`` x ``side``."""
    sof = data.index(b"\xff\xc0")  # marker, length (2), precision (1), height (2), width (2)
    return data[:sof + 5] + side.to_bytes(2, "big") * 2 + data[sof + 9:]


def test_crafted_header_is_refused_before_decoding():
    data = crafted(small_jpeg())
    assert len(data) == 634
    info = jpeg_info(data)
    assert (info.width, info.height) == (HUGE, HUGE) and gpu_decodable(info)  # nvJPEG would take it
    with pytest.raises(FormatError, match=r"header claims 65000 x 65000 = 4,225,000,000 pixels, "
                                          r"over max_pixels=89,478,485.*make_gpu_loader\(\.\.\., max_pixels=N\)"):
        EncodedImage()(data)
    assert EncodedImage().max_pixels == DEFAULT_MAX_PIXELS
    # The limit is checked from the header for every JPEG, at the caller's value.
    ok = small_jpeg()
    assert EncodedImage(max_pixels=64)(ok).data == ok
    with pytest.raises(FormatError, match="8 x 8 = 64 pixels, over max_pixels=63"):
        EncodedImage(max_pixels=63)(ok)
    # Files the worker decodes (PNG here) are held to it too, before reaching the GPU.
    png = io.BytesIO()
    Image.new("RGB", (20, 10)).save(png, "PNG")
    with pytest.raises(FormatError, match="header claims 20 x 10 = 200 pixels, over max_pixels=199"):
        EncodedImage(max_pixels=199)(png.getvalue())
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_pixels"):
            EncodedImage(max_pixels=bad)


@pytest.fixture(scope="module")
def crafted_built(tmp_path_factory):
    """A dataset of 6 real 8x8 JPEGs, the 4th rewritten on disk to claim 65000 x 65000."""
    tmp = tmp_path_factory.mktemp("crafted")
    for i in range(6):
        (tmp / "src" / "a").mkdir(parents=True, exist_ok=True)
        (tmp / "src" / "a" / f"{i}.jpg").write_bytes(small_jpeg(i))
    build(tmp / "src", tmp / "packed", workers=0, progress=False)
    victim = small_jpeg(3)
    for shard in (tmp / "packed").glob("shard-*"):
        raw = shard.read_bytes()
        if victim in raw:
            shard.write_bytes(raw.replace(victim, crafted(victim)))
    return tmp / "packed"


@pytest.fixture
def crafted_set(crafted_built, tmp_path):
    return Path(shutil.copytree(crafted_built, tmp_path / "packed"))  # see conftest's mixed



JUNK_BEFORE_FRAME = """
import io, resource, sys
from PIL import Image
from packer.errors import FormatError
from packer.gpu.encoded import EncodedImage, jpeg_info
out = io.BytesIO()
Image.new("RGB", (8, 8), (200, 30, 60)).save(out, "JPEG", quality=90)
data = out.getvalue()
sof = data.index(b"\\xff\\xc0")
data = data[:sof] + b"\\x00" + data[sof:sof + 5] + (10000).to_bytes(2, "big") * 2 + data[sof + 9:]
assert jpeg_info(data) is None and Image.open(io.BytesIO(data)).size == (10000, 10000)
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (100 << 20), hard))
try:
    EncodedImage(max_pixels=1_000_000)(data)
except FormatError as e:
    print(e)
"""


def test_a_header_packer_cannot_parse_is_held_to_the_limit_before_decoding():
    # a junk byte before the frame header (PIL skips it, packer's parser does not) sent a
    # file claiming 10000 x 10000 to a full decode (+763 MB) before the limit was checked
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", JUNK_BEFORE_FRAME], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "header claims 10000 x 10000" in r.stdout, r.stderr[-2000:]


def test_crafted_record_stops_the_loader_in_its_worker(crafted_set):
    ds = PackedDataset(crafted_set)
    assert [(jpeg_info(ds.load(i)["image"]).width) for i in range(6)] == [8, 8, 8, HUGE, 8, 8]
    ds.reader.close()
    with pytest.raises(FormatError, match="65000 x 65000.*over max_pixels"):
        for _ in make_gpu_loader(crafted_set, 2, shuffle=False, num_workers=1):
            pass
    # GPUDecoder (PIL standing in for nvJPEG): the same error, batches before it delivered.
    dec = GPUDecoder(make_gpu_loader(crafted_set, 2, shuffle=False, num_workers=0), size=8,
                     device="cpu", options=GPUOptions(decoder=pil_decoder, overlap=2))
    seen = []
    with pytest.raises(FormatError, match="65000 x 65000"):
        for _, y in dec:
            seen += y.tolist()
    assert len(seen) == 2
    # The limit is the caller's: raised, the header passes the worker (nvJPEG would then
    # refuse the truncated stream; PIL, here, too).
    loader = make_gpu_loader(crafted_set, 6, shuffle=False, num_workers=0, max_pixels=HUGE * HUGE)
    assert next(iter(loader)).sizes[3].tolist() == [HUGE, HUGE]


def test_make_gpu_loader_max_pixels(crafted_set):
    assert make_gpu_loader(crafted_set, 2, num_workers=0).dataset.decode.max_pixels == DEFAULT_MAX_PIXELS
    own = PackedDataset(crafted_set, decode=EncodedImage(max_pixels=100))
    assert make_gpu_loader(own, 2, num_workers=0).dataset is own  # its own limit kept
    other = make_gpu_loader(own, 2, num_workers=0, max_pixels=10).dataset
    assert other is not own and other.decode.max_pixels == 10 and own.decode.max_pixels == 100
    # in a Mixture, each source keeps its own (it was raised to the default)
    from packer import Mixture
    mixed = make_gpu_loader(Mixture([own, PackedDataset(crafted_set)]), 2, num_workers=0)
    assert [d.decode.max_pixels for d in mixed.dataset.sources] == [100, DEFAULT_MAX_PIXELS]
    assert mixed.dataset.sources[0] is own


@pytest.mark.gpu
@cuda
def test_gpu_crafted_header_allocates_nothing(crafted_set):
    """On a GPU: the crafted record ends the loop with FormatError and the GPU's peak memory
    stays at what the decode threads' workspaces, the five real 8x8 images and the output
    take (65 MiB measured on an H100 with two decode threads), far from the 11.8 GiB the
    header claims."""
    pytest.importorskip("triton")
    dec = GPUDecoder(make_gpu_loader(crafted_set, 2, shuffle=False, num_workers=1), size=8)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with pytest.raises(FormatError, match="65000 x 65000"):
        for _ in dec:
            pass
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() < 256 << 20
