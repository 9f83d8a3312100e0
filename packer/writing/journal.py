"""The resume journal (``.packer-build.json``: a JSON header, then a line per finished shard),
and the rule that packer removes only files it wrote: packer-named files in DST that no journal
or manifest claims are refused, never deleted."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import msgpack

from .._util.fsio import (LOCK_NAME, append_durably, check_folder, fsync_dir, remove_own,
                          write_json_atomic)
from ..errors import PackerError
from ..format.manifest import FORMAT_VERSION, LABELS, MANIFEST, OFFSETS, read_manifest, side_tables
from ..format.validation import is_plain_name
from ..sources.base import ImageList
from .shard import disk_errors, existing_shard_ok

JOURNAL = ".packer-build.json"
# Names a build writes: shards, their temp files, side tables, manifest, journal (+ ".tmp").
BUILD_PATTERNS = ("shard-*.lmdb", ".shard-*", "column-*", "paths.*", LABELS, OFFSETS, MANIFEST,
                  JOURNAL, LABELS + ".tmp", OFFSETS + ".tmp", MANIFEST + ".tmp", JOURNAL + ".tmp")


def fingerprint(source: ImageList, options: dict) -> str:
    """Identifies a build's input (its folder too) and options: a re-run with the same resumes."""
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT_VERSION, str(source.root.resolve()), source.classes, options],
                        sort_keys=True).encode("utf-8", "surrogateescape"))
    return _listed(h, source)


def input_digest(source: ImageList) -> str:
    """The hash of what a source lists (classes, files, labels, annotations), wherever it is."""
    return _listed(hashlib.sha256(json.dumps(source.classes).encode("utf-8", "surrogateescape")),
                   source)


def _listed(h, source: ImageList) -> str:
    for rel, label in source.entries:
        h.update(f"{rel}\t{label}\n".encode("utf-8", "surrogateescape"))
    ann = source.annotations
    if ann is not None:
        h.update(json.dumps([ann.schema, ann.task, ann.extra,
                             getattr(ann.fit, "__qualname__", None)], sort_keys=True).encode())
        if ann.digest is not None:  # the hash of the input the rows were read from
            h.update(f"digest\t{ann.digest}\n".encode())
        else:
            for row in ann.rows:
                h.update(msgpack.packb(row, use_bin_type=True, default=repr))
    return h.hexdigest()


def packer_names(dst: Path) -> List[str]:
    """Files in ``dst`` with names a build writes."""
    return sorted({p.name for pattern in BUILD_PATTERNS for p in dst.glob(pattern)})


def refuse_foreign_files(dst: Path, names: Iterable[str]) -> None:
    """Stop unless ``names`` is empty; the journal's own temp file never counts (a run killed
    while writing the first journal leaves only that)."""
    names = sorted(set(names) - {JOURNAL + ".tmp"})
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise PackerError(f"{dst} holds files named like a packer dataset's that no packer "
                          f"manifest or build journal there lists ({shown}); packer does not "
                          f"delete files it did not write. Move them away or pick an empty folder")


def remove_dataset(dst: Path, manifest: dict) -> None:
    """Remove the finished dataset in ``dst``: its manifest first, durably (a half-removed
    dataset must not look complete), then the files it or a journal claims."""
    own = {s["path"] for s in manifest["shards"] if is_plain_name(s["path"])}
    own |= {entry["path"] for _, entry, _ in side_tables(manifest)}
    own |= {n for n in packer_names(dst) if n.startswith(".") or n.endswith(".tmp")}
    own |= claimed(dst)  # a journal left by a run killed after its manifest: its names too
    own.discard(JOURNAL)  # rewritten below, removed by the run that finishes
    refuse_foreign_files(dst, set(packer_names(dst)) - own - {MANIFEST, JOURNAL})
    claim(dst, own)  # before the manifest goes: a re-run still knows they are packer's
    remove_own(dst, MANIFEST)
    fsync_dir(dst)
    for name in sorted(own):
        remove_own(dst, name)


def claim(dst: Path, names: Iterable[str]) -> None:
    """Record, before writing or removing them, that ``names`` in ``dst`` are packer's: an
    interrupted merge or overwrite can then be re-run (a journal with no fingerprint)."""
    _write(dst, {"fingerprint": "", "shards": [], "skipped": [], "next_entry": 0,
                 "owned": sorted(names)})


def claimed(dst: Path) -> set:
    """Names this folder's journal says packer wrote (or is removing), with their temp files."""
    j = read(dst) or {}
    names = {s["path"] for s in j.get("shards", [])} | set(j.get("owned", []))
    return names | {n + ".tmp" for n in names} | {JOURNAL}


def load(dst: Path, fp: str) -> dict:
    """The journal of an earlier run with the same fingerprint (cut back to its last good
    shard), or a fresh one; rewritten whole before this run appends to it."""
    j = read(dst)
    if j is None:  # a fresh build: whatever has packer's names here is not ours
        refuse_foreign_files(dst, packer_names(dst))
        return restart(dst, fp)
    for name in packer_names(dst):  # temp files of the run that wrote this journal
        if name.startswith(".shard-"):
            remove_own(dst, name)
    if j.get("fingerprint") != fp:  # different source or options: restart cleanly
        return restart(dst, fp)
    for n, shard in enumerate(j["shards"]):  # keep what checks out, redo the rest
        if existing_shard_ok(shard, dst) is not None:
            cut = j["shards"][n - 1]["next_entry"] if n else 0
            j["shards"] = j["shards"][:n]
            j["skipped"] = [s for s in j["skipped"] if s["entry"] < cut]
            j["dropped"] = [s for s in j.get("dropped", []) if s["entry"] < cut]
            j["next_entry"] = cut
            break
    state = {"shards": [dict(s) for s in j["shards"]], "skipped": j["skipped"],
             "dropped": j.get("dropped", []), "next_entry": j["next_entry"]}
    save(dst, fp, **state, owned=j.get("owned", []))  # side tables claimed before: still ours
    return state


def restart(dst: Path, fp: str) -> dict:
    """Drop what the interrupted run this journal belongs to wrote; a fresh journal for ``fp``."""
    mine = claimed(dst) - {JOURNAL}
    for name in packer_names(dst):
        if name in mine or name.startswith(("shard-", ".shard-")):
            remove_own(dst, name)
    save(dst, fp, [], [], 0)
    return {"shards": [], "skipped": [], "dropped": [], "next_entry": 0}


def read(dst: Path) -> Optional[dict]:
    """The journal in ``dst``, its lines applied up to one a kill cut short: None if there is
    none, {} unless well formed (plain names)."""
    path = dst / JOURNAL
    if not path.is_file():
        return None
    try:
        text = path.read_text("utf-8")
        j, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    try:
        for line in text[end:].split("\n"):  # not splitlines: paths may hold U+2028 and such
            if line.strip():
                rec = json.loads(line)
                if rec["shard"] is not None:
                    j["shards"].append(rec["shard"])
                j["skipped"].extend(rec["skipped"])
                j.setdefault("dropped", []).extend(rec["dropped"])
                j["next_entry"] = rec["next_entry"]
                if j["shards"]:
                    j["shards"][-1]["next_entry"] = rec["next_entry"]
    except ValueError:  # a line cut short: the ones before it stand
        pass
    except (KeyError, TypeError, AttributeError, RecursionError):
        return {}
    ok = (isinstance(j, dict) and isinstance(j.get("shards"), list)
          and isinstance(j.get("skipped"), list) and isinstance(j.get("next_entry"), int)
          and isinstance(j.get("dropped", []), list)
          and all(isinstance(s, dict) and is_plain_name(s.get("path")) for s in j["shards"])
          and isinstance(j.get("owned", []), list)
          and all(is_plain_name(n) for n in j.get("owned", [])))
    return j if ok else {}


def append(dst: Path, shard: Optional[dict], skipped: Sequence[dict], dropped: Sequence[dict],
           next_entry: int) -> None:
    """Record a finished shard (None: all its images skipped) with the skips and drops since
    the last record, as one appended line (rewriting the journal would be quadratic)."""
    line = json.dumps({"shard": shard, "skipped": list(skipped), "dropped": list(dropped),
                       "next_entry": next_entry}, ensure_ascii=False) + "\n"
    with disk_errors(dst / JOURNAL):
        append_durably(dst / JOURNAL, line.encode("utf-8"))


def save(dst: Path, fp: str, shards: List[dict], skipped: List[dict], next_entry: int,
         dropped: Sequence[dict] = (), owned: Sequence[str] = ()) -> None:
    """The whole journal, rewritten (the header ``append`` adds lines to)."""
    if shards:
        shards[-1]["next_entry"] = next_entry
    _write(dst, {"fingerprint": fp, "shards": shards, "skipped": skipped,
                 "dropped": list(dropped), "next_entry": next_entry,
                 **({"owned": sorted(owned)} if owned else {})})


def _write(dst: Path, j: dict) -> None:
    with disk_errors(dst / JOURNAL):
        write_json_atomic(dst / JOURNAL, j)


def finished(dst: Path, fp: str) -> Optional[dict]:
    """The manifest in ``dst`` if the run with fingerprint ``fp`` wrote it (a re-run after a
    kill once the dataset was complete), its leftovers removed; else None."""
    man = read_manifest(dst)
    if not fp or man.get("fingerprint") != fp:
        return None
    remove_leftovers(dst, man)
    return man


def remove_leftovers(dst: Path, manifest: dict) -> None:
    """After the manifest: the journal, temp files, shard files and files the journal claims
    that ``manifest`` does not list (an interrupted attempt's that came out otherwise)."""
    keep = {s["path"] for s in manifest["shards"]} | {MANIFEST}
    keep |= {entry["path"] for _, entry, _ in side_tables(manifest)}
    mine = claimed(dst)
    for name in packer_names(dst):
        if name not in keep and (name in mine or name.startswith((".", "shard-"))):
            remove_own(dst, name)


def claim_more(dst: Path, names: Iterable[str]) -> None:
    """Claim ``names`` in the build journal before they are written: a restart removes them."""
    j = read(dst) or {}
    j["owned"] = sorted(set(j.get("owned", [])) | set(names))
    _write(dst, j)


def check_dst(dst) -> None:
    """Refuse, before anything is written, a file, a folder that cannot be created, or a
    non-empty folder holding neither a packer dataset nor an unfinished run's journal."""
    check_folder(dst, marks=(MANIFEST, JOURNAL), leftovers=(LOCK_NAME, JOURNAL + ".tmp"),
                 fix="pick a new or empty folder for the dataset, or move those files away")
