"""One bulky top-level array of a JSON object, cut into pieces that parse on their own.

A COCO file's ``annotations`` list is nearly all of its text, and one process parsing it was
most of a 16-core ``--coco`` build's serial time. ``array_pieces`` cuts the list's text at
``}, {`` gaps near equal positions, so that several processes can parse it at once.

The cut needs no scan of the whole text, and is checked by the parses themselves: a cut
inside a string leaves that piece's string open, and a cut at any depth but the list's own
leaves its brackets unbalanced; so when every piece but the last parses as a JSON list of
its own (``[`` + piece + ``]``, with nothing left over), every cut fell between two of the
list's items. The last piece runs to the list's end (where its parse stops), and
``parse_around`` parses the rest of the text with a placeholder in the list's place,
which must come back as the top-level key's value: then the pieces' items, in order, are
the list ``json.loads`` would give. Any doubt gives None (callers parse the whole text).
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, List, Optional, Tuple

from .lazyjson import NUL, PLACEHOLDER  # a string no text without a "\\u0000" escape holds

ITEM_GAP = re.compile(r"\}\s*,\s*\{")
LAST_ITEM_END = re.compile(r"\}\s*\]")  # an object that ends a list

Piece = Tuple[int, Optional[int]]  # text[a:b]; b None for the last piece (to the list's end)


def array_pieces(text: str, key: str, pieces: int, last_share: float) -> List[Piece]:
    """Where to cut the list that follows the first ``"key": [`` in ``text``: up to
    ``pieces`` pieces, the last about ``last_share`` of the others' size (its parser also
    finds the list's end, at worst the slow way). Empty when the text has no such list or
    offers no gap to cut at."""
    m = re.search(r'"%s"\s*:\s*\[' % re.escape(key), text)
    if m is None or pieces < 2:
        return []
    start = m.end()
    step = (len(text) - start) / (pieces - 1 + last_share)
    out: List[Piece] = []
    a = start
    for j in range(1, pieces):
        gap = ITEM_GAP.search(text, max(a, start + round(j * step)))
        if gap is None:
            break
        out.append((a, gap.start() + 1))
        a = gap.end() - 1
    if not out:
        return []
    out.append((a, None))
    return out


def parse_piece(text: str, piece: Piece,
                loads: Callable[[str], Any] = json.loads) -> Tuple[list, int]:
    """The items of ``piece`` and where the list ended (the index after its ``]``; for all
    but the last piece, the piece's end). ``loads`` parses each piece (it must refuse text
    with anything after the list); the last piece's end is where an object first ends a
    list, and only if that does not parse (a list of objects inside an item, ``}]`` in a
    string) is the last piece parsed by ``json`` to find it. Raises ValueError where the
    piece is not a list of whole items (the cut was not where ``array_pieces`` meant)."""
    a, b = piece
    if b is None:
        end = LAST_ITEM_END.search(text, a)
        try:
            if end is not None:
                return parse_piece(text, (a, end.start() + 1), loads)[0], end.end()
        except (ValueError, RecursionError):
            pass  # a list inside an item, or "}]" in a string: found the slow way
        items, stop = json.JSONDecoder().raw_decode("[" + text[a:])
        return items, a - 1 + stop
    items = loads("[" + text[a:b] + "]")
    if type(items) is not list:
        raise ValueError("not a list")
    return items, b


def parse_around(text: str, pieces: List[Piece], end: int, key: str) -> Optional[dict]:
    """The top-level object, parsed with a placeholder for the list the pieces cover (it
    ends at ``end``): None unless the placeholder is the object's ``key`` value, and the
    text around the list holds no ``\\u0000`` escape (a key given twice could then hold a
    NUL string of its own). The pieces check their own text (``lazyjson``)."""
    opening = pieces[0][0] - 1  # the list's "["
    head, tail = text[:opening], text[end:]
    if "\\u0000" in head or "\\u0000" in tail:  # a NUL string of its own: not a placeholder
        return None
    try:
        data = json.loads(head + PLACEHOLDER + tail)
    except (ValueError, RecursionError):
        return None
    return data if type(data) is dict and data.get(key) == NUL else None
