"""Text from a dataset, made safe to print: a stranger picks class names, file names and the
messages stored with skipped files, and a terminal obeys the control characters in them
(cursor moves, colours, window titles, answer-back), so none reaches one raw."""
from __future__ import annotations

import json
import os

CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def printable(name: str) -> str:
    """``name`` as safe text: undecodable bytes and control characters as ``\\xNN`` escapes."""
    return os.fsencode(name).decode("utf-8", "backslashreplace").translate(CONTROLS)


def terminal_text(text: str) -> str:
    """``text`` with every control character escaped but its line breaks and tabs."""
    return "\n".join(line.translate({**CONTROLS, 0x09: "\t"}) for line in text.split("\n"))


def json_text(obj, indent=1) -> str:
    """JSON (indented, or one line with ``indent=None``), non-ASCII kept, every control character
    escaped (C1 too: terminals obey them)."""
    text = json.dumps(obj, indent=indent, ensure_ascii=False)
    return "".join(f"\\u{ord(ch):04x}" if 0x7F <= ord(ch) < 0xA0 else ch for ch in text)


def is_utf8(text: str) -> bool:
    """False for text UTF-8 cannot hold: lone surrogates, from names holding bytes that are
    not UTF-8 (surrogate-escaped by os.fsdecode) or from JSON's ``\\ud800`` escapes."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
