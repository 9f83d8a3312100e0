"""Naming data in object storage: which strings are URLs (``SCHEME://...``), the fsspec
filesystem, and how they are shown: userinfo, query strings and ``storage_options`` secrets
are replaced by ``***`` in every text that leaves this package."""
from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple
from urllib.parse import urlsplit

from ..errors import PackerError

CLOUD_EXTRA = 'pip install "packer-lmdb[cloud]"'
URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")  # in text, to a blank or quote
SECRET_KEYS = re.compile(r"key|secret|token|password|passwd|credential|sas|signature|auth",
                         re.IGNORECASE)
GCS_REQUEST_SECONDS = 120  # one ranged GET of packer_part_size (8 MiB): 70 KB/s at least
CLIENTS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
           "abfs": "adlfs", "abfss": "adlfs"}


@dataclass(frozen=True)
class Transfer:
    """packer's ``packer_*`` keys of ``storage_options``: the size of one ranged GET, how many
    run at once, how long one request may keep failing transiently before giving up."""
    part_size: int = 8 << 20
    parallel: int = 16
    retry_seconds: float = 120.0


def is_url(name: Any) -> bool:
    """True for ``SCHEME://...`` strings; a ``Path`` (or anything else) is a local path."""
    return isinstance(name, str) and bool(URL_RE.match(name))


def redact(url: str) -> str:
    """``url`` fit to show: userinfo and query string (signatures, SAS tokens) as ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = "***@" + parts.netloc.rsplit("@", 1)[1] if "@" in parts.netloc else parts.netloc
    out = f"{parts.scheme}://{netloc}{parts.path}"
    return out + ("?***" if parts.query else "") + ("#***" if parts.fragment else "")


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL redacted and each of ``secrets`` (4+ characters) blanked."""
    text = URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)
    for s in sorted(secrets, key=len, reverse=True):
        if len(s) >= 4:
            text = text.replace(s, "***")
    return text


def secret_values(options: Dict[str, Any]) -> Tuple[str, ...]:
    """The string values under credential-like keys of ``options`` (nested dicts too)."""
    out = []
    for k, v in options.items():
        if isinstance(v, dict):
            out += secret_values(v)
        elif isinstance(v, str) and SECRET_KEYS.search(str(k)):
            out.append(v)
    return tuple(out)


def url_secrets(url: str) -> Tuple[str, ...]:
    """The parts of ``url`` that ``redact`` hides (userinfo, query values), to blank them
    where a client quotes them without the URL around them."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return ()
    out = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        out += [userinfo, *userinfo.split(":")]
    for pair in (parts.query + "&" + parts.fragment).split("&"):
        out += [pair, pair.split("=", 1)[-1]]
    return tuple(s for s in out if s)


def split_options(storage_options: Optional[Dict[str, Any]]) -> Tuple[Dict[str, Any], Transfer]:
    """``storage_options`` -> (fsspec's options, packer's ``Transfer``)."""
    options = dict(storage_options or {})
    ours = {k: options.pop(k) for k in list(options) if k.startswith("packer_")}
    unknown = sorted(set(ours) - {f"packer_{f}" for f in Transfer.__dataclass_fields__})
    if unknown:
        raise PackerError(f"storage_options has unknown packer keys ({', '.join(unknown)}); "
                          f"known: packer_part_size, packer_parallel, packer_retry_seconds")
    transfer = Transfer(**{k[len("packer_"):]: v for k, v in ours.items()})
    seconds = transfer.retry_seconds
    whole = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
                for v in (transfer.part_size, transfer.parallel))
    if not (whole and isinstance(seconds, numbers.Real) and 0 <= seconds < math.inf):
        raise PackerError(f"storage_options: packer_part_size and packer_parallel must be whole "
                          f"numbers >= 1, packer_retry_seconds a number >= 0 (got packer_part_size"
                          f"={transfer.part_size!r}, packer_parallel={transfer.parallel!r}, "
                          f"packer_retry_seconds={seconds!r})")
    return options, transfer


def filesystem(url: str, options: Dict[str, Any]):
    """(fsspec filesystem, path within it) for ``url``; a missing client is a PackerError naming
    the pip command. S3 and GCS get bounded timeouts unless given (a stall must be retried,
    not hang)."""
    try:
        import fsspec
    except ImportError:
        raise PackerError(f"reading {redact(url)} needs the object-storage clients: "
                          f"{CLOUD_EXTRA}") from None
    scheme = url.split("://", 1)[0].lower()
    options = dict(options)
    if scheme in ("s3", "s3a"):
        options["config_kwargs"] = {"connect_timeout": 10, "read_timeout": 60,
                                    **(options.get("config_kwargs") or {})}
        if "endpoint_url" not in options and "endpoint_url" not in (options.get("client_kwargs") or {}):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                options["endpoint_url"] = endpoint
    elif scheme in ("gs", "gcs"):  # gcsfs: no limit by default; this one is per request
        options.setdefault("requests_timeout", GCS_REQUEST_SECONDS)
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError:
        client = CLIENTS.get(scheme, f"the fsspec client for {scheme}://")
        raise PackerError(f"reading {redact(url)} needs {client}: {CLOUD_EXTRA}") from None
    except ValueError as e:
        raise PackerError(f"{redact(url)}: {redact_text(str(e), secret_values(options) + url_secrets(url))}") from None
