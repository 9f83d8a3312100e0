"""What ``benchmarks/bench_peers.py`` measures: packer's ``make_loader`` against the loaders users
compare it with, over the same stored JPEG bytes with the same per-sample work, in one run.

Every loader hands the stored bytes of each image to the same ``DecodeRandomResizedCrop``
(decode + crop + flip to a 224 px uint8 tensor) and batches W workers' samples, so what
differs is only the loader: how it stores, finds, reads and ships samples. The peers, each
written the way its own documentation shows, skipped (with the reason) where not installed:

- naive LMDB: one LMDB file of ``index -> JPEG bytes``, a map-style Dataset opening it lazily
  per worker, torch's DataLoader with ``shuffle=True`` and ``default_collate``;
- WebDataset: tar shards written by ``webdataset.ShardWriter`` (at least 4 per worker),
  ``WebDataset(shardshuffle=...).shuffle(1000)``, batched in the workers, ``WebLoader``;
- LitData: chunks written by ``litdata.optimize``, ``StreamingDataset(shuffle=True)``,
  ``StreamingDataLoader``;
- FFCV: the same JPEG bytes stored in an ``RGBImageField`` (FFCV's writer would re-encode
  them; the field is handed the bytes instead), read by FFCV's ``Loader`` with its own
  native pipeline — ``RandomResizedCropRGBImageDecoder`` (libjpeg-turbo + OpenCV, compiled
  by numba), ``RandomHorizontalFlip``, uint8 NCHW tensors — the one peer whose per-sample
  work is not packer's decoder: FFCV's pipeline is its reason to exist.

Rates are steady-state images/s (``efficiency.steady_rate``), rounds interleaved, medians reported.
"""
from __future__ import annotations

import io
import os
import statistics
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from torch.utils.data import DataLoader, Dataset

from packer.reading.dataset import PackedDataset
from packer.transforms.decode import DecodeRandomResizedCrop
from packer.loading.loader import make_loader
from packer.reading.sampler import PackedSampler
from packer.bench.efficiency import steady_rate

__all__ = ["PEERS", "bench_peers", "peers_table"]

PACKER = "packer: PackedDataset + make_loader"


# -- the peers --------------------------------------------------------------------------------

class NaiveLMDB(Dataset):
    """``index -> JPEG bytes`` in one LMDB file, labels in a list; opened per process."""

    def __init__(self, path: str, labels: List[int], decode: Callable):
        self.path, self.labels, self.decode, self.env = path, labels, decode, None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        if self.env is None:
            import lmdb
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False,
                                 subdir=False)
        with self.env.begin() as txn:
            data = txn.get(b"%08d" % i)
        return self.decode(data), self.labels[i]


def write_naive_lmdb(items: Sequence[Tuple[bytes, int]], tmp: Path) -> dict:
    import lmdb
    path = str(tmp / "naive.lmdb")
    size = sum(len(b) for b, _ in items) * 2 + (64 << 20)
    env = lmdb.open(path, map_size=size, subdir=False)
    with env.begin(write=True) as txn:
        for i, (data, _) in enumerate(items):
            txn.put(b"%08d" % i, data)
    env.close()
    return {"path": path, "labels": [y for _, y in items]}


def naive_lmdb_loader(state: dict, decode, batch_size: int, workers: int):
    return DataLoader(NaiveLMDB(state["path"], state["labels"], decode), batch_size=batch_size,
                      shuffle=True, num_workers=workers)


def write_webdataset(items: Sequence[Tuple[bytes, int]], tmp: Path, workers: int) -> dict:
    import webdataset as wds
    folder = tmp / "wds"
    folder.mkdir()
    shards = max(4 * max(1, workers), 1)
    per = -(-len(items) // shards)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=per, verbose=0) as sink:
        for i, (data, label) in enumerate(items):
            sink.write({"__key__": f"{i:08d}", "jpg": data, "cls": label})
    return {"urls": sorted(str(p) for p in folder.glob("*.tar"))}


class Decoded:
    """A peer's sample (a dict of the stored bytes and label) -> (decoded tensor, label)."""

    def __init__(self, decode: Callable, image: str, label: str):
        self.decode, self.image, self.label = decode, image, label

    def __call__(self, s: dict):
        return self.decode(s[self.image]), int(s[self.label])


def webdataset_loader(state: dict, decode, batch_size: int, workers: int):
    import webdataset as wds
    ds = (wds.WebDataset(state["urls"], shardshuffle=len(state["urls"]), empty_check=False)
          .shuffle(1000).map(Decoded(decode, "jpg", "cls")).batched(batch_size, partial=True))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers)


def write_litdata(items: Sequence[Tuple[bytes, int]], tmp: Path, workers: int) -> dict:
    import litdata
    out = str(tmp / "litdata")
    litdata.optimize(fn=_LitItem(items), inputs=list(range(len(items))), output_dir=out,
                     chunk_bytes="64MB", num_workers=1, verbose=False, start_method="fork")
    return {"dir": out}


class _LitItem:
    def __init__(self, items):
        self.items = items

    def __call__(self, i):
        data, label = self.items[i]
        return {"image": data, "label": label}


def litdata_loader(state: dict, decode, batch_size: int, workers: int):
    import litdata
    ds = litdata.StreamingDataset(state["dir"], shuffle=True,
                                  transform=Decoded(decode, "image", "label"))
    return litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers)


def write_ffcv(items: Sequence[Tuple[bytes, int]], tmp: Path, workers: int) -> dict:
    import types
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from PIL import Image
    field = RGBImageField(write_mode="jpg")
    field.encode = types.MethodType(_store_jpeg, field)  # the stored bytes, not re-encoded
    sized = [((data, Image.open(io.BytesIO(data)).size), label) for data, label in items]
    path = str(tmp / "ffcv.beton")
    DatasetWriter(path, {"image": field, "label": IntField()},
                  num_workers=1).from_indexed_dataset(sized)
    return {"path": path}


def _store_jpeg(field, destination, item, malloc) -> None:
    """``RGBImageField.encode`` for ``(JPEG bytes, (width, height))``: stored as they are."""
    import numpy as np
    data, (w, h) = item
    destination["mode"] = 0  # FFCV's IMAGE_MODES["jpg"]
    destination["height"], destination["width"] = h, w
    destination["data_ptr"], storage = malloc(len(data))
    storage[:] = np.frombuffer(data, dtype=np.uint8)


def ffcv_loader(state: dict, decode, batch_size: int, workers: int):
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
    pipelines = {"image": [RandomResizedCropRGBImageDecoder(decode.size), RandomHorizontalFlip(),
                           ToTensor(), ToTorchImage()],
                 "label": [IntDecoder(), ToTensor(), Squeeze(-1)]}
    return Loader(state["path"], batch_size=batch_size, num_workers=workers,
                  order=OrderOption.RANDOM, pipelines=pipelines, os_cache=True)


# name -> (module it needs, writer(items, tmp, workers) -> state, loader(state, decode, batch, workers))
PEERS: Dict[str, Tuple[str, Callable, Callable]] = {
    "naive LMDB + DataLoader": ("lmdb", lambda items, tmp, w: write_naive_lmdb(items, tmp),
                                naive_lmdb_loader),
    "WebDataset + WebLoader": ("webdataset", write_webdataset, webdataset_loader),
    "LitData StreamingDataset + StreamingDataLoader": ("litdata", write_litdata, litdata_loader),
    "FFCV Loader, its own RandomResizedCrop pipeline": ("ffcv", write_ffcv, ffcv_loader),
}


def _installed(module: str) -> Optional[str]:
    try:
        __import__(module)
        return None
    except ImportError as e:
        return f"not installed ({e})"


def packer_loader(ds: PackedDataset, batch_size: int, workers: int):
    """packer's training path: ``make_loader`` over a ``PackedSampler`` (random order, its
    workers running on across epochs)."""
    return make_loader(ds, batch_size, sampler=PackedSampler(ds), num_workers=workers,
                       pin_memory=False, persistent_workers=False)


def bench_peers(root: os.PathLike, tmp: Path, *, workers: int, batch_size: int = 64,
                rounds: int = 5, size: int = 224,
                log: Callable[[str], None] = print) -> dict:
    """Write packed dataset ``root``'s stored image bytes into each peer's format under
    ``tmp``, then time every loader ``rounds`` times, interleaved. Returns ``rows`` (name ->
    images/s per round, packer first), ``skipped`` (name -> reason), ``workers``, ``images``."""
    decode = DecodeRandomResizedCrop(size)
    ds = PackedDataset(root, decode=decode)
    items = [(ds.load(i)["image"], int(ds.target(i))) for i in range(len(ds))]
    ds.reader.close()
    loaders: Dict[str, Callable[[], Iterable]] = {PACKER: lambda: packer_loader(
        PackedDataset(root, decode=decode), batch_size, workers)}
    skipped: Dict[str, str] = {}
    for name, (module, write, loader) in PEERS.items():
        reason = _installed(module)
        if reason:
            skipped[name] = reason
            continue
        state = write(items, tmp, workers)
        loaders[name] = (lambda loader=loader, state=state:
                         loader(state, decode, batch_size, workers))
    rows: Dict[str, List[float]] = {name: [] for name in loaders}
    for r in range(rounds):
        for name, make in loaders.items():
            rows[name].append(steady_rate(make(), workers))
            log(f"round {r + 1}/{rounds}: {name}: {rows[name][-1]:,.0f} images/s")
    return {"rows": rows, "skipped": skipped, "workers": workers, "images": len(items),
            "batch_size": batch_size}


def peers_table(res: dict) -> str:
    """Markdown: median images/s, spread, and packer's rate over each loader's."""
    rows = res["rows"]
    ours = statistics.median(rows[PACKER])
    lines = [f"| loader ({res['workers']} workers, batch {res['batch_size']}) | images/s "
             f"(median) | spread | packer / this |", "|---|---:|---|---:|"]
    for name, vals in rows.items():
        med = statistics.median(vals)
        lines.append(f"| {name} | {med:,.0f} | {min(vals):,.0f}-{max(vals):,.0f} | "
                     f"{ours / med:.2f}x |")
    for name, reason in res["skipped"].items():
        lines.append(f"| {name} | skipped: {reason} | | |")
    return "\n".join(lines)

