"""Looking inside a dataset: ``info``, ``verify``, ``ls``, ``cat`` (the CLI's read-only side)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from .errors import FormatError, PackerError
from .format.fields import ArrayField, DataField, field_of
from .format.records import crc32, record_problem, unpack_record
from .format.manifest import classes_text, dataset_schema, file_sha256, read_manifest, shard_file, side_tables
from ._util.system import human_size
from .writing.check import DEFAULT_MAX_PIXELS, BadImage, check_image
from .reading.reader import ShardReader, open_reader
from .format.tables import read_column, read_labels, read_paths
from .format.lmdbfile import shard_records
from ._util.text import printable


def info(root: os.PathLike, storage_options: Optional[dict] = None) -> dict:
    """The ``info --json`` object: the manifest's facts, shard paths as given; reads only that."""
    from .storage.local import is_url, manifest, redact
    m = manifest(root, storage_options)
    return {
        "path": redact(root) if is_url(root) else str(Path(root)), "format_version": m["format_version"],
        "packer_version": m.get("packer_version"), "created": m.get("created"),
        "count": m["count"], "bytes": m["bytes"], "classes": m["classes"],
        "class_counts": m.get("class_counts"),
        "shards": [{"path": s["path"], "count": s["count"], "bytes": s["bytes"],
                    "sha256": s["sha256"]} for s in m["shards"]],
        "skipped": [{"path": s["path"], "reason": s["reason"]} for s in m["skipped"]],
        "options": m.get("options", {}), "source": m.get("source"), "pil": m.get("pil"),
        "task": dataset_schema(m)["task"], "fields": dataset_schema(m)["fields"],
        "columns": sorted(["label"] * bool(m.get("labels")) + list(m.get("columns") or {})),
        "dropped_count": m.get("dropped_count", 0), "skipped_empty": m.get("skipped_empty", 0),
        "categories": m.get("categories"),
        "dropped": [{"path": d["path"], "reason": d["reason"]} for d in m.get("dropped", [])],
    }


def format_info(i: dict, max_classes: int = 20) -> str:
    """A human summary of :func:`info`; every name from the dataset is made printable."""
    def p(value) -> str:
        return printable(str(value))

    lines = [f"{p(i['path'])}: {i['count']} images, {classes_text(i)}, "
             f"{len(i['shards'])} shard(s), {human_size(i['bytes'])} (format "
             f"{p(i['format_version'])}, packer {p(i['packer_version'])}, {p(i['created'])})"]
    opts = i.get("options") if isinstance(i.get("options"), dict) else {}
    t = opts.get("transcode") if isinstance(opts.get("transcode"), dict) else None
    lines.append("build: " + ", ".join([
        f"source {p(i.get('source'))}",
        "bytes stored unchanged" if not t else
        f"transcoded to JPEG q{p(t.get('quality'))} (max side {p(t.get('max_side'))}, short side "
        f"{p(t.get('short_side'))})",
        f"shuffled (seed {p(opts.get('seed'))})" if opts.get("shuffle") else "source order",
    ] + ([f"part {p(opts['part'])}"] if opts.get("part") else [])))
    lines.append(f"task: {p(i['task'])}; fields: " + (", ".join(
        p(f["name"]) + " " + (f"{p(f['dtype'])}{p(f['shape'])}" if f["type"] == "array" else p(f["type"]))
        for f in i["fields"]) or "none") + f"; columns: {', '.join(map(p, i['columns'])) or 'none'}")
    categories = i.get("categories")
    if isinstance(categories, list) and all(isinstance(c, dict) for c in categories):
        lines.append("categories (labels are these ids):")  # COCO: labels are category ids
        rows = [(c.get("id"), c.get("name"), None) for c in categories]
    else:
        lines.append("classes:")
        rows = list(zip(range(len(i["classes"])), i["classes"],
                        i.get("class_counts") or [None] * len(i["classes"])))
    lines += [f"  {p(label):>5}  {p(c)}  {k if k is not None else ''}".rstrip()
              for label, c, k in rows[:max_classes]]
    if len(rows) > max_classes:
        lines.append(f"  ... {len(rows) - max_classes} more (see --json)")
    lines += ["shards:"] + [f"  {p(s['path'])}  {s['count']} records  {human_size(s['bytes'])}"
                            for s in i["shards"]]
    lines.append(f"skipped: {len(i['skipped'])}")
    lines += [f"  {p(s['path'])}: {p(s['reason'])}" for s in i["skipped"][:10]]
    if len(i["skipped"]) > 10:
        lines.append(f"  ... {len(i['skipped']) - 10} more (see --json)")
    if i.get("skipped_empty"):
        lines.append(f"left out (--skip-empty): {i['skipped_empty']} images without annotations")
    if i["dropped_count"]:
        lines.append(f"annotations dropped (images kept): {i['dropped_count']}")
        lines += [f"  {p(d['path'])}: {p(d['reason'])}" for d in i["dropped"][:10]]
    return "\n".join(lines)


@dataclass
class Report:
    checked_shards: int = 0
    checked_records: int = 0
    problems: List[str] = field(default_factory=list)
    skipped_checks: str = ""  # what a quick check did not look at

    @property
    def ok(self) -> bool:
        return not self.problems


QUICK_SKIPS = "records were not read, decoded or compared with labels.i32 (quick)"


def verify(root: os.PathLike, *, quick: bool = False, progress: bool = True,
           max_pixels: int = DEFAULT_MAX_PIXELS, storage_options: Optional[dict] = None,
           cache_dir: Optional[os.PathLike] = None) -> Report:
    """Check what training relies on and report every problem found: the manifest, every shard's
    size, SHA-256 and LMDB structure, the side tables, labels; unless ``quick`` also every
    record's fields, CRC-32, decode (within the caller's ``max_pixels``, default PIL's) and
    sizes. A URL's shards are fetched into ``cache_dir`` first, each SHA-256 checked."""
    if not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels < 1:
        raise PackerError(f"verify(max_pixels): a positive pixel count, got {max_pixels!r}")
    from .storage.local import is_url, local_root
    if is_url(root):
        with local_root(root, storage_options, cache_dir) as local:
            return verify(local, quick=quick, progress=progress, max_pixels=max_pixels)
    root = Path(root)
    m = read_manifest(root)
    rep = Report(skipped_checks=QUICK_SKIPS if quick else "")
    readable = _check_shards(root, m, rep, progress)
    for _, t, _ in side_tables(m):
        if not (root / t["path"]).is_file():
            rep.problems.append(f"{t['path']}: missing (readers need it)")
            readable = False
        elif file_sha256(root / t["path"]) != t["sha256"]:
            rep.problems.append(f"{t['path']}: sha256 does not match the manifest")
    try:
        labels = read_labels(root, m)
        columns = {name: read_column(root, name, m) for name in (m.get("columns") or {})}
    except FormatError as e:
        rep.problems.append(str(e))
        return rep
    if m.get("labels") is not None:
        columns["label"] = labels
    bad = [i for i, lab in enumerate(labels) if not 0 <= lab < len(m["classes"])]
    if bad:
        rep.problems.append(f"labels.i32: {len(bad)} label(s) outside 0..{len(m['classes']) - 1} "
                            f"(the dataset has {len(m['classes'])} classes), first at record "
                            f"{bad[0]}: {labels[bad[0]]}")
    if not quick and readable:
        try:
            _check_records(root, m, columns, rep, progress, max_pixels)
        except FormatError as e:  # the dataset cannot be opened for reading: one more problem
            rep.problems.append(str(e))
    return rep


def _check_shards(root: Path, m: dict, rep: Report, progress: bool) -> bool:
    """Sizes, checksums and structure; False if some shard cannot be read safely."""
    from tqdm.auto import tqdm  # imported only when used: it costs more than a quick verify
    readable = True
    with tqdm(total=m["bytes"], unit="B", unit_scale=True, desc="checksums",
              disable=not progress) as bar:
        for s in m["shards"]:
            try:
                p = shard_file(root, s["path"])
            except FormatError as e:
                rep.problems.append(str(e))
                readable = False
                continue
            if not p.is_file():
                rep.problems.append(f"{s['path']}: missing")
                readable = False
                continue
            if p.stat().st_size != s["bytes"]:
                rep.problems.append(f"{s['path']}: size {p.stat().st_size} != manifest {s['bytes']}")
                readable = False
                continue
            if file_sha256(p, bar.update) != s["sha256"]:
                rep.problems.append(f"{s['path']}: sha256 does not match the manifest")
            try:
                entries = len(shard_records(p)) // 2
            except FormatError as e:
                rep.problems.append(f"{s['path']}: {e}")
                readable = False
                continue
            if entries != s["count"]:
                rep.problems.append(f"{s['path']}: holds {entries} records, the manifest says {s['count']}")
            rep.checked_shards += 1
    return readable


def _check_records(root: Path, m: dict, columns: dict, rep: Report, progress: bool,
                   max_pixels: int) -> None:
    from .reading.masks import segmentation_problem  # torch: only a full verify needs them
    from .reading.targets import TargetMaker
    from tqdm.auto import tqdm
    reader = ShardReader(root, m)
    make_target = TargetMaker(dataset_schema(m))
    try:
        paths = read_paths(root, m)
    except FormatError as e:
        rep.problems.append(str(e))
        paths = None
    fields = [field_of(f) for f in dataset_schema(m)["fields"]]
    segmented = any(f.name == "segmentation" for f in fields)

    def target_problem(rec: dict, i: int) -> str:
        try:
            make_target(rec)
        except FormatError as e:
            return str(e)
        if paths is not None and paths[i] != rec["path"]:
            return f"its path {printable(rec['path'])!r} != paths.utf8's {printable(paths[i])!r}"
        if segmented:
            problem = segmentation_problem(rec["segmentation"], rec["height"], rec["width"])
            return f"segmentation: {problem}" if problem else ""
        return ""
    try:
        for i in tqdm(range(len(reader)), unit="rec", desc="records", disable=not progress):
            where = f"record {i} ({reader.paths[reader.locate(i)[0]].name})"
            rep.checked_records += 1
            try:
                rec = unpack_record(reader.read(i))
            except FormatError as e:
                rep.problems.append(f"{where}: unreadable: {e}")
                continue
            problem = record_problem(rec, fields) or target_problem(rec, i)
            wrong = next((n for n, col in columns.items() if rec.get(n) != col[i]), None)
            if problem:
                rep.problems.append(f"{where}: {problem}")
            elif crc32(rec["image"]) != rec["crc32"]:
                rep.problems.append(f"{where} {printable(rec['path'])}: image checksum mismatch")
            elif wrong is not None:
                table = "labels.i32" if wrong == "label" else f"its {wrong} column"
                rep.problems.append(f"{where} {printable(rec['path'])}: {wrong} {rec[wrong]} != "
                                    f"{table} {columns[wrong][i]}")
            else:
                problem = image_problem(rec, max_pixels)
                if problem:
                    rep.problems.append(f"{where} {printable(rec['path'])}: {problem}")
    finally:
        reader.close()


def image_problem(rec: dict, max_pixels: int) -> str:
    """Why a record's image does not decode within ``max_pixels`` at its record's size, or ""."""
    try:
        c = check_image(rec["image"], max_pixels=max_pixels)
    except BadImage as e:
        hint = " (verify's max_pixels: raise it for a dataset you trust)" if "max_pixels" in str(e) else ""
        return f"does not decode: {e}{hint}"
    if (c.width, c.height) != (rec["width"], rec["height"]):
        return (f"the image is {c.width}x{c.height} pixels, its record says "
                f"{rec['width']}x{rec['height']}")
    return ""


def ls(root: os.PathLike, storage_options: Optional[dict] = None,
       cache_dir: Optional[os.PathLike] = None) -> Iterator[Tuple[int, int, str]]:
    """(index, label, source path) of every record, in order (label -1 without class labels)."""
    for i, rec, _ in checked_records(root, storage_options, cache_dir):
        yield i, rec.get("label", -1), rec["path"]


def ls_fields(root: os.PathLike, storage_options: Optional[dict] = None,
              cache_dir: Optional[os.PathLike] = None) -> Iterator[dict]:
    """Every record's fields for a listing (arrays as their shape), with index, path and size."""
    for i, rec, fields in checked_records(root, storage_options, cache_dir):
        row = {"index": i, "path": rec["path"], "width": rec["width"], "height": rec["height"]}
        for f in fields:
            v = rec.get(f.name)
            if isinstance(f, ArrayField):
                v = list(f.shape_of(len(v)))
            elif isinstance(f, DataField):
                v = f"<{type(v).__name__} of {len(v)}>" if isinstance(v, (list, dict)) else v
            row[f.name] = v
        yield row


def checked_records(root: os.PathLike, storage_options: Optional[dict] = None,
                    cache_dir: Optional[os.PathLike] = None) -> Iterator[tuple]:
    """(index, record, schema fields) of every record; a FormatError at one of the wrong types."""
    from .storage.local import shown
    where = shown(root)
    with open_reader(root, storage_options, cache_dir) as reader:
        fields = [field_of(f) for f in dataset_schema(reader.manifest)["fields"]]
        for i in range(len(reader)):
            data = reader.read(i)  # a damaged shard: an error naming it
            try:
                rec = unpack_record(data)
            except FormatError as e:
                raise FormatError(f"record {i} of {where}: {e}; run `packer verify {where}`") from None
            problem = record_problem(rec, fields)
            if problem:
                raise FormatError(f"record {i} of {where}: {problem}; run `packer verify {where}`")
            yield i, rec, fields


def cat(root: os.PathLike, index: int, storage_options: Optional[dict] = None,
        cache_dir: Optional[os.PathLike] = None) -> bytes:
    """The stored image bytes of record ``index`` (of a URL: only its shard is fetched)."""
    with open_reader(root, storage_options, cache_dir) as reader:
        return reader.record(index)["image"]
