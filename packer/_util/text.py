"""Text from a dataset, made safe to print: a stranger picks class and file names and skip
messages, and a terminal obeys the control characters in them, so none reaches one raw."""
from __future__ import annotations

import json
import os

CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def printable(name: str) -> str:
    """``name`` as safe text: undecodable bytes and control characters as ``\\xNN`` escapes."""
    return os.fsencode(name).decode("utf-8", "backslashreplace").translate(CONTROLS)


def terminal_text(text: str) -> str:
    """``text`` with every control character escaped but its line breaks and tabs."""
    return text.translate({**CONTROLS, 0x09: "\t", 0x0A: "\n"})


def json_text(obj, indent=1) -> str:
    """JSON (``indent=None``: one line), non-ASCII kept, all control characters (C1 too) escaped."""
    text = json.dumps(obj, indent=indent, ensure_ascii=False)
    return "".join(f"\\u{ord(ch):04x}" if 0x7F <= ord(ch) < 0xA0 else ch for ch in text)


def is_utf8(text: str) -> bool:
    """False for text UTF-8 cannot hold: lone surrogates (os.fsdecode's, JSON's ``\\ud800``)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
