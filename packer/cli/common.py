"""Shared pieces of the ``packer`` commands: parameter types, error handling, warnings."""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import warnings
from fractions import Fraction
from pathlib import Path

import click

from .. import __version__
from ..errors import PackerError
from .._util.text import terminal_text

# "", "B", then K, KB, KIB ... T, TB, TIB: powers of 1024
SIZE_UNITS = {"": 1, "B": 1, **{p + s: 1 << 10 * i for i, p in enumerate("KMGT", 1)
                                for s in ("", "B", "IB")}}
SIZE_TEXT = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([A-Z]*)\Z")


class Size(click.ParamType):
    """A byte count such as ``512M``, ``1.5G`` or ``1073741824`` (units are powers of 1024):
    digits and a unit only, so ``inf``, ``nan``, ``1e400`` and ``-1G`` are usage errors."""
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        found = SIZE_TEXT.match(str(value).strip().upper().replace(" ", ""))
        if not found or found[2] not in SIZE_UNITS or len(found[1]) > 30:
            self.fail(f"{value!r} is not a size (examples: 512M, 1G, 1073741824)", param, ctx)
        return int(Fraction(found[1]) * SIZE_UNITS[found[2]])


class PathOrURL(click.Path):
    """A folder, or a URL (``s3://...``) passed on untouched (a str; a path is a Path)."""

    def convert(self, value, param, ctx):
        from ..storage.urls import is_url
        return value if is_url(value) else super().convert(value, param, ctx)


def storage_flags(fn=None, *, cache: bool = False):
    """``--storage-option KEY=VALUE`` (repeatable) as ``storage_options`` (and with ``cache``,
    ``--cache-dir``) for a command that takes a URL."""
    if fn is None:
        return functools.partial(storage_flags, cache=cache)
    if cache:
        fn = click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
                          help="With a URL: keep its fetched shards in this node-local folder "
                               "(reused by later commands) [default: a temporary folder].")(fn)
    return click.option(
        "--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
        callback=lambda ctx, param, pairs: parse_storage_options(pairs),
        help="With a URL: one of fsspec's storage_options (endpoint_url=..., "
             "packer_parallel=8; a VALUE in JSON is parsed: client_kwargs={...}); repeatable. "
             "Credentials are better left to the client's environment variables.")(fn)


def parse_storage_options(pairs) -> dict:
    """``("k=v", ...)`` -> ``{"k": v}``, v parsed as JSON where it is JSON (numbers, objects)."""
    import json
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{pair.split('=')[0]!r}: expected KEY=VALUE",
                                     param_hint="--storage-option")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


RESUMES = "Interrupted. Re-run the same command to resume."  # what build and merge say


def library_errors(fn=None, *, interrupted="Interrupted."):
    """Show a PackerError as ``Error: ...`` (exit 1) and Ctrl-C as a short note (exit 130); so
    too a missing optional package (the line names the pip command) and an error of the
    operating system (``PATH: reason``), never a traceback."""
    if fn is None:
        return functools.partial(library_errors, interrupted=interrupted)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PackerError as e:
            raise click.ClickException(terminal_text(str(e))) from e
        except ImportError as e:
            line = missing_package(e)
            if line is None:
                raise
            raise click.ClickException(terminal_text(line)) from e
        except BrokenPipeError:  # `packer ls DST | head`: the reader is gone, nothing to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except OSError as e:
            raise click.ClickException(os_error_line(e)) from e
        except KeyboardInterrupt:
            click.echo(f"\n{interrupted}", err=True)
            sys.exit(130)
    return wrapper


def os_error_line(e: OSError) -> str:
    """``PATH: reason`` (``PATH -> PATH2: reason``), or the reason alone where no file is named."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    return terminal_text(f"{where}: {e.strerror}" if where and e.strerror else e.strerror or str(e))


class PackerGroup(click.Group):
    """An OS error outside a command (``--help`` to a full disk) is one ``Error:`` line too."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        except OSError as e:
            click.echo(f"Error: {os_error_line(e)}", err=True)
            sys.exit(1)


# Import names whose pip distribution is called otherwise.
PIP_NAMES = {"PIL": "Pillow", "yaml": "pyyaml", "cv2": "opencv-python"}


def missing_package(e: ImportError):
    """The line for a missing optional package; None else (a missing packer module: a bug)."""
    name = (getattr(e, "name", None) or "").split(".")[0]
    if not isinstance(e, ModuleNotFoundError) or not name or name == "packer":
        return str(e) if "pip install" in str(e) else None  # the library's own hint
    return (f"this needs the Python package {PIP_NAMES.get(name, name)!r}, which is not "
            f"installed: pip install {PIP_NAMES.get(name, name)}")


@contextlib.contextmanager
def warnings_as_lines():
    """Show packer's warnings as one ``Warning: ...`` line each on stderr, as they happen."""
    from ..sources.base import EmptyClassWarning, SymlinkLoopWarning
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


def version_line() -> str:
    from .._util.system import pil_summary
    try:
        pil = pil_summary()
    except ImportError:
        pil = "not installed (pip install Pillow)"
    return f"packer {__version__} (python {sys.version.split()[0]}; PIL: {pil})"


def result_json(result) -> str:
    """A result dataclass (``StageResult``...) as one JSON object; paths as strings."""
    import dataclasses
    from .._util.text import json_text
    return json_text({k: str(v) if isinstance(v, Path) else v
                      for k, v in dataclasses.asdict(result).items()})
