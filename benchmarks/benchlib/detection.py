"""What ``benchmarks/bench_detection.py`` measures: detection input, packed against a COCO folder.

Sections, each in interleaved rounds (drift on a shared machine hits every variant alike),
reported as medians with ratios to a baseline measured in the same run:

* ``cpu``: DataLoader images/s over generated COCO scenes (``make_detection_folder``).
  The fair pair: both sides produce ``size`` x ``size`` letterboxed uint8 images with their
  boxes moved, through the same DataLoader settings (workers, batch, collate, no pinning).
  The folder baseline is ``torchvision.datasets.CocoDetection`` +
  ``wrap_dataset_for_transforms_v2`` with ``v2.Compose([v2.ToImage(), v2.Resize(None,
  max_size=size), v2.CenterCrop(size)])`` (a letterbox: fit, then pad) where torchvision
  and pycocotools import, else ``CocoFolderDataset`` (the output says which). The packed
  rows: ``PackedDataset(decode=DecodeLetterbox(size))`` (packer's fused decode) and, with
  torchvision, ``PackedDataset(transforms=<the same v2>)`` (only the bytes' source differs).
  ``CocoFolderDataset`` with ``DecodeLetterbox`` is always measured too. In RAM the page
  cache is warm; ``slow_disk`` reads each pass cold in a fresh process under ``SlowDisk``
  (root only), packed in ``PackedSampler(order="block")``, the folder in random order.
* ``build``: ``packer build --coco`` images/s against ``--list`` (label 0) of the same images.
* ``gpu`` (CUDA + torchvision): an SSDlite320-MobileNetV3 training step (bf16 autocast, SGD)
  fed by the CPU path (``DecodeLetterbox`` + ``make_loader`` + ``CUDAPrefetcher``) and the
  GPU path (``GPUDecoder(letterbox=True)``), as fractions of the same step on one batch
  kept on the GPU; and ``GPUDecoder`` alone (RandomResizedCrop + flip, and letterbox).
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import torch

from packer._util.system import pil_summary
from packer.writing.builder import build
from packer.sources import Coco
from packer.loading.loader import default_num_workers
from packer.bench.coldread import drop_page_cache, storage
from benchlib.slowdisk import SlowDisk
from benchlib.detectionbuild import add_rows, build_section
from benchlib.gpu_common import pil_decoder, sync

__all__ = ["DetectionBenchOptions", "SECTIONS", "bench_detection", "detection_table",
           "loader_pass", "torchvision_baseline"]

SECTIONS = ("cpu", "slow-disk", "build", "gpu")
Log = Callable[[str], None]


@dataclass
class DetectionBenchOptions:
    """``benchmarks/bench_detection.py``'s options."""
    images: int = 2000
    workers: int = field(default_factory=default_num_workers)
    rounds: int = 5
    batch_size: int = 32
    size: int = 640            # the CPU sections' letterbox
    gpu_size: int = 320        # SSDlite320's input, and the GPU decode rows'
    gpu_batch: int = 32
    steps: int = 20            # timed steps (batches) per variant and round in ``gpu``
    warmup: int = 5
    root: Optional[str] = None  # where the data is made (the disk --slow-disk throttles)
    iops: int = 400
    bps: int = 100 << 20
    seed: int = 0
    dry_run: bool = False      # gpu on the CPU, PIL in nvJPEG's place: checks the code only
    decode_threads: Optional[int] = None  # GPUOptions(decode_threads=...) of the GPU path


def torchvision_baseline() -> bool:
    """True where ``CocoDetection`` can run: torchvision and pycocotools import."""
    return all(importlib.util.find_spec(m) is not None for m in ("torchvision", "pycocotools"))


def bench_detection(sections, opts: DetectionBenchOptions = DetectionBenchOptions(),
                    log: Log = print) -> dict:
    """Make ``opts.images`` scenes under ``opts.root`` (default: a temporary folder, removed),
    build them once (``Coco``), run ``sections`` (names from ``SECTIONS``) and return
    ``{"options", "environment", "rows": [...], "notes": [...]}``."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if "gpu" in sections and not opts.dry_run:
        from packer.gpu import reserve_cuda_queues
        reserve_cuda_queues()  # before anything starts CUDA in this process
    tmp = Path(tempfile.mkdtemp(prefix="packer-bench-det-", dir=opts.root))
    out = {"options": asdict(opts), "environment": {"pil": pil_summary(), "storage": storage(tmp),
           "baseline": "torchvision CocoDetection" if torchvision_baseline()
           else "CocoFolderDataset (torchvision or pycocotools missing)"}, "rows": [], "notes": []}
    try:
        from packer.demo.scenes import make_detection_folder
        t = time.perf_counter()
        coco = make_detection_folder(tmp / "coco", opts.images, seed=opts.seed)
        packed = build(Coco(coco / "images", coco / "annotations.json"), tmp / "packed",
                       workers=opts.workers, progress=False).manifest
        log(f"made and built {packed['count']} scenes in {time.perf_counter() - t:.1f} s "
            f"under {tmp} ({out['environment']['storage']}); baseline: "
            f"{out['environment']['baseline']}")
        runs = {"cpu": lambda: cpu_section(coco, tmp / "packed", opts, out, log),
                "slow-disk": lambda: slow_disk_section(coco, tmp / "packed", opts, out, log),
                "build": lambda: build_section(coco, tmp, opts, out, log),
                "gpu": lambda: gpu_section(tmp / "packed", opts, out, log)}
        for name in SECTIONS:
            if name not in sections:
                continue
            try:  # one failing section must not cost the others' results
                runs[name]()
            except Exception as e:
                out["notes"].append(f"{name} failed: {type(e).__name__}: {e}")
                log(f"{name} failed:\n{traceback.format_exc()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def v2_letterbox(size: int):
    """torchvision's v2 letterbox: longer side to ``size``, then padded to a square (boxes move)."""
    from torchvision.transforms import v2
    return v2.Compose([v2.ToImage(), v2.Resize(None, max_size=size), v2.CenterCrop(size)])


def loader_dataset(spec: dict):
    """(dataset, sampler) for a variant ``spec``: ``kind`` (packed / coco-folder /
    torchvision), ``decode`` (letterbox: DecodeLetterbox, v2: ``v2_letterbox``), ``order``."""
    from packer.reading.dataset import PackedDataset
    from packer.transforms.decode import DecodeLetterbox
    from packer.demo.folder import CocoFolderDataset
    from packer.reading.sampler import PackedSampler
    size, kind = spec["size"], spec["kind"]
    fused = spec["decode"] == "letterbox"
    decode, transforms = (DecodeLetterbox(size), None) if fused else (None, v2_letterbox(size))
    if kind == "packed":
        ds = PackedDataset(spec["root"], decode=decode, transforms=transforms)
        return ds, PackedSampler(ds, seed=spec["seed"], order=spec.get("order", "random"))
    images, ann = Path(spec["root"]) / "images", Path(spec["root"]) / "annotations.json"
    if kind == "coco-folder":
        return CocoFolderDataset(images, ann, decode=decode, transforms=transforms), None
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools' progress lines
        ds = CocoDetection(str(images), str(ann), transforms=transforms)
    return wrap_dataset_for_transforms_v2(ds, target_keys={"boxes", "labels", "image_id",
                                                           "area", "iscrowd"}), None


def loader_pass(spec: dict, batch_size: int, workers: int) -> float:
    """images/s of one epoch of ``spec``'s loader after its first wave of batches (module
    level: ``SlowDisk.run`` calls it in a fresh process inside the throttled cgroup)."""
    from packer.demo.detection import detection_loader
    from packer.demo.run import loader_rate
    ds, sampler = loader_dataset(spec)
    ds[0]  # the target's types imported here before timing (torchvision: ~2 s in a fresh
    # process, during which the workers ran ahead and the timed rest looked 3x too fast)
    loader = detection_loader(ds, batch_size, workers, sampler=sampler, pin_memory=False,
                              shuffle=None if sampler is not None else True)
    n, sec = loader_rate(loader, workers)
    return n / sec


def cpu_variants(coco: Path, packed: Path, opts: DetectionBenchOptions,
                 slow: bool) -> Dict[str, dict]:
    """The loaders compared, by row name; the baseline (``torchvision`` or ``coco-folder``,
    random order) first."""
    base = {"size": opts.size, "seed": opts.seed}
    folder = dict(base, root=str(coco), decode="letterbox", kind="coco-folder")
    rows = {}
    if torchvision_baseline():
        rows["folder: torchvision CocoDetection + v2 letterbox"] = dict(folder, kind="torchvision",
                                                                         decode="v2")
    rows["folder: CocoFolderDataset + DecodeLetterbox"] = folder
    pk = dict(base, root=str(packed), kind="packed", decode="letterbox")
    rows["packed: DecodeLetterbox"] = pk
    if slow:
        rows["packed: DecodeLetterbox, block order"] = dict(pk, order="block")
        return {k: v for k, v in rows.items() if not k.startswith("folder: Coco") or
                not torchvision_baseline()}
    if torchvision_baseline():
        rows["packed: the same v2 letterbox"] = dict(pk, decode="v2")
    return rows


def cpu_section(coco: Path, packed: Path, opts: DetectionBenchOptions, out: dict, log: Log) -> None:
    """Loaders over warm data: one untimed pass each, then ``rounds`` interleaved passes."""
    variants = cpu_variants(coco, packed, opts, slow=False)
    for spec in variants.values():
        loader_pass(spec, opts.batch_size, opts.workers)   # fills the page cache
    runs = {name: [] for name in variants}
    for r in range(opts.rounds):
        for name, spec in variants.items():
            runs[name].append(loader_pass(dict(spec, seed=opts.seed + r), opts.batch_size,
                                          opts.workers))
            log(f"cpu round {r + 1}/{opts.rounds}: {name}: {runs[name][-1]:,.0f} images/s")
    add_rows(out, "cpu (warm cache)", runs, next(iter(variants)), "x")


def slow_disk_section(coco: Path, packed: Path, opts: DetectionBenchOptions, out: dict,
                      log: Log) -> None:
    """Each pass from a cold cache, in a fresh process under the block-I/O throttle; skipped
    (with the reason in ``notes``) where no throttle can be set up (not root, no cgroup,
    data on a RAM filesystem)."""
    with SlowDisk(packed, opts.iops, opts.bps) as disk:
        if not disk.throttled:
            note = (f"slow-disk skipped: {disk.how} (run as root, with --root on a block "
                    f"device)")
            out["notes"].append(note)
            log(note)
            return
        out["environment"]["throttle"] = disk.how
        variants = cpu_variants(coco, packed, opts, slow=True)
        files = {name: [p for p in Path(spec["root"]).rglob("*") if p.is_file()]
                 for name, spec in variants.items()}
        runs = {name: [] for name in variants}
        for r in range(opts.rounds):
            for name, spec in variants.items():
                # The data's pages only: dropping everything would also evict the libraries
                # the pass then pages in from the throttled disk.
                out["environment"]["cache"] = drop_page_cache(files[name], everything=False)
                runs[name].append(disk.run(loader_pass, dict(spec, seed=opts.seed + r),
                                           opts.batch_size, opts.workers))
                log(f"slow-disk round {r + 1}/{opts.rounds}: {name}: {runs[name][-1]:,.0f} "
                    f"images/s")
    add_rows(out, "cpu (slow disk, cold)", runs, next(iter(variants)), "x")


def detection_table(out: dict) -> str:
    """The rows as a markdown table: ratios as ``1.23x`` or, for the GPU section, percent
    of the resident-batch step."""
    rounds = out["options"]["rounds"]
    lines = [f"| section | variant | images/s (median of {rounds}) | spread | vs baseline |",
             "|---|---|---:|---|---:|"]
    for r in out["rows"]:
        v = r["values"]
        ratio = (f"{r['ratio']:.1%}" if r["unit"] == "%" else f"{r['ratio']:.2f}x")
        ratio = "baseline" if r["baseline"] else ratio
        lines.append(f"| {r['section']} | {r['name']} | {r['images_per_s']:,.0f} | "
                     f"{min(v):,.0f}-{max(v):,.0f} | {ratio} |")
    env = out["environment"]
    more = "".join(f"; {k}: {env[k]}" for k in ("throttle", "cache", "gpu") if k in env)
    lines.append(f"\nfolder baseline: {env['baseline']}; PIL: {env['pil']}; data on "
                 f"{env['storage']}{more}")
    lines += [f"note: {n}" for n in out["notes"]]
    return "\n".join(lines)


def write_json(out: dict, path: os.PathLike) -> None:
    Path(path).write_text(json.dumps(out, indent=1, default=str))


def gpu_section(packed: Path, opts: DetectionBenchOptions, out: dict, log: Log) -> None:
    """SSDlite320 steps fed by each path against a resident batch, and GPUDecoder alone.
    ``opts.dry_run``: on the CPU, PIL in nvJPEG's place (checks the code, not the speed)."""
    why = None if importlib.util.find_spec("torchvision") else "torchvision is not installed"
    if why is None and not opts.dry_run and not torch.cuda.is_available():
        why = "no CUDA device"
    if why:
        out["notes"].append(f"gpu skipped: {why}")
        log(f"gpu skipped: {why}")
        return
    dev = torch.device("cpu") if opts.dry_run else torch.device("cuda", torch.cuda.current_device())
    out["environment"]["gpu"] = ("dry run on the CPU" if opts.dry_run
                                 else torch.cuda.get_device_name(dev))
    feeds, classes = gpu_feeds(packed, opts, dev)
    step = detection_step(dev, classes)
    images, targets = next(feeds["CPU path: DecodeLetterbox + CUDAPrefetcher"])
    fed = {"resident batch (on the GPU)": iter(lambda: (images, targets), None), **feeds}
    decoders = {"GPUDecoder alone: RandomResizedCrop + flip": gpu_decoder(packed, opts, dev, False),
                "GPUDecoder alone: letterbox + flip": gpu_decoder(packed, opts, dev, True)}
    for _ in range(opts.warmup):
        for it in fed.values():
            step(*next(it))
        for it in decoders.values():
            next(it)
    runs: Dict[str, List[float]] = {name: [] for name in (*fed, *decoders)}
    n = opts.steps * opts.gpu_batch
    # Decoding alone is fast: an epoch's batches per round, so that the few batches already
    # waiting in the pipeline's queues do not count for much.
    m = max(opts.steps, opts.images // opts.gpu_batch)
    for r in range(opts.rounds):
        for name, it in fed.items():
            runs[name].append(n / timed(dev, lambda: [step(*next(it)) for _ in range(opts.steps)]))
        for name, it in decoders.items():
            runs[name].append(m * opts.gpu_batch / timed(dev, lambda: [next(it) for _ in range(m)]))
        for name, vals in runs.items():
            log(f"gpu round {r + 1}/{opts.rounds}: {name}: {vals[-1]:,.0f} images/s")
    section = f"gpu: SSDlite320 step, batch {opts.gpu_batch}, {opts.gpu_size} px"
    add_rows(out, section, {k: runs[k] for k in fed}, "resident batch (on the GPU)", "%")
    add_rows(out, f"gpu: decode + augment, {opts.gpu_size} px", {k: runs[k] for k in decoders},
             next(iter(decoders)), "x")


def timed(dev: torch.device, fn) -> float:
    """Seconds ``fn()`` takes, GPU work included."""
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def endless(loader, epoch: int = 0) -> Iterator:
    """Batches of ``loader``, epoch after epoch (``set_epoch`` between them)."""
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def model_batch(images, targets):
    """What torchvision's detection models take: a list of images and plain-tensor targets."""
    return list(images), [{"boxes": t["boxes"].as_subclass(torch.Tensor).float(),
                           "labels": t["labels"]} for t in targets]


def gpu_decoder(packed: Path, opts: DetectionBenchOptions, dev: torch.device, letterbox: bool,
                **kw) -> Iterator:
    """An endless ``GPUDecoder`` (train=True: random crops or letterbox, and flips) over
    ``packed``; in a dry run on the CPU with PIL decoding and the resize's CPU reference."""
    from packer.gpu import GPUDecoder, GPUOptions, make_gpu_loader
    options = GPUOptions(decode_threads=opts.decode_threads,
                         decoder=pil_decoder if opts.dry_run else None)
    loader = make_gpu_loader(str(packed), opts.gpu_batch, num_workers=opts.workers,
                             drop_last=True)
    return endless(GPUDecoder(loader, size=opts.gpu_size, letterbox=letterbox, device=dev,
                              options=options, **kw))


def gpu_feeds(packed: Path, opts: DetectionBenchOptions, dev: torch.device):
    """({name: endless iterator of model batches} for the CPU and the GPU path, classes)."""
    from packer.reading.dataset import PackedDataset
    from packer.transforms.decode import DecodeLetterbox
    from packer.loading.loader import make_loader
    from packer.loading.prefetch import CUDAPrefetcher
    ds = PackedDataset(packed, decode=DecodeLetterbox(opts.gpu_size))
    cpu = CUDAPrefetcher(make_loader(ds, opts.gpu_batch, num_workers=opts.workers,
                                     drop_last=True), mean=None, std=None, device=dev)
    gpu = gpu_decoder(packed, opts, dev, True, mean=None, std=None, dtype=torch.float32)
    classes = 1 + max(c["id"] for c in ds.categories)  # labels are category ids; 0: background
    return {"CPU path: DecodeLetterbox + CUDAPrefetcher": (model_batch(*b) for b in endless(cpu)),
            "GPU path: GPUDecoder(letterbox=True)": (model_batch(*b) for b in gpu)}, classes


def detection_step(dev: torch.device, num_classes: int, model: str = "ssdlite"):
    """One training step (bf16 autocast on CUDA, SGD) of torchvision's SSDlite320-MobileNetV3
    (``ssdlite``) or fasterrcnn_mobilenet_v3_large_320_fpn (``fasterrcnn``), untrained:
    ``step(images, targets)``."""
    from torchvision.models import detection
    torch.backends.cudnn.benchmark = True
    make = {"ssdlite": detection.ssdlite320_mobilenet_v3_large,
            "fasterrcnn": detection.fasterrcnn_mobilenet_v3_large_320_fpn}[model]
    net = make(weights=None, weights_backbone=None, num_classes=num_classes).to(dev).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=4e-5)

    def step(images, targets) -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            losses = net(images, targets)
        sum(losses.values()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step
