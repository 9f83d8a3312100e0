"""Commands that make and look into datasets: build, merge, info, verify, ls, cat."""
from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import click

from ..errors import PackerError
from .._util.text import json_text, printable, terminal_text
from .common import RESUMES, PathOrURL, Size, library_errors, storage_flags, warnings_as_lines


@click.command()
@click.argument("src", type=PathOrURL(file_okay=False, path_type=Path))
@click.argument("dst", type=PathOrURL(file_okay=False, path_type=Path))
@click.option("--list", "list_file", type=PathOrURL(dir_okay=False, exists=True, path_type=Path),
              help="Take images from FILE's 'relative/path<TAB>label' lines (paths relative to SRC) "
                   "instead of SRC's class folders. Labels: all integers, or all class names.")
@click.option("--coco", type=PathOrURL(dir_okay=False, exists=True, path_type=Path),
              metavar="ANNOTATIONS.json",
              help="Detection: pack the images a COCO instances file lists (file_name relative "
                   "to SRC) with their boxes, category ids, iscrowd, area and segmentation.")
@click.option("--skip-empty", is_flag=True,
              help="With --coco: leave out images without annotations [default: keep them, "
                   "with empty targets].")
@click.option("--yolo", type=PathOrURL(file_okay=False, exists=True, path_type=Path),
              metavar="LABELS_DIR",
              help="Detection: every image under SRC, with LABELS_DIR/<same path>.txt lines "
                   "'class cx cy w h' (normalized); needs --names.")
@click.option("--names", type=PathOrURL(dir_okay=False, exists=True, path_type=Path),
              help="With --yolo: class names, a text file (one per line) or a YAML list or "
                   "'names:' map (e.g. the dataset's data.yaml).")
@click.option("--yolo-rules", type=click.Choice(["ultralytics", "lines"]), default=None,
              help="With --yolo: 'ultralytics' leaves out (and lists) an image with any invalid "
                   "label line, as ultralytics does; 'lines' drops the line and keeps the image "
                   "[default: ultralytics].")
@click.option("--meta", type=PathOrURL(dir_okay=False, exists=True, path_type=Path),
              metavar="FILE",
              help="Any fields: a .jsonl or .csv file with one row per image: a 'path' "
                   "column (relative to SRC) and any others (int, float, bool, str, lists: "
                   "types inferred and checked across all rows).")
@click.option("--label", "label_column", metavar="COLUMN",
              help="With --meta: COLUMN is the class label (str values: class names).")
@click.option("--allow-empty", is_flag=True,
              help="Keep class folders without images as classes with no samples "
                   "[default: an error, as torchvision's ImageFolder].")
@click.option("--extensions", metavar=".EXT,...",
              help="File endings that count as images, comma-separated, any case "
                   "[default: torchvision's IMG_EXTENSIONS].")
@click.option("--shard-size", type=Size(), default="1G", show_default=True,
              help="Largest bytes per shard file (e.g. 512M, 2G), counted on the source "
                   "files; a dataset under 256 of them gets ~256 smaller shards (>= 4M).")
@click.option("--workers", "-j", type=int, default=None,
              help="Processes that read and check images [default: all usable cores].")
@click.option("--ray", "on_ray", is_flag=True,
              help="Write the shards as tasks on a Ray cluster (RAY_ADDRESS's, else a new local "
                   "one) instead of --workers processes; DST must be at the same path on every "
                   "node. The same dataset (docs/distributed.md).")
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
                                             "or unusable annotation instead of skipping it.")
@click.option("--max-pixels", type=click.IntRange(min=1), default=None,
              help="Skip images with more pixels than this (decompression bombs) "
                   "[default: PIL's limit, 89,478,485].")
@click.option("--max-image-bytes", type=Size(), default="1G", show_default=True,
              help="Skip image files larger than this (e.g. 2G); only regular files are read "
                   "(a FIFO, a device or a link to one is skipped).")
@click.option("--max-classes", type=click.IntRange(min=1), default=None,
              help="With --list or --meta --label: the most classes integer labels may make "
                   "(labels 0..N-1) [default: 1,000,000].")
@click.option("--overwrite", is_flag=True, help="Replace a finished dataset already in DST.")
@storage_flags
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; print only the summary.")
@click.option("--json", "as_json", is_flag=True,
              help="No progress bar; print one JSON object (dst, count, bytes, shards, task, "
                   "seconds, resumed_shards, skipped, dropped_count, dropped).")
@library_errors(interrupted=RESUMES)
def build(src, dst, list_file, coco, skip_empty, yolo, names, yolo_rules, meta, label_column,
          allow_empty, extensions, shard_size, workers, on_ray, max_side, short_side, quality,
          shuffle, seed, part, strict, max_pixels, max_image_bytes, max_classes, overwrite,
          storage_options, quiet, as_json):
    """Pack the image folder SRC into LMDB shards in DST.

    SRC is laid out as torchvision's ImageFolder expects (SRC/CLASS/.../IMAGE): classes are
    SRC's subfolders in ImageFolder's order, so labels match it exactly. Or SRC holds the
    images that --list, --coco, --yolo or --meta describe (docs/annotations.md). Every
    image is decoded once to check it; unreadable, truncated, empty and non-image files are
    skipped, annotations that cannot be used (a box outside its image, an unknown class) are
    dropped, and both are listed in the manifest (see `packer info DST`).

    \b
    Examples:
      packer build train/ packed/                       # ImageFolder classification
      packer build images/ packed/ --coco instances_train2017.json
      packer build images/ packed/ --yolo labels/ --names data.yaml
      packer build images/ packed/ --meta captions.jsonl

    Image bytes are stored unchanged unless --max-side/--short-side/--quality ask for
    smaller JPEGs, which decode faster in training (--short-side 256: 1.6-2.1x per
    core, docs/benchmarks.md).

    An interrupted build (Ctrl-C, kill, power loss) leaves no dataset that readers accept;
    re-run the same command to resume after the last finished shard.

    DST may be a URL (s3://bucket/ds): the build runs in a temporary folder and uploads each
    shard as it finishes, the manifest last; a re-run resumes. SRC, --list, --coco, --yolo,
    --names and --meta may be URLs too: the images are listed once and read with parallel GETs, never copied
    whole (docs/object_storage.md). --storage-option applies to all of them.
    """
    from ..writing.builder import build as run_build
    from ..writing.check import DEFAULT_MAX_PIXELS, Checks, Transcode
    if on_ray and workers is not None:
        raise click.UsageError("--ray and --workers exclude each other (Ray runs a task per "
                               "cluster CPU)")
    source = build_source(src, list_file, coco, skip_empty, yolo, names, yolo_rules, meta,
                          label_column, allow_empty, extensions, max_classes,
                          storage_options or None)
    transcode = (Transcode(max_side=max_side, short_side=short_side, quality=quality or 90)
                 if max_side or short_side or quality else None)
    if not isinstance(dst, Path):  # a URL
        from ..storage.destination import Destination
        dst = Destination(dst, storage_options)
    with warnings_as_lines(), flag_words():
        result = run_build(source, dst, shard_size=shard_size,
                           workers=workers, engine="ray" if on_ray else "local",
                           transcode=transcode, shuffle=shuffle, seed=seed, part=part,
                           checks=Checks(strict=strict,
                                         max_pixels=max_pixels or DEFAULT_MAX_PIXELS,
                                         max_image_bytes=max_image_bytes),
                           overwrite=overwrite, progress=not (quiet or as_json))
    m = result.manifest
    if as_json:
        click.echo(json_text({
            "dst": str(dst), "count": m["count"], "bytes": m["bytes"], "shards": len(m["shards"]),
            "task": (m.get("schema") or {}).get("task", "classification"),
            "seconds": round(result.seconds, 3), "resumed_shards": result.resumed_shards,
            "skipped": m["skipped"], "dropped_count": m.get("dropped_count", 0),
            "dropped": m.get("dropped", [])}))
        return
    if result.resumed_shards:
        click.echo(f"resumed after {result.resumed_shards} finished shard(s)")
    click.echo(f"{result.summary()} -> {dst}")
    skipped = m["skipped"]
    if skipped:
        first = skipped[0]
        click.echo(terminal_text(f"{len(skipped)} file(s) skipped, e.g. {first['path']}: "
                                 f"{first['reason']} (all listed by `packer info {dst}`)"), err=True)
    dropped = m.get("dropped") or []
    if dropped:
        first = dropped[0]
        click.echo(terminal_text(f"{m['dropped_count']} annotation(s) dropped, e.g. "
                                 f"{first['path']}: {first['reason']} (all listed by `packer info "
                                 f"{dst} --json`)"), err=True)


# The sources' Python words in their messages, as the build command's flags say them.
FLAG_WORDS = [(r"ImageFolder\(root, allow_empty=True\)", "--allow-empty"),
              (r"ImageFolder\(root\): ", "source folder "),
              (r"pack a FileList:", "pass --list FILE with"),
              (r"overwrite=True", "--overwrite"),
              (r"workers=N", "--workers N"),
              (r"\b(shard_size|max_image_bytes|max_classes)\b",
               lambda m: "--" + m[1].replace("_", "-")),
              (r"Coco\(images, annotations, skip_empty=True\)", "--skip-empty"),
              (r"Coco\(images, annotations\): annotations ", "--coco "),
              (r"Yolo\(images, labels, names\): labels ", "--yolo "),
              (r"Yolo\(images, labels, names\): names ", "--names "),
              (r"Table\(images, table, label\): table ", "--meta "),
              (r"Table\(images, table, label='([^']*)'\)", r"--label \1"),
              (r"\w+\((images|list_file), [^)]*\): (images|root) ", "SRC ")]


@contextlib.contextmanager
def flag_words():
    """A PackerError from the build with the sources' argument names as flags."""
    try:
        yield
    except PackerError as e:
        text = str(e)
        for pattern, flag in FLAG_WORDS:
            text = re.sub(pattern, flag, text)
        if text == str(e):
            raise
        raise PackerError(text) from None


def build_source(src, list_file, coco, skip_empty, yolo, names, yolo_rules, meta,
                 label_column, allow_empty, extensions, max_classes=None, storage_options=None):
    """The ``packer.sources`` object the flags name (ImageFolder if none); a bad mix: exit 2."""
    from ..sources import Coco, FileList, ImageFolder, Table, Yolo
    chosen = [flag for flag, value in (("--list", list_file), ("--coco", coco), ("--yolo", yolo),
                                       ("--meta", meta)) if value is not None]
    if len(chosen) > 1:
        raise click.UsageError(f"pass one source: {' and '.join(chosen)} exclude each other")
    if (names is not None) != (yolo is not None):
        raise click.UsageError("--yolo LABELS_DIR and --names NAMES go together")
    if yolo_rules is not None and yolo is None:
        raise click.UsageError("--yolo-rules applies to --yolo datasets")
    if label_column is not None and meta is None:
        raise click.UsageError("--label COLUMN picks a column of --meta FILE; pass --meta too")
    if skip_empty and coco is None:
        raise click.UsageError("--skip-empty applies to --coco datasets (images with no annotation)")
    if max_classes is not None and list_file is None and label_column is None:
        raise click.UsageError("--max-classes bounds the integer labels of --list or --meta --label")
    limit = {} if max_classes is None else {"max_classes": max_classes}
    store = {"storage_options": storage_options}
    if list_file is not None:
        return FileList(list_file, root=src, **limit, **store)
    if coco is not None:
        return Coco(src, coco, skip_empty=skip_empty, **store)
    if yolo is not None:
        return Yolo(src, yolo, names, rules=yolo_rules or "ultralytics", **store)
    if meta is not None:
        return Table(src, meta, label=label_column, **limit, **store)
    exts = extensions and [e.strip() for e in extensions.split(",") if e.strip()]
    return ImageFolder(src, extensions=exts or None, allow_empty=allow_empty, **store)


@click.command()
@click.argument("parts", nargs=-1, required=True, type=PathOrURL(file_okay=False, exists=True, path_type=Path))
@click.argument("dst", type=PathOrURL(file_okay=False, path_type=Path))
@click.option("--overwrite", is_flag=True, help="Replace a finished dataset already in DST.")
@storage_flags
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (dst, parts, count, shards, missing_parts).")
@library_errors(interrupted=RESUMES)
def merge(parts, dst, overwrite, storage_options, as_json):
    """Join datasets built with --part K/N into one dataset DST, without copying shards.

    DST's manifest refers to the parts' shard files by relative path: keep the parts where
    they are, or `packer stage DST ...` to make a self-contained copy. Parts and DST may be
    URLs: the parts are fetched and checked first; a DST URL (in the parts' bucket) refers
    to their shards there, a local DST to copies fetched beside it (docs/object_storage.md).
    The parts must come from one build command (one N, each K once, the same options; SRC and
    its annotation files may be copies at other paths, compared by name): parts of another
    --seed, N or source would repeat some images and miss others, so they are refused.

    \b
    Examples:
      for k in 0 1 2 3; do packer build SRC /data/parts/p$k --part $k/4; done
      packer merge /data/parts/p0 /data/parts/p1 /data/parts/p2 /data/parts/p3 /data/packed/train
    """
    from ..storage.local import shown
    from ..writing.merger import merge as run_merge, missing_parts
    with flag_words():
        m = run_merge(list(parts), dst, overwrite=overwrite,
                      storage_options=storage_options or None)
    parts, dst, missing = [shown(p) for p in parts], shown(dst), missing_parts(m)
    if as_json:
        click.echo(json_text({"dst": str(dst), "parts": [str(p) for p in parts],
                              "count": m["count"], "shards": len(m["shards"]),
                              "missing_parts": missing}))
        return
    click.echo(f"merged {len(parts)} parts: {m['count']} images, {len(m['shards'])} shards -> {dst}")
    if missing:
        click.echo(f"note: parts {', '.join(missing)} of the build are not in it; merge them in "
                   f"when built (packer merge {dst} PART... NEW_DST)", err=True)


@click.command()
@click.argument("dst", type=PathOrURL(file_okay=False, exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (count, classes, shards, "
                                                      "bytes, skipped, format_version, ...).")
@storage_flags
@library_errors
def info(dst, as_json, storage_options):
    """Summarize dataset DST: classes with counts, shards, sizes, build options, skipped files."""
    from ..info import format_info, info as get_info
    i = get_info(dst, storage_options or None)
    click.echo(json_text(i) if as_json else format_info(i))


@click.command()
@click.argument("dst", type=PathOrURL(file_okay=False, exists=True, path_type=Path))
@click.option("--quick", is_flag=True, help="Check structure, checksums and labels only: records are "
                                            "not read, decoded or compared with labels.i32.")
@click.option("--max-pixels", type=click.IntRange(min=1), default=None,
              help="Report images with more pixels than this; the dataset's own build limit "
                   "is not used (a stranger's manifest could name any) [default: PIL's "
                   "limit, 89,478,485].")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True,
              help="No progress bars; print one JSON object (path, ok, checked_shards, "
                   "checked_records, problems, skipped_checks); exit 1 when not ok.")
@storage_flags(cache=True)
@library_errors
def verify(dst, quick, max_pixels, quiet, as_json, storage_options, cache_dir):
    """Check dataset DST: shard checksums and structure, labels, then every record (fields,
    checksum, decodes within --max-pixels with the size its record says, label). Exits 1
    listing what is wrong. A URL's shards are fetched first, each checked against its
    SHA-256, then checked as a folder's."""
    from ..info import verify as run_verify
    from ..storage.local import shown
    limit = {} if max_pixels is None else {"max_pixels": max_pixels}
    rep = run_verify(dst, quick=quick, progress=not (quiet or as_json),
                     storage_options=storage_options or None, cache_dir=cache_dir, **limit)
    dst = shown(dst)
    if as_json:
        click.echo(json_text({"path": str(dst), "ok": rep.ok, "checked_shards": rep.checked_shards,
                              "checked_records": rep.checked_records, "problems": rep.problems,
                              "skipped_checks": rep.skipped_checks}))
        if not rep.ok:
            sys.exit(1)
        return
    if rep.ok:
        what = "shards" if quick else f"shards and {rep.checked_records} records"
        note = f"; {rep.skipped_checks}" if rep.skipped_checks else ""
        click.echo(f"OK: {rep.checked_shards} {what} verified in {dst}{note}")
        return
    for p in rep.problems:
        click.echo(terminal_text(p), err=True)
    raise click.ClickException(f"{len(rep.problems)} problem(s) in {dst}")


@click.command()
@click.argument("dst", type=PathOrURL(file_okay=False, exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per line: index, path, width, height and every field "
                   "(arrays as their shape, e.g. boxes [3, 4]).")
@storage_flags(cache=True)
@library_errors
def ls(dst, as_json, storage_options, cache_dir):
    """List records of DST, one per line: INDEX<TAB>LABEL<TAB>PATH, in record order (LABEL
    -1 in datasets without class labels; --json shows every field)."""
    from ..info import ls as run_ls, ls_fields
    where = (dst, storage_options or None, cache_dir)
    if as_json:
        for row in ls_fields(*where):
            sys.stdout.write(json_text(row, indent=None) + "\n")
        return
    for i, label, path in run_ls(*where):
        sys.stdout.write(f"{i}\t{label}\t{printable(path)}\n")


class NegativeIndex(click.Command):
    """A negative INDEX (``-1``) is a number, not an option; a misspelled option is still one."""

    def parse_args(self, ctx, args):
        nums = [a for a in args if re.fullmatch(r"-\d+", a)]
        if nums and "--" not in args:
            args = [a for a in args if a not in nums] + ["--", *nums]
        return super().parse_args(ctx, args)


@click.command(cls=NegativeIndex)
@click.argument("dst", type=PathOrURL(file_okay=False, exists=True, path_type=Path))
@click.argument("index", type=int)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the bytes to this file instead of stdout.")
@storage_flags(cache=True)
@library_errors
def cat(dst, index, output, storage_options, cache_dir):
    """Write the stored image bytes of record INDEX of DST (to stdout, or -o FILE).

    INDEX is the first column of `packer ls DST`; a negative one counts from the end
    (-1: the last record).

    \b
    Examples:
      packer cat /data/packed/train 0 -o first.jpg
      packer cat /data/packed/train -1 > last.jpg
    """
    from ..info import cat as run_cat
    try:
        data = run_cat(dst, index, storage_options or None, cache_dir)
    except IndexError as e:
        raise click.ClickException(str(e)) from None
    if output:
        output.write_bytes(data)
    else:
        sys.stdout.buffer.write(data)


COMMANDS = [build, merge, info, verify, ls, cat]
