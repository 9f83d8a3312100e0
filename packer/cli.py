"""The ``packer`` command: click commands only. Each one parses, calls the library, and turns
library errors into one ``Error:`` line and exit code 1 (2 for usage errors, as click does)."""
from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from pathlib import Path

import click

from . import __version__
from .errors import PackerError
from .text import json_text, printable, terminal_text

SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
              "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
              "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


class Size(click.ParamType):
    """A byte count such as ``512M``, ``1G`` or ``1073741824`` (units are powers of 1024)."""
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().replace(" ", "")
        num = text.rstrip("KMGTIB")
        try:
            return int(float(num) * SIZE_UNITS[text[len(num):]])
        except (ValueError, KeyError):
            self.fail(f"{value!r} is not a size (examples: 512M, 1G, 1073741824)", param, ctx)


def library_errors(fn=None, *, interrupted="Interrupted. Re-run the same command to resume."):
    """Show a PackerError as ``Error: ...`` (exit 1) and Ctrl-C as a short note (exit 130)."""
    if fn is None:
        return functools.partial(library_errors, interrupted=interrupted)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PackerError as e:
            raise click.ClickException(terminal_text(str(e))) from e
        except KeyboardInterrupt:
            click.echo(f"\n{interrupted}", err=True)
            sys.exit(130)
    return wrapper


@contextlib.contextmanager
def _warnings_as_lines():
    """Show packer's warnings (e.g. an empty class folder) as one ``Warning: ...`` line each
    on stderr when they happen, instead of Python's ``file:line: Category: ...`` form."""
    from .source import EmptyClassWarning, SymlinkLoopWarning
    ours = (EmptyClassWarning, SymlinkLoopWarning)
    with warnings.catch_warnings():
        for category in ours:
            warnings.simplefilter("always", category)
        show = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, ours):
                click.echo(terminal_text(f"Warning: {message}"), err=True)
            else:
                show(message, category, filename, lineno, file, line)
        warnings.showwarning = showwarning
        yield


def _version_line() -> str:
    from ._system import pil_summary
    return f"packer {__version__} (python {sys.version.split()[0]}; PIL: {pil_summary()})"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=lambda ctx, _, v: v and not ctx.resilient_parsing and (click.echo(_version_line()), ctx.exit()),
              help="Show packer's version and which PIL it decodes with, then exit.")
def main():
    """Pack an image folder into a few LMDB shards once, then train from them without
    waiting on input.

    \b
    Typical use:
      packer build ~/data/imagenet/train /data/packed/train   # once
      packer verify /data/packed/train                        # optional, full check
      packer stage /data/packed/train /dev/shm/train          # optional, copy to RAM
      # in training: packer.PackedDataset("/dev/shm/train", transform=...)

    Run `packer COMMAND --help` for each command's options, and `packer doctor` to see
    which PIL (Pillow or Pillow-SIMD) this environment decodes with.
    """


@main.command()
@click.argument("src", type=click.Path(file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option("--list", "list_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Take images from FILE's 'relative/path<TAB>label' lines (paths relative to SRC) "
                   "instead of SRC's class folders. Labels: all integers, or all class names.")
@click.option("--shard-size", type=Size(), default="1G", show_default=True,
              help="Target bytes per shard file (e.g. 512M, 2G).")
@click.option("--workers", "-j", type=int, default=None,
              help="Processes that read and check images [default: all usable cores].")
@click.option("--max-side", type=click.IntRange(min=16),
              help="Transcode: downscale so the longer side is at most N px.")
@click.option("--short-side", type=click.IntRange(min=16),
              help="Transcode: downscale so the shorter side is at most N px.")
@click.option("--quality", type=click.IntRange(1, 100),
              help="Transcode: re-encode every image as a baseline JPEG of this quality "
                   "[default 90 when --max-side/--short-side is given].")
@click.option("--shuffle", is_flag=True, help="Store records in a random order (see --seed).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --shuffle.")
@click.option("--part", metavar="K/N",
              help="Build only part K of N (K = 0..N-1, e.g. $SLURM_ARRAY_TASK_ID/8); "
                   "join the parts with `packer merge`.")
@click.option("--strict", is_flag=True, help="Fail (exit 1, no dataset) on the first bad image "
                                             "instead of skipping it.")
@click.option("--max-pixels", type=click.IntRange(min=1), default=None,
              help="Skip images with more pixels than this (decompression bombs) "
                   "[default: PIL's limit, 89,478,485].")
@click.option("--overwrite", is_flag=True, help="Replace a finished dataset already in DST.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; print only the summary.")
@library_errors
def build(src, dst, list_file, shard_size, workers, max_side, short_side, quality, shuffle,
          seed, part, strict, max_pixels, overwrite, quiet):
    """Pack the image folder SRC into LMDB shards in DST.

    SRC is laid out as torchvision's ImageFolder expects (SRC/CLASS/.../IMAGE): classes are
    SRC's subfolders in ImageFolder's order, so labels match it exactly. Every image is
    decoded once to check it; unreadable, truncated, empty and non-image files are skipped
    and listed in the manifest (see `packer info DST`).

    Image bytes are stored unchanged unless --max-side/--short-side/--quality ask for
    smaller JPEGs, which decode faster in training (--short-side 256: 1.6-2.1x per
    core, docs/benchmarks.md).

    An interrupted build (Ctrl-C, kill, power loss) leaves no dataset that readers accept;
    re-run the same command to resume after the last finished shard.
    """
    from .builder import build as run_build
    from .check import DEFAULT_MAX_PIXELS, Transcode
    transcode = None
    if max_side or short_side or quality:
        transcode = Transcode(max_side=max_side, short_side=short_side, quality=quality or 90)
    with _warnings_as_lines():
        result = run_build(src, dst, list_file=list_file, shard_size=shard_size, workers=workers,
                           transcode=transcode, shuffle=shuffle, seed=seed, part=part,
                           strict=strict, overwrite=overwrite,
                           max_pixels=max_pixels or DEFAULT_MAX_PIXELS, progress=not quiet)
    if result.resumed_shards:
        click.echo(f"resumed after {result.resumed_shards} finished shard(s)")
    click.echo(f"{result.summary()} -> {dst}")
    skipped = result.manifest["skipped"]
    if skipped:
        first = skipped[0]
        click.echo(terminal_text(f"{len(skipped)} file(s) skipped, e.g. {first['path']}: "
                                 f"{first['reason']} (all listed by `packer info {dst}`)"), err=True)


@main.command()
@click.argument("parts", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option("--overwrite", is_flag=True, help="Replace a finished dataset already in DST.")
@library_errors
def merge(parts, dst, overwrite):
    """Join datasets built with --part K/N into one dataset DST, without copying shards.

    DST's manifest refers to the parts' shard files by relative path: keep the parts where
    they are, or `packer stage DST ...` to make a self-contained copy.
    """
    from .merging import merge as run_merge
    m = run_merge(list(parts), dst, overwrite=overwrite)
    click.echo(f"merged {len(parts)} parts: {m['count']} images, {len(m['shards'])} shards -> {dst}")


@main.command()
@click.argument("dst", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (count, classes, shards, "
                                                      "bytes, skipped, format_version, ...).")
@library_errors
def info(dst, as_json):
    """Summarize dataset DST: classes with counts, shards, sizes, build options, skipped files."""
    from .info import format_info, info as get_info
    i = get_info(dst)
    click.echo(json_text(i) if as_json else format_info(i))


@main.command()
@click.argument("dst", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--quick", is_flag=True, help="Check structure, checksums and labels only: records are "
                                            "not read, decoded or compared with labels.i32.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@library_errors
def verify(dst, quick, quiet):
    """Check dataset DST: shard checksums and structure, labels, then every record (fields,
    checksum, decodes within the pixel limit, label). Exits 1 listing what is wrong."""
    from .info import verify as run_verify
    rep = run_verify(dst, quick=quick, progress=not quiet)
    if rep.ok:
        what = "shards" if quick else f"shards and {rep.checked_records} records"
        note = f"; {rep.skipped_checks}" if rep.skipped_checks else ""
        click.echo(f"OK: {rep.checked_shards} {what} verified in {dst}{note}")
        return
    for p in rep.problems:
        click.echo(terminal_text(p), err=True)
    raise click.ClickException(f"{len(rep.problems)} problem(s) in {dst}")


@main.command()
@click.argument("dst", type=click.Path(file_okay=False, exists=True, path_type=Path))
@library_errors
def ls(dst):
    """List records of DST, one per line: INDEX<TAB>LABEL<TAB>PATH, in record order."""
    from .info import ls as run_ls
    for i, label, path in run_ls(dst):
        sys.stdout.write(f"{i}\t{label}\t{printable(path)}\n")


@main.command()
@click.argument("dst", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("index", type=int)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the bytes to this file instead of stdout.")
@library_errors
def cat(dst, index, output):
    """Write the stored image bytes of record INDEX of DST (to stdout, or -o FILE)."""
    from .info import cat as run_cat
    try:
        data = run_cat(dst, index)
    except IndexError as e:
        raise click.ClickException(str(e)) from None
    if output:
        output.write_bytes(data)
    else:
        sys.stdout.buffer.write(data)


@main.command()
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.argument("target", type=click.Path(file_okay=False, path_type=Path), required=False)
@click.option("--remove", is_flag=True, help="Free a staged copy instead: `packer stage --remove TARGET` "
                                             "(same as `packer unstage TARGET`).")
@click.option("--no-verify", is_flag=True, help="Trust files already in TARGET whose size matches "
                                                "(each new copy is still checked as it is written).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@library_errors
def stage(dst, target, remove, no_verify, quiet):
    """Copy dataset DST to fast storage TARGET (a tmpfs mount, or /dev/shm/NAME) and verify it.

    Each shard is copied under a temporary name and renamed once its checksum matches; the
    manifest goes last, so TARGET is complete or not a dataset at all. Re-running repairs an
    interrupted or damaged copy, recopying only what differs. Train with
    PackedDataset(TARGET): nothing else changes.

    \b
    Examples:
      packer stage /data/packed/train /dev/shm/train
      sudo mount -t tmpfs -o size=200G tmpfs /mnt/ram && packer stage /data/packed/train /mnt/ram/train
      packer stage --remove /dev/shm/train
    """
    from .staging import stage as run_stage, unstage as run_unstage
    if remove:
        if target is not None:
            raise click.UsageError("--remove takes only the staged folder: packer stage --remove TARGET")
        click.echo(run_unstage(dst).message())
        return
    if target is None:
        raise click.UsageError("missing TARGET: packer stage DST TARGET")
    click.echo(run_stage(dst, target, progress=not quiet, verify=not no_verify).message())


@main.command()
@click.argument("target", type=click.Path(file_okay=False, exists=True, path_type=Path))
@library_errors
def unstage(target):
    """Remove a staged copy made by `packer stage` and free its RAM. Only files that staging
    wrote are removed; a folder holding a built (unstaged) dataset is refused."""
    from .staging import unstage as run_unstage
    click.echo(run_unstage(target).message())


@main.command()
def doctor():
    """Show the environment packer runs in: PIL flavour (Pillow-SIMD or Pillow), libjpeg-turbo,
    torch and CUDA, Triton, cores."""
    from .doctor import doctor as get_doctor, format_doctor
    click.echo(format_doctor(get_doctor()))


@main.command()
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
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the results to FILE as JSON ({\"results\": [...], ...}).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw the results as a bar chart (PNG; needs matplotlib).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@library_errors
def bench(dst, folder, staged, workers, batch_size, size, cuda, model, repeats, seconds,
          max_images, warm, json_file, plot_file, quiet):
    """Measure what bounds training input from DST on this machine: raw reads, decode per
    core, the loader over a sweep of worker counts and, with --cuda, feeding a real model.

    Prints a table (medians of interleaved repeats, with the spread) and a verdict: what
    limits this pipeline and what to change (workers, pack-time resize, staging, GPU decode).
    With the default 3 repeats of 3 s, 2 worker counts, --folder and --staged this takes
    about 2-3 minutes on 2 cores.
    """
    from .bench import run as lib
    if workers is not None:
        try:
            workers = [int(w) for w in workers.split(",") if w.strip()]
        except ValueError:
            raise click.BadParameter(f"{workers!r} is not a comma-separated list of integers "
                                     f"(e.g. 0,4,8)", param_hint="--workers") from None
        if not workers or min(workers) < 0:
            raise click.BadParameter("worker counts must be >= 0", param_hint="--workers")
    if plot_file is not None:
        lib.check_plot()  # before minutes of measuring, not after
    rep = lib.run_bench(dst, folder=folder, staged=staged, workers=workers, batch_size=batch_size,
                        size=size, cuda=cuda, model=model, repeats=repeats,
                        seconds_per_variant=seconds, max_images=max_images, cold_cache=not warm,
                        progress=not quiet)
    click.echo(rep.header())
    click.echo()
    click.echo(rep.table())
    click.echo()
    click.echo(f"Verdict: {rep.verdict()}")
    if json_file is not None:
        rep.write_json(json_file)
        click.echo(f"wrote {json_file}")
    if plot_file is not None:
        rep.plot(plot_file)
        click.echo(f"wrote {plot_file}")


@main.command()
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
@library_errors(interrupted="Interrupted; the demo's temporary files were removed.")
def demo(dir, images, classes, workers, batch_size, no_stage, quiet):
    """Run the whole job on generated data, no downloads: make photo-like JPEGs, build,
    verify, stage to /dev/shm, then read epochs through the plain folder loader and the
    packed loader in turn (same decode, same DataLoader settings) and compare their
    images/s. About 10-20 seconds on 2 cores.

    With DIR, the images (DIR/images) and the dataset (DIR/packed) are kept there; without
    it nothing is left behind. The staged RAM copy is always removed.
    """
    from .demo import run_demo
    on_step = None if quiet else (lambda name: click.echo(f"==> {name}", err=True))
    res = run_demo(dir, images=images, classes=classes, workers=workers, batch_size=batch_size,
                   stage_dir=None if no_stage else "/dev/shm", progress=not quiet, on_step=on_step)
    click.echo(res.report())
