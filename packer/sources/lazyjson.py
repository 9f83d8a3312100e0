"""JSON parsed with one key's bulky list values left as text, for the build's workers.

Polygons are over 80% of a COCO instances file, and only the workers that write the records
need them: parsing them in the main process was most of the time before the first image was
read. ``loads_deferring(text, key)`` cuts each value of ``key`` that looks like polygons (a
list holding no string or object, below) out of the text, parses the rest, and puts each cut
value back as ``Deferred`` text (``json.loads`` it where it is needed).

The result equals ``json.loads(text)`` but for those values: a value is cut only from ``[``
to the first ``]]`` after it, and only if that text holds no string or object; in its place
goes a string holding a NUL character, which no string of a text without a ``\\u0000``
escape can hold (such a text is parsed whole). Every placeholder must come back in place of
a ``key`` value, else the text is parsed whole; any surprise (a key inside a string, deeper
nesting) ends in that check or in a parse error, after which the whole text is parsed,
so errors name the real line and column. If the rest parses and a cut value does not, the
text was not JSON: the worker that parses the value says so. The work stays linear in the
text even when it is built to make values overlap (then it is parsed whole).
"""
from __future__ import annotations

import json
import re
from typing import Any, List

NUL = "\0"
LIST_END = re.compile(r"\]\s*\]")


class Deferred(str):
    """A value's JSON text, not yet parsed."""


def loads_deferring(text: str, key: str) -> Any:
    """``json.loads(text)``, with ``key``'s list-of-lists values as ``Deferred`` text."""
    if "\\u0000" in text:
        return json.loads(text)
    parts: List[str] = []
    cut: List[str] = []
    pos = scanned = 0
    end = None
    for m in re.finditer(r'"%s"\s*:\s*\[(?!\s*\])' % re.escape(key), text):  # not "[]"
        start = m.end() - 1
        if end is None or end.start() < start:  # else the next "]]" is still that one
            end = LIST_END.search(text, start)
            if end is None:
                break
        value = text[start:end.end()]
        scanned += len(value)
        if scanned > 2 * len(text):  # values overlapping again and again: not a COCO file
            return json.loads(text)
        if start < pos or '"' in value or "{" in value:
            continue
        parts += (text[pos:start], '"\\u0000%d"' % len(cut))
        cut.append(value)
        pos = end.end()
    if not cut:
        return json.loads(text)
    parts.append(text[pos:])
    restored = [0]

    def restore(obj: dict) -> dict:
        v = obj.get(key)
        if type(v) is str and v[:1] == NUL:
            obj[key] = Deferred(cut[int(v[1:])])
            restored[0] += 1
        return obj

    try:
        data = json.loads("".join(parts), object_hook=restore)
    except (ValueError, RecursionError):
        return json.loads(text)  # raises with the text's own line and column
    return data if restored[0] == len(cut) else json.loads(text)
