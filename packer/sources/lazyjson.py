"""JSON parsed with one key's bulky list values left as text, for the build's workers.

Polygons are over 80% of a COCO instances file, and only the workers that write the records
need them: parsing them in the main process was most of the time before the first image was
read. ``loads_deferring(text, key, within)`` cuts each value of ``key`` that looks like
polygons (a list holding no string or object, below) out of the text, parses the rest, and
puts each cut value back as ``Deferred`` text (``json.loads`` it where it is needed).

The result equals ``json.loads(text)`` but for those values: a value is cut only from ``[``
to the first ``]]`` after it, and only if that text holds no string or object; in its place
goes a string holding only a NUL character, which no string of a text without a ``\\u0000``
escape can hold (such a text is parsed whole). Every placeholder must come back as the
``key`` value of an object in the top-level list ``within`` (walked in text order, so the
n-th one found is the n-th cut; no hook runs for every object), else the text is parsed
whole; any surprise (a key inside a string, deeper nesting, a duplicate key) ends in that
check or in a parse error, after which the whole text is parsed, so errors name the real
line and column. If the rest parses and a cut value does not, the text was not JSON: the
worker that parses the value says so. The work stays linear in the text even when it is
built to make values overlap (then it is parsed whole).
"""
from __future__ import annotations

import json
import re
from typing import Any, List, Optional, Tuple

NUL = "\0"
PLACEHOLDER = '"\\u0000"'
LIST_END = re.compile(r"\]\s*\]")


class Deferred(str):
    """A value's JSON text, not yet parsed."""


def loads_deferring(text: str, key: str, within: Optional[str]) -> Any:
    """``json.loads(text)``, with the list-of-lists ``key`` values of the objects in the
    top-level list ``within`` (the text's own list where None) as ``Deferred`` text."""
    if "\\u0000" in text:
        return json.loads(text)
    kept, cut = cut_values(text, key)
    if not cut:
        return json.loads(text)
    try:
        data = json.loads(PLACEHOLDER.join(kept))
    except (ValueError, RecursionError):
        return json.loads(text)  # raises with the text's own line and column
    return data if put_back(data, within, key, cut) else json.loads(text)


def cut_values(text: str, key: str) -> Tuple[List[str], List[Deferred]]:
    """The text around the cut values, and the values; ``([text], [])`` if none is cut."""
    kept: List[str] = []
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
            return [text], []
        if start < pos or '"' in value or "{" in value:
            continue
        kept.append(text[pos:start])
        cut.append(value)
        pos = end.end()
    kept.append(text[pos:])
    return kept, list(map(Deferred, cut))


def put_back(data: Any, within: Optional[str], key: str, cut: List[Deferred]) -> bool:
    """Whether every placeholder was found, and replaced by its cut value: the items come in
    text order and each holds at most one, so once all are found the n-th is the n-th cut."""
    if within is None:
        items = data
    else:
        items = data.get(within) if type(data) is dict else None
    if type(items) is not list:
        return False
    n = 0
    for obj in items:
        if type(obj) is dict and obj.get(key) == NUL:
            obj[key] = cut[n]
            n += 1
    return n == len(cut)
