"""``packer build`` with COCO annotations against a ``--list`` of the same images: the build
section of ``bench_detection`` (each build a fresh CLI process, its rate and its CPU per
image), and the median-and-ratio rows every section of it adds."""
from __future__ import annotations

import json
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List


def build_section(coco: Path, tmp: Path, opts, out: dict,
                  log: Callable[[str], None]) -> None:
    """Build rate with COCO annotations against a ``--list`` of the same images, each run
    as users run it (``cli_build``: this process, torch imported, forks workers slower),
    and the CPU each build used per image (the build process and its workers)."""
    listing = tmp / "labels0.txt"
    listing.write_text("".join(f"{p.name}\t0\n" for p in sorted(coco.glob("images/*.jpg"))))
    variants = {"build --list (label 0)": ["--list", str(listing)],
                "build --coco": ["--coco", str(coco / "annotations.json")]}
    runs: Dict[str, List[float]] = {name: [] for name in variants}
    cpu: Dict[str, List[float]] = {name: [] for name in variants}
    for r in range(opts.rounds):
        order = list(variants.items())
        # alternating order: neither build always runs right after the other's removal
        for k, (name, args) in enumerate(order if r % 2 == 0 else order[::-1]):
            dst = tmp / f"build-{r}-{k}"
            before = children_cpu()
            res = cli_build(coco / "images", dst, args, opts.workers)
            cpu[name].append((children_cpu() - before) / res["count"] * 1e6)
            runs[name].append(res["count"] / res["seconds"])
            shutil.rmtree(dst)
            log(f"build round {r + 1}/{opts.rounds}: {name}: {runs[name][-1]:,.0f} images/s, "
                f"{cpu[name][-1]:,.0f} us of CPU per image")
    add_rows(out, "build", runs, "build --list (label 0)", "x")
    paired = sorted(c / b for b, c in zip(runs["build --list (label 0)"], runs["build --coco"]))
    out["notes"].append(f"build --coco / --list round by round (each pair run back to back, "
                        f"in alternating order): median {statistics.median(paired):.3f}, "
                        f"range {paired[0]:.3f}-{paired[-1]:.3f}")
    per_image = {name: statistics.median(v) for name, v in cpu.items()}
    out["build_cpu_us_per_image"] = per_image
    base = per_image["build --list (label 0)"]
    out["notes"].append("build CPU per image (medians; the build process and its workers): "
                        + ", ".join(f"{n} {v:,.0f} us ({v / base - 1:+.0%})"
                                    for n, v in per_image.items()))


def cli_build(src: Path, dst: Path, args: List[str], workers: int) -> dict:
    """``packer build SRC DST ARGS --json`` in a fresh process; its JSON summary."""
    cmd = [sys.executable, "-m", "packer", "build", str(src), str(dst), *args, "--quiet",
           "--json", "--workers", str(workers)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def children_cpu() -> float:
    """User + system seconds of this process's finished child processes (and theirs)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def add_rows(out: dict, section: str, runs: Dict[str, List[float]], baseline: str,
             unit: str) -> None:
    """Median and spread of each variant, and its median over the baseline's."""
    base = statistics.median(runs[baseline])
    for name, vals in runs.items():
        med = statistics.median(vals)
        out["rows"].append({"section": section, "name": name, "images_per_s": med,
                            "values": vals, "baseline": name == baseline,
                            "ratio": med / base, "unit": unit})
