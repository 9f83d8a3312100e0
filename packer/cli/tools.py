"""Commands about the machine and the pipeline: doctor, bench, demo."""
from __future__ import annotations

import os
from pathlib import Path

import click

from .common import library_errors


@click.command()
@click.option("--cuda", is_flag=True,
              help="Also ask torch for a GPU (imports torch: a few seconds).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (packer, python, pil, pil_summary, torch, cuda, "
                   "triton, optional, cores, cpu_count).")
@library_errors
def doctor(cuda, as_json):
    """Show the environment packer runs in: PIL flavour (Pillow-SIMD or Pillow), libjpeg-turbo,
    torch (and with --cuda its GPU), Triton and the other optional packages, cores. Imports no
    torch unless --cuda."""
    from ..doctor import doctor as get_doctor, format_doctor
    from .._util.text import json_text
    d = get_doctor(cuda=cuda)
    click.echo(json_text(d) if as_json else format_doctor(d))


@click.command()
@click.argument("dst", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--folder", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="DST's source image folder: the same reads and loader run on it, to show "
                   "what packing bought.")
@click.option("--staged", type=click.Path(file_okay=False, path_type=Path),
              help="A staged copy of DST (e.g. /dev/shm/NAME) to compare too; DST is staged "
                   "into it first if it does not hold one.")
@click.option("--workers", "-j", metavar="LIST",
              help="Loader worker counts to sweep, comma-separated, e.g. 0,4,8 "
                   "[default: 1,CORES/2,CORES].")
@click.option("--batch-size", "-b", type=click.IntRange(min=1),
              help="Images per batch [default: 256 with --cuda, else 64].")
@click.option("--size", type=click.IntRange(min=16), default=224, show_default=True,
              help="Output of the RandomResizedCrop that every loader decodes to.")
@click.option("--cuda", is_flag=True,
              help="Also time a training step on the GPU fed by each feeding variant (plain, "
                   "pin_memory + non_blocking, background thread, CUDAPrefetcher, both; GPU "
                   "decode when torchvision is installed) against the same step on a batch "
                   "already on the GPU.")
@click.option("--model", default="resnet50", show_default=True,
              help="With --cuda: a torchvision model name (the built-in resnet50 without "
                   "torchvision). Trained in bf16 autocast, channels_last, SGD.")
@click.option("--repeats", "-r", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved repeats of every variant; the median is shown with the spread.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True), default=3.0,
              show_default=True, help="How long each variant runs per repeat, after warm-up.")
@click.option("--max-images", type=click.IntRange(min=2),
              help="Also end each run after this many images.")
@click.option("--warm", is_flag=True,
              help="Keep the page cache. By default it is dropped before each read and loader "
                   "run (drop_caches as root, else posix_fadvise per file).")
@click.option("--figure-images", type=click.IntRange(min=0), metavar="N",
              help="Images of DST copied to a temporary folder (TMPDIR) for the build rate "
                   "ratio, loader efficiency and epoch-boundary wait; 0 skips them [default: "
                   "1000, or 2 batches per worker if more; at most --max-images].")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the results to FILE as JSON ({\"results\": [...], \"build_ratio\": "
                   "{...}, ...}).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw the results as a bar chart (PNG; needs matplotlib).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@library_errors
def bench(dst, folder, staged, workers, batch_size, size, cuda, model, repeats, seconds,
          max_images, warm, figure_images, json_file, plot_file, quiet):
    """Measure what bounds training input from DST on this machine: raw reads, decode per
    core, the loader over a sweep of worker counts and, with --cuda, feeding a real model.

    Prints which PIL ran (Pillow-SIMD or stock Pillow, its version), a table (medians of
    interleaved repeats, with the spread), three figures measured on a copy of a sample of
    DST's images (build rate ratio, loader efficiency, epoch-boundary wait) and a verdict:
    what limits this pipeline and what to change (workers, pack-time resize, staging, GPU
    decode). With the default 3 repeats of 3 s, 2 worker counts, --folder and --staged this
    takes about 2-3 minutes on 2 cores, the three figures about 15 s of it.
    """
    from ..bench import run as lib
    if workers is not None:
        try:
            workers = [int(w) for w in workers.split(",") if w.strip()]
        except ValueError:
            raise click.BadParameter(f"{workers!r} is not a comma-separated list of integers "
                                     f"(e.g. 0,4,8)", param_hint="--workers") from None
        if not workers or min(workers) < 0:
            raise click.BadParameter("worker counts must be >= 0", param_hint="--workers")
    for path, flag in ((json_file, "--json"), (plot_file, "--plot")):  # before minutes of
        if path is not None and not os.access(path.parent, os.W_OK | os.X_OK):  # measuring
            raise click.BadParameter(f"{path.parent} is not a folder this user can write to",
                                     param_hint=flag)
    if plot_file is not None:
        lib.check_plot()
    rep = lib.run_bench(dst, folder=folder, staged=staged, workers=workers, batch_size=batch_size,
                        size=size, cuda=cuda, model=model, repeats=repeats,
                        seconds_per_variant=seconds, max_images=max_images, cold_cache=not warm,
                        progress=not quiet, figure_images=figure_images)
    parts = [rep.header(), rep.table(), rep.figures_text(), f"Verdict: {rep.verdict()}"]
    click.echo("\n\n".join(filter(None, parts)))  # no figures: no paragraph
    for path, write in ((json_file, rep.write_json), (plot_file, rep.plot)):
        if path is not None:
            write(path)
            click.echo(f"wrote {path}")


@click.command()
@click.argument("dir", required=False, type=click.Path(file_okay=False, path_type=Path))
@click.option("--images", type=click.IntRange(min=1),
              help="Photo-like JPEGs to generate, about 70 KB each [default: 640, or enough "
                   "for 4 batches per loader worker on many cores].")
@click.option("--classes", type=click.IntRange(min=1), default=10, show_default=True,
              help="Class folders to spread them over.")
@click.option("--workers", "-j", type=click.IntRange(min=0),
              help="Processes that make and pack images, and DataLoader workers "
                   "[default: all usable cores].")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=64, show_default=True,
              help="Images per batch for both loaders.")
@click.option("--no-stage", is_flag=True, help="Read the packed shards where they are built "
                                               "instead of a copy staged to /dev/shm.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars; print only the report.")
@click.option("--detection", is_flag=True,
              help="Detection instead: photo scenes with COCO boxes (kept in DIR/coco), built "
                   "with --coco, read by the packed loader and a CocoDetection-style folder "
                   "loader (both DecodeLetterbox(640); batch 16 unless -b; --classes unused), "
                   "every image's targets compared. Default 512 scenes, 20-30 s on 2 cores.")
@library_errors(interrupted="Interrupted; the demo's temporary files were removed.")
def demo(dir, images, classes, workers, batch_size, no_stage, quiet, detection):
    """Run the whole job on generated data, no downloads: make photo-like JPEGs, build,
    verify, stage to /dev/shm, then read epochs through the plain folder loader and the
    packed loader in turn (same decode, same DataLoader settings) and compare their
    images/s. About 10-20 seconds on 2 cores.

    With DIR, the images (DIR/images) and the dataset (DIR/packed) are kept there; without
    it nothing is left behind. The staged RAM copy is always removed.
    """
    from ..demo import run_demo, run_detection_demo
    on_step = None if quiet else (lambda name: click.echo(f"==> {name}", err=True))
    stage_dir = None if no_stage else "/dev/shm"
    if detection:
        ctx = click.get_current_context()
        batch = batch_size if ctx.get_parameter_source("batch_size").name != "DEFAULT" else 16
        res = run_detection_demo(dir, images=images, workers=workers, batch_size=batch,
                                 stage_dir=stage_dir, progress=not quiet, on_step=on_step)
    else:
        res = run_demo(dir, images=images, classes=classes, workers=workers,
                       batch_size=batch_size, stage_dir=stage_dir, progress=not quiet,
                       on_step=on_step)
    click.echo(res.report())


COMMANDS = [doctor, bench, demo]
