"""Commands that put a dataset on fast storage and take it off: stage, unstage."""
from __future__ import annotations

from pathlib import Path

import click

from .common import PathOrURL, library_errors, result_json, storage_flags


@click.command()
@click.argument("dst", type=PathOrURL(file_okay=False, path_type=Path))
@click.argument("target", type=click.Path(file_okay=False, path_type=Path), required=False,
                metavar="TARGET")
@click.option("--remove", is_flag=True, help="Free a staged copy instead: `packer stage --remove TARGET` "
                                             "(same as `packer unstage TARGET`).")
@click.option("--no-verify", is_flag=True, help="Trust files already in TARGET whose size matches and "
                                                "whose checksum the staged manifest there lists unchanged "
                                                "(each new copy is still checked as it is written).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@storage_flags
@click.option("--json", "as_json", is_flag=True,
              help="No progress bar; print one JSON object (source, target, copied, kept, "
                   "removed, bytes_copied, bytes_total, seconds, fstype, swap, ...).")
@library_errors(interrupted="Interrupted; the partial copy is kept: re-run the same command to "
                            "resume, or `packer unstage TARGET` to remove it.")
def stage(dst, target, remove, no_verify, quiet, storage_options, as_json):
    """Copy dataset DST to fast storage TARGET (a tmpfs mount, or /dev/shm/NAME) and verify it.

    TARGET is created (parents too) if missing; an existing TARGET must be empty or a staged
    copy: a folder holding anything else (/dev/shm itself) is refused before anything is
    written. A stage that fails removes what it wrote; an interrupted one keeps it for the
    re-run.

    Each shard is copied under a temporary name and renamed once its checksum matches; the
    manifest goes last, so TARGET is complete or not a dataset at all. Re-running repairs an
    interrupted or damaged copy, recopying only what differs. Train with
    PackedDataset(TARGET): nothing else changes. DST may be a URL (s3://, gs://, az://...):
    credentials and endpoints come from the client's usual environment variables
    (AWS_ENDPOINT_URL for an S3-compatible store; docs/object_storage.md).

    \b
    Examples:
      packer stage /data/packed/train /dev/shm/train
      packer stage s3://bucket/packed/train /dev/shm/train
      sudo mount -t tmpfs -o size=200G tmpfs /mnt/ram && packer stage /data/packed/train /mnt/ram/train
      packer stage --remove /dev/shm/train
    """
    from ..staging import stage as run_stage, unstage as run_unstage
    if remove:
        if target is not None:
            raise click.UsageError("--remove takes only the staged folder: packer stage --remove TARGET")
        res = run_unstage(dst)
    elif target is None:
        raise click.UsageError("missing TARGET: packer stage DST TARGET")
    else:
        res = run_stage(dst, target, progress=not (quiet or as_json), verify=not no_verify,
                        storage_options=storage_options or None)
    click.echo(result_json(res) if as_json else res.message())


@click.command()
@click.argument("target", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (target, removed, bytes_freed, ...).")
@library_errors
def unstage(target, as_json):
    """Remove a staged copy made by `packer stage` and free its RAM. Only files that staging
    wrote are removed, then TARGET and the parent folders stage created, when empty; a
    folder holding a built (unstaged) dataset is refused."""
    from ..staging import unstage as run_unstage
    res = run_unstage(target)
    click.echo(result_json(res) if as_json else res.message())


COMMANDS = [stage, unstage]
