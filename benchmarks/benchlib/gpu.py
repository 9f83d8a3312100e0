"""The GPU-decode benchmark (``benchmarks/bench_gpu_decode.py``; GPU machine): packer's GPU
decode path against the CPU path, in one run.

Makes ImageNet-like JPEGs, packs them as stored and transcoded, then measures images/s to
224x224 for: the CPU path (Pillow in DataLoader workers on all cores), nvJPEG decode alone
(torchvision's, packer's binding; nvImageCodec's with PACKER_BENCH_NVIMGCODEC=1),
the batched augment alone, the whole GPUDecoder pipeline (inline, one thread, two threads;
train and eval), the same on transcoded data, whether the hardware JPEG engine works (NVML's
JPG utilization), ResNet-18 steps fed by the GPU path vs synthetic batches, and pixel
agreement with PIL. Prints a table; writes results.json and results.md to ``out``.
``dry_run``: tiny, on the CPU, PIL standing in for nvJPEG.

    gpu.py         run(GPUBenchArgs): the sections in order
    gpu_common.py  GPUBenchArgs, GPUBench (results, rows, output), timing helpers
    gpu_decode.py  the data; CPU path, decode, augment, pipeline, settings, agreement
    gpu_train.py   ResNet-18 fed by the GPU path, the GPU stage beside a step, contention
    gpu_probe.py   nvJPEG probes, and profile_augment (benchmarks/profile_gpu_augment.py)
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Dict

import torch

from packer.reading.dataset import PackedDataset
from packer.transforms.decode import DecodeRandomResizedCrop
from packer.doctor import doctor
from packer.gpu import make_gpu_loader, reserve_cuda_queues
from packer.gpu.nvjpeg import NvjpegDecoder, torchvision_decode
from packer.loading.loader import make_loader
from benchlib.gpu_common import SECTIONS, GPUBench, GPUBenchArgs, NvImageCodecDecoder, pil_decoder
from benchlib.gpu_decode import agreement, augment_only, cpu_path, decode_only, decode_parallel, make_data, pipeline, pipeline_gpu_time, pipeline_variants, progressive_vs_baseline
from benchlib.gpu_probe import YuvDecoder, dmon, kernel_profile, nvjpeg_probe, profile_augment
from benchlib.gpu_train import beside, contention, fed_diagnostics, resnet

__all__ = ["GPUBench", "GPUBenchArgs", "SECTIONS", "profile_augment", "run"]


def run(args: GPUBenchArgs) -> int:
    """Every section ``args`` asks for, in order; a failing section is logged (and listed
    under "errors" in results.json) and the others still run. Returns 0, or 1 when the
    data could not be made."""
    reserve_cuda_queues()  # before any CUDA work: CUDA reads the setting when it starts
    b = GPUBench(args.resolved())
    b.out.mkdir(parents=True, exist_ok=True)
    sets = None
    with b.section("data"):  # before CUDA starts: the pools fork
        sets = make_data(b)
    if sets is None:
        return 1
    _setup(b)
    # Loaders first: their workers fork before this process opens any shard (py-lmdb refuses
    # to open a file a forked parent still has open).
    a = b.a
    loaders = {n: make_gpu_loader(sets[n], a.batch, num_workers=a.loader_workers, drop_last=True)
               for n in sets}
    pinned = make_gpu_loader(sets["stored"], a.batch, num_workers=a.loader_workers,
                             drop_last=True, pin_memory=True)
    cpu_loaders = {n: make_loader(PackedDataset(sets[n], decode=DecodeRandomResizedCrop(224)),
                                  a.batch, num_workers=a.cpus, drop_last=True)
                   for n in ("stored", "short256")}
    if "cpu" not in b.skip:
        with b.section("1: CPU path"):
            cpu_path(b, sets["stored"])
    _decode_sections(b, loaders, pinned)
    _variant_sections(b, sets)
    if b.dev.type == "cuda":
        _gpu_sections(b, sets, loaders)
    if "resnet" not in b.skip:
        _resnet_sections(b, sets, cpu_loaders)
    if b.dev.type == "cuda":
        with b.section("probe: libnvjpeg"):
            nvjpeg_probe(b)
    if "progressive" not in b.skip:
        with b.section("5: baseline vs progressive through torchvision"):
            first = next(iter(b.decoders.values()))
            progressive_vs_baseline(b, sets["stored"], b.decoders.get("torchvision", first))
    if "agreement" not in b.skip:
        with b.section("correctness"):
            agreement(b, sets["stored"])
    b.log("\n" + b.write_results())
    if "agreement" in b.results:
        b.log(json.dumps(b.results["agreement"]))
    return 0


def _setup(b: GPUBench) -> None:
    """The device and decoders (PIL for a dry run), and the environment into the results."""
    if b.a.dry_run:
        b.dev, b.decoders = torch.device("cpu"), {"pil": pil_decoder}
    else:
        b.dev = torch.device("cuda", torch.cuda.current_device())
        b.decoders = {"torchvision": torchvision_decode}  # GPUDecoder's default where installed
        try:
            if os.environ.get("PACKER_BENCH_NO_NVJPEG"):
                raise RuntimeError("PACKER_BENCH_NO_NVJPEG is set")
            nv = NvjpegDecoder(b.dev)
            b.decoders[f"nvjpeg-{nv.backend}"] = nv
        except Exception as e:
            b.log(f"   NvjpegDecoder unavailable: {e!r}")
        # nvImageCodec on request: its threads make workers forked later crash (SIGSEGV), so
        # run it with sections that fork none after decode-only (--skip pipeline).
        for hw_only in (False, True) if os.environ.get("PACKER_BENCH_NVIMGCODEC") else ():
            nvic = NvImageCodecDecoder(b.dev, hw_only=hw_only)
            b.decoders[nvic.name] = nvic
    b.log(f"   decoders: {list(b.decoders)}; GPUDecoder runs use {next(iter(b.decoders))}")
    b.pil = doctor()["pil_summary"]
    env = {"torch": torch.__version__, "pil": b.pil, "cpus": b.a.cpus,
           "args": dataclasses.asdict(b.a),
           "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    try:
        import torchvision
        env["torchvision"] = torchvision.__version__
    except ImportError:
        env["torchvision"] = None
    if b.dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(b.dev)
    b.results["env"] = env
    b.log(json.dumps(env))


def _decode_only(b: GPUBench, name: str, loader) -> list:
    """decode_only, with nvidia-smi dmon's columns alongside for the stored set."""
    mon = dmon(b, 8, b.out / f"dmon_{name}.txt") if b.dev.type == "cuda" and name == "stored" else None
    batches = decode_only(b, name, loader)
    if mon is not None:
        mon.wait(timeout=20)
        b.results["dmon_stored"] = (b.out / "dmon_stored.txt").read_text()
        b.log(b.results["dmon_stored"])
    return batches


def _decode_sections(b: GPUBench, loaders: Dict[str, object], pinned) -> None:
    """Steps 2-4 per packed set: decode alone, augment alone, the whole pipeline."""
    cuda = b.dev.type == "cuda"
    decoder = next(iter(b.decoders.values()))
    for name in ("stored", "max512", "short256"):
        if name != "stored" and ("transcoded" in b.skip or name not in b.a.sets.split(",")):
            continue
        batches: list = []
        with b.section(f"2/4: decode only [{name}]"):
            batches = _decode_only(b, name, loaders[name])
        if cuda and "parallel" not in b.skip:
            with b.section(f"2c: parallel decoders [{name}]"):
                decode_parallel(b, name, batches)
        with b.section(f"3a: augment only [{name}]"):
            augment_only(b, name, batches, decoder)
        if cuda:
            with b.section(f"3g: GPU time per batch [{name}]"):
                pipeline_gpu_time(b, name, batches)
        del batches
        if "pipeline" not in b.skip:
            with b.section(f"3/4: pipeline [{name}]"):
                pipeline(b, name, loaders[name], decoder,
                         overlaps=(0, 1, 2) if name == "stored" else (2,))
                if name == "stored":  # the pin thread's and the decoder's contributions
                    pipeline(b, name, pinned, decoder, overlaps=(2,), modes=(True,))
                    for other, dec in list(b.decoders.items())[1:]:
                        pipeline(b, name, loaders[name], dec, overlaps=(2,), dname=other)


def _variant_sections(b: GPUBench, sets: Dict[str, Path]) -> None:
    """Step 7: GPUDecoder's settings (decode threads, pinning)."""
    if "variants" in b.skip:
        return
    dname, decoder = next(iter(b.decoders.items()))
    with b.section("7: decode threads [stored]"):
        variants = [(f"{dname}, 1 decode thread", {"decoder": decoder, "decode_threads": 1})]
        pinned = {"loader": {"pin_memory": True}}
        if b.dev.type == "cuda":
            variants += [(f"decode_threads={k}", {"decode_threads": k}) for k in (1, 3)]
            variants += [("loader pinned, decode_threads=3", {**pinned, "decode_threads": 3}),
                         ("loader pinned", pinned),
                         ("default settings", {})]
        pipeline_variants(b, "stored", sets["stored"], variants)
        pipeline_variants(b, "stored", sets["stored"], variants[-2:], train=False)
        if b.dev.type == "cuda" and "short256" in sets:
            pipeline_variants(b, "short256", sets["short256"], variants[-2:])
            pipeline_variants(b, "short256", sets["short256"], variants[-1:], train=False)


def _gpu_sections(b: GPUBench, sets: Dict[str, Path], loaders: Dict[str, object]) -> None:
    """The CUDA-only sections: the kernel probe, decoding under load, the GPU stage beside a
    training step (8), and the fed loop's diagnostics (9)."""
    if "probe" not in b.skip:
        with b.section("probe: what nvJPEG launches per batch"):
            kernel_profile(b, loaders["stored"])
    if "contention" not in b.skip:
        with b.section("2b: decode under load"):
            more = {}
            if os.environ.get("PACKER_BENCH_YUV"):  # the probe: planes instead of RGB
                more["nvjpeg-yuv"] = YuvDecoder(NvjpegDecoder(b.dev))
            contention(b, loaders["stored"], {**b.decoders, **more})
    if "beside" not in b.skip:
        with b.section("8: what the GPU stage costs a training step beside it [stored]"):
            beside(b, sets["stored"])
    if "diag" not in b.skip:
        how = [("default settings", {}, {}), ("loader pinned", {}, {"pin_memory": True}),
               ("max_ahead=1", {"max_ahead": 1}, {})]
        for graphed in (True, False):
            with b.section(f"9: the fed loop, {'graphed' if graphed else 'eager'} [stored]"):
                fed_diagnostics(b, "stored", sets["stored"], how * 2, graphed)


def _resnet_sections(b: GPUBench, sets: Dict[str, Path], cpu_loaders: Dict[str, object]) -> None:
    """Step 6: ResNet-18 steps fed by GPUDecoder (and by the CPU path) vs synthetic batches."""
    for name in ("stored", "short256"):
        with b.section(f"6: ResNet-18 [{name}]"):
            variants = [("default settings", {})]
            if b.dev.type == "cuda":
                if name == "stored":
                    variants += [("loader pinned", {"loader": {"pin_memory": True}})]
                variants += [(f"{label}, step as one CUDA graph", {**kw, "graphed": True})
                             for label, kw in variants]
            resnet(b, name, cpu_loaders.get(name), variants, sets[name])
