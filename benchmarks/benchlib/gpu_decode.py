"""The GPU-decode benchmark's data and its decode-side sections (``benchlib.gpu``): the
CPU path, nvJPEG alone, the batched augment alone, the whole GPUDecoder pipeline, its
settings, baseline vs progressive JPEGs, and pixel agreement with PIL.
"""
from __future__ import annotations

import functools
import io
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Dict

import torch

from packer.writing.builder import build
from packer.writing.check import Transcode
from packer.reading.dataset import PackedDataset
from packer.transforms.decode import DecodeCenterCrop, DecodeRandomResizedCrop, image_to_tensor, open_image
from packer.demo import load_photos, make_image, make_image_folder
from packer.gpu import make_gpu_loader
from packer.gpu.augment import center_crop_boxes, random_resized_crop_boxes
from packer.gpu.nvjpeg import NvjpegDecoder
from packer.gpu.resample import CONFIG, ImageTable, resample_crops
from packer.loading.loader import make_loader
from benchlib.gpu_common import GPUBench, JpgSampler, decoder_passes, encoded_views, epochs_rate, gpu_time, median_rate, new_decoder, preload

__all__ = ["agreement", "augment_only", "cpu_path", "decode_only", "decode_parallel",
           "make_data", "make_folder", "pipeline", "pipeline_gpu_time", "pipeline_variants",
           "progressive_vs_baseline"]


# -- data --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _photos():
    return load_photos()


def _one_thread():
    torch.set_num_threads(1)  # 16 processes x 16 OpenMP threads each would thrash


def _make(job) -> None:
    path, seed, i = job  # make_image_folder's seed per image: the same bytes
    Path(path).write_bytes(make_image(random.Random(seed * 1_000_003 + i), _photos()))


def make_folder(b: GPUBench, root: Path, images: int, classes: int, cpus: int, seed: int = 0):
    """``make_image_folder``'s files (same names and bytes), made by a fork pool of
    single-threaded processes, with progress."""
    import multiprocessing as mp
    make_image_folder(root, images=0, classes=classes)  # the class folders
    jobs = [(str(root / f"class_{i % classes:02d}" / f"img_{i:05d}.jpg"), seed, i)
            for i in range(images)]
    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(cpus, initializer=_one_thread) as pool:
        for k, _ in enumerate(pool.imap_unordered(_make, jobs, chunksize=32), 1):
            if k % 2048 == 0:
                b.log(f"   {k} images, {k / (time.perf_counter() - t0):.0f}/s")


def make_data(b: GPUBench) -> Dict[str, Path]:
    """ImageNet-like JPEGs under ``root/src``, packed as stored and transcoded (made once)."""
    a = b.a
    root = Path(a.root)
    src = root / "src"
    sets = {"stored": root / "stored", "max512": root / "max512", "short256": root / "short256"}
    if not (src / ".done").exists():
        t0 = time.perf_counter()
        make_folder(b, src, a.images, a.classes, a.cpus)
        (src / ".done").write_text("")
        b.log(f"   made {a.images} JPEGs in {time.perf_counter() - t0:.1f} s")
    opts = {"stored": None, "max512": Transcode(max_side=512, quality=90),
            "short256": Transcode(short_side=256, quality=90)}
    for name, dst in sets.items():
        if (dst / "manifest.json").exists():
            continue
        r = build(src, dst, workers=a.cpus, progress=False, transcode=opts[name])
        b.log(f"   {name}: {r.summary()}")
    info = {}
    for name, dst in sets.items():
        m = json.loads((dst / "manifest.json").read_text())
        info[name] = {"bytes_per_image": m["bytes"] / m["count"], "count": m["count"]}
    b.results["data"] = info
    b.log(f"   {info}")
    return sets


# -- sections ----------------------------------------------------------------------------------

def cpu_path(b: GPUBench, path: Path) -> None:
    """Pillow in DataLoader workers on all cores, train and eval."""
    a = b.a
    for train in (True, False):
        dec = DecodeRandomResizedCrop(224) if train else DecodeCenterCrop(224)
        loader = make_loader(PackedDataset(path, decode=dec), a.batch, num_workers=a.cpus,
                             drop_last=True, pin_memory=False)
        rate, rates = epochs_rate(lambda e, ld=loader: ld, torch.device("cpu"), a.epochs)
        mode = "train (RandomResizedCrop+flip)" if train else "eval (resize+center crop)"
        b.results[f"cpu_{'train' if train else 'eval'}"] = rates
        b.row("1", f"CPU path, Pillow in {a.cpus} workers, {mode}", rate, b.pil.split(",")[0])
        del loader  # its workers end before the next loader's start


def decode_only(b: GPUBench, name: str, loader) -> list:
    """Each decoder on batches kept in memory; returns those batches."""
    batches = preload(loader, b.a.preload)
    views = [encoded_views(x) for x in batches]
    images = sum(len(v) for v in views)
    for dname, decoder in b.decoders.items():
        run = lambda: [decoder(v, b.dev) for v in views]  # noqa: E731
        run()
        with JpgSampler(b.dev) as js:
            rate, rates = median_rate(run, images, b.a.repeats, b.dev)
        b.results[f"decode_only_{name}_{dname}"] = {"rates": rates, "nvml": js.summary()}
        b.row("2" if name == "stored" else "4", f"decode only ({dname}), batches in memory [{name}]",
              rate, f"JPG engine util max/mean {js.summary()['jpg_max_mean']}")
    return batches


def decode_parallel(b: GPUBench, name: str, batches, threads=(1, 2, 3)) -> None:
    """NvjpegDecoder instances (one handle each) decoding in-memory batches from several
    threads at once: does a second handle overlap one batch's host work with another's?"""
    dev = b.dev
    views = [encoded_views(x) for x in batches]
    per = sum(len(v) for v in views)
    for n in threads:
        decs = [NvjpegDecoder.shared(dev, k) for k in range(n)]

        def work(d):
            with torch.cuda.stream(torch.cuda.Stream(dev)):
                for v in views:
                    d(v, dev)

        def run():
            ts = [threading.Thread(target=work, args=(d,)) for d in decs]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        run()
        with JpgSampler(dev) as js:
            rate, rates = median_rate(run, per * n, b.a.repeats, dev)
        b.results[f"decode_parallel_{name}_{n}"] = {"rates": rates, "nvml": js.summary()}
        b.row("2c", f"decode only, {n} NvjpegDecoder thread(s) at once [{name}]", rate,
              f"JPG engine util max/mean {js.summary()['jpg_max_mean']}")


def _tiles(dev: torch.device) -> list:
    """The kernel's launch shapes to compare (None: the CPU reference, in a dry run)."""
    if dev.type != "cuda":
        return [None]
    return [{"rows": 8, "num_warps": 4}, {"rows": 4, "num_warps": 4}, {"rows": 8, "num_warps": 2},
            {"rows": 16, "num_warps": 4}]


def augment_only(b: GPUBench, name: str, batches, decoder) -> None:
    """The batched crop+resize+flip+normalize alone on decoded batches in memory, per tile
    shape of the fused kernel: images/s, and the GPU time it takes from the GPU per batch
    (kernel time summed by the profiler: what a training step beside it loses)."""
    dev = b.dev
    tables = [ImageTable.from_images(decoder(encoded_views(x), dev)) for x in batches[:4]]
    scale = torch.ones(1, 3, 1, 1, device=dev)
    shift = scale * 0
    default = dict(CONFIG)
    for train in (True, False):
        for cfg in _tiles(dev):
            CONFIG.update(cfg or {})
            g = torch.Generator().manual_seed(0)

            def run():
                for tab in tables:
                    boxes = random_resized_crop_boxes(tab.sizes, generator=g) if train else \
                        center_crop_boxes(tab.sizes, (224, 224))
                    flips = torch.rand(len(tab), generator=g) < 0.5 if train else None
                    out = torch.empty(len(tab), 3, 224, 224, dtype=torch.bfloat16, device=dev,
                                      memory_format=torch.channels_last)
                    resample_crops(tab, boxes, (224, 224), flips, out=out, scale=scale, shift=shift)
            run()
            rate, rates = median_rate(run, sum(len(t) for t in tables), b.a.repeats, dev)
            gpu_ms = gpu_time(run, dev) / len(tables)
            CONFIG.clear()
            CONFIG.update(default)
            label = f"kernel rows={cfg['rows']} warps={cfg['num_warps']}" if cfg else "CPU reference"
            mode = "train" if train else "eval"
            b.results[f"augment_only_{name}_{mode}_{label}"] = {"rates": rates, "gpu_ms_per_batch": gpu_ms}
            b.row("3a", f"crop+resize+flip+normalize only, {label}, {mode} [{name}]",
                  rate, f"GPU time {gpu_ms:.2f} ms/batch")


def pipeline_gpu_time(b: GPUBench, name: str, batches) -> None:
    """GPU time per batch of the whole GPU stage (nvJPEG + augment): the share of a
    training step's GPU that decoding beside it takes."""
    g = new_decoder(b, [], {}, backend="nvjpeg", overlap=0)
    run = lambda: [g.augment_batch(g.decode_batch(x), 0) for x in batches[:4]]  # noqa: E731
    run()
    ms = gpu_time(run, b.dev) / 4
    b.results[f"gpu_time_{name}"] = ms
    b.row("3g", f"GPU time of decode+augment per batch of {b.a.batch} [{name}]",
          1e3 * b.a.batch / ms, f"{ms:.2f} ms/batch of GPU work (images/s if alone on the GPU)")


def _ms_per_batch(g) -> dict:
    return {k: f"{1e3 * v / g.stats.batches:.1f}" for k, v in g.stats.seconds.items()}


def pipeline(b: GPUBench, name: str, loader, decoder, overlaps=(0, 1, 2), modes=(True, False),
             dname: str = "") -> None:
    """GPUDecoder inline, in one thread and in two threads with streams; train and eval."""
    pinned = getattr(loader, "pin_memory", False)
    for train in modes:
        for overlap in overlaps:
            g = new_decoder(b, loader, {}, train=train, overlap=overlap, decoder=decoder)
            with JpgSampler(b.dev) as js:
                rate, rates = epochs_rate(decoder_passes(g), b.dev, b.a.epochs)
            mode = "train" if train else "eval"
            key = f"pipeline_{name}_{mode}_overlap{overlap}_pin{int(pinned)}_{dname}"
            b.results[key] = {"rates": rates, "stats": g.stats.as_dict(), "nvml": js.summary()}
            what = {0: "inline", 1: "1 thread", 2: "2 threads+streams"}[overlap]
            what += (", loader pinned" if pinned else "") + (f", {dname}" if dname else "")
            b.row("3" if name == "stored" else "4", f"GPUDecoder {mode}, {what} [{name}]", rate,
                  f"ms/batch {_ms_per_batch(g)}; JPG util max/mean {js.summary()['jpg_max_mean']}")


def pipeline_variants(b: GPUBench, name: str, path: Path, variants, train: bool = True) -> None:
    """GPUDecoder with other settings (``decode_threads``, backend), each on a fresh loader
    (no worker state shared between rows). Variants are (label, GPUDecoder/GPUOptions
    keyword arguments, with "loader": make_gpu_loader's)."""
    import gc
    mode = "train" if train else "eval"
    for label, kw in variants:
        gc.collect()  # nothing of the last row left to be collected in a forked worker
        g = new_decoder(b, path, kw, train=train)
        with JpgSampler(b.dev) as js:
            rate, rates = epochs_rate(decoder_passes(g), b.dev, b.a.epochs)
        b.results[f"variant_{name}_{mode}_{label}"] = {
            "rates": rates, "stats": g.stats.as_dict(), "nvml": js.summary(), "kwargs": repr(kw)}
        b.row("7", f"GPUDecoder {mode}, {label} [{name}]", rate,
              f"{g.backend}; ms/batch {_ms_per_batch(g)}; JPG util {js.summary()['jpg_max_mean']}")


def progressive_vs_baseline(b: GPUBench, path: Path, decoder) -> None:
    """torchvision decodes baseline JPEGs in one batched call (hardware engine where there is
    one) and others one by one, Huffman on the CPU: the gap shows which path ran."""
    from PIL import Image
    ds = PackedDataset(path)
    base, prog = [], []
    for i in range(min(b.a.batch, len(ds))):
        data = ds.load(i)["image"]
        out = io.BytesIO()
        Image.open(io.BytesIO(data)).save(out, "JPEG", quality=90, progressive=True)
        base.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        prog.append(torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8))
    ds.reader.close()
    for name, batch in (("baseline", base), ("progressive", prog)):
        decoder(batch, b.dev)
        rate, rates = median_rate(lambda: decoder(batch, b.dev), len(batch), b.a.repeats, b.dev)
        b.results[f"torchvision_{name}"] = rates
        b.row("5", f"decode_jpeg batch of {len(batch)} {name} JPEGs (1 call)", rate)


def _abs_diff(diffs) -> dict:
    d = torch.stack(diffs)
    return {"max_abs": int(d.max()), "mean_abs": float(d.float().mean())}


def agreement(b: GPUBench, path: Path) -> None:
    """nvJPEG pixels vs PIL's full decode; eval output vs the CPU decoders; labels."""
    from PIL import Image
    ds = PackedDataset(path)
    n = min(b.a.batch, len(ds))
    datas = [ds.load(i)["image"] for i in range(n)]
    refs = [image_to_tensor(open_image(data)) for data in datas]
    dec = {}
    for dname, decoder in b.decoders.items():
        out = decoder([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas], b.dev)
        diffs = [(o.cpu().int() - r.int()).abs() for o, r in zip(out, refs)]
        dec[dname] = {"max_abs": max(int(d.max()) for d in diffs), "images": n,
                      "mean_abs": statistics.mean(float(d.float().mean()) for d in diffs)}
    decoder = next(iter(b.decoders.values()))
    # Eval pipeline (uint8) vs DecodeCenterCrop (draft decode) and vs PIL full decode + same box.
    loader = make_gpu_loader(ds, 64, shuffle=False, num_workers=0)
    g = new_decoder(b, loader, {}, train=False, dtype=torch.uint8, seed=None, decoder=decoder,
                    overlap=0)
    labels, d_draft, d_full, k = [], [], [], 0
    ref_dec = DecodeCenterCrop(224)
    for x, y in g:
        labels += y.tolist()
        for j in range(min(len(y), max(0, n - k))):
            data = ds.load(k + j)["image"]
            d_draft.append((x[j].cpu().int() - ref_dec(data).int()).abs())
            im = open_image(data)
            r = im.resize((224, 224), Image.BILINEAR, box=ref_dec.box(*im.size), reducing_gap=None)
            d_full.append((x[j].cpu().int() - image_to_tensor(r).int()).abs())
        k += len(y)
    res = {"decoder_vs_pil_full_decode": dec,
           "eval_vs_pil_full_decode_same_resize": _abs_diff(d_full),
           "eval_vs_DecodeCenterCrop_draft": _abs_diff(d_draft),
           "labels_match": labels == ds.targets, "stats": g.stats.as_dict()}
    b.results["agreement"] = res
    b.log(f"   {json.dumps(res)}")
