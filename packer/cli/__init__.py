"""The ``packer`` command: click commands only (by subject: ``data``, ``staged``, ``tools``). Each
parses, calls the library, and turns library errors into one ``Error:`` line and exit code 1 (2
for usage errors, as click does)."""
from __future__ import annotations

import click

from . import data, staged, tools
from .common import PackerGroup, Size, library_errors, version_line

__all__ = ["Size", "library_errors", "main"]


@click.group(cls=PackerGroup, commands=data.COMMANDS + staged.COMMANDS + tools.COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=lambda ctx, _, v: v and not ctx.resilient_parsing and (click.echo(version_line()), ctx.exit()),
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
