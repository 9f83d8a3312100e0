"""loads_deferring: the same data as json.loads, with one key's polygon lists left as text."""
from __future__ import annotations

import json
import random
import re

import pytest

from packer.sources.lazyjson import Deferred, loads_deferring


def parsed(v):
    """``v`` with every Deferred value parsed."""
    if isinstance(v, Deferred):
        return json.loads(v)
    if isinstance(v, dict):
        return {k: parsed(x) for k, x in v.items()}
    if isinstance(v, list):
        return [parsed(x) for x in v]
    return v


def deferred_count(v) -> int:
    if isinstance(v, Deferred):
        return 1
    if isinstance(v, dict):
        return sum(deferred_count(x) for x in v.values())
    if isinstance(v, list):
        return sum(deferred_count(x) for x in v)
    return 0


def deferred_texts(v) -> list:
    """The Deferred values in ``v``, in order."""
    if isinstance(v, Deferred):
        return [str(v)]
    if isinstance(v, dict):
        v = list(v.values())
    return [t for x in v for t in deferred_texts(x)] if isinstance(v, list) else []


def rule_cuts(text: str, key: str) -> list:
    """The values the module docstring says are cut, found the plain way (no placeholders,
    no parse): what ``loads_deferring`` must give whenever it defers at all."""
    out, pos = [], 0
    for m in re.finditer(r'"%s"\s*:\s*\[(?!\s*\])' % re.escape(key), text):
        end = re.compile(r"\]\s*\]").search(text, m.end() - 1)
        if end is None:
            break
        value = text[m.end() - 1:end.end()]
        if m.start() >= pos and '"' not in value and "{" not in value:
            out.append(value)
            pos = end.end()
    return out


def check(text: str, deferred: int, within: str = "a") -> None:
    """``loads_deferring`` gives ``json.loads``'s data, with ``deferred`` values as text,
    each the text the rule cuts (or, with none, the text was parsed whole)."""
    out = loads_deferring(text, "seg", within)
    assert parsed(out) == json.loads(text)
    assert deferred_count(out) == deferred
    if deferred:
        assert deferred_texts(out) == rule_cuts(text, "seg")


SEG = [[1.5, 2, 3e2, -4, 5, 6]]


@pytest.mark.parametrize("doc, deferred", [
    ({"a": [{"seg": SEG}, {"seg": SEG + [[7, 8]]}]}, 2),
    ({"a": [{"seg": {"counts": "x]]", "size": [1, 2]}}]}, 0),  # an RLE: parsed here
    ({"a": [{"seg": [["x]]"]]}]}, 0),  # a string inside: parsed here
    ({"a": [{"seg": [[[1]], [2]]}]}, 0),  # deeper: the first ]] is not the end
    ({"a": [{"seg": [1, [2, 3]]}]}, 1),  # any list: the reader of the text checks it
    ({"a": [{"x\"seg": [[1, 2]]}]}, 0),  # the key inside another key's text
    ({"a": [{"seg": [[1]], "other": "\u0000"}]}, 0),  # a NUL anywhere: parsed whole
    ({"a": [{"seg": [["s", 1]]}]}, 0),  # a string in a list that parses: not cut either
    ({"a": [{"seg": [[1, {}]]}]}, 0),  # nor an object
    ({"a": [{"seg": "[[1]]"}, {"seg": [[2]]}, {"seg": 3}, {"seg": [[4]]}]}, 2),
    ({"a": [{"seg": [[1]]}, 7, "s", [[2]], {"seg": [[3], [4, 5]]}, {"b": 1}]}, 2),
    ({"a": [{"seg": [[1]]}], "b": {"seg": [[2]]}}, 0),  # a cut outside "a": parsed whole
    ({"a": [{"seg": [[1]], "b": {"seg": [[2]]}}]}, 0),  # one deeper in an item: the same
    ({"seg": [[1]], "a": [{"seg": [[2]]}]}, 0),
    ({"a": {"seg": [[1]]}}, 0),  # "a" is not a list
    ({"a": [{"seg": []}]}, 0),
])
@pytest.mark.parametrize("indent", [None, 1])
def test_same_data_as_json_loads(doc, deferred, indent):
    check(json.dumps(doc, indent=indent), deferred)


def test_a_top_level_list_is_parsed_whole():
    check(json.dumps([{"seg": [[1]]}]), 0)


@pytest.mark.parametrize("seg", [
    "[[1, 2]]", "[[1, 2] ]", "[[1, 2]\n\t]", "[ [1] , [2] ]", "[[1], [2],[3]]", "[[1],\n[2]\r\n]",
    "[[1, 2]]]", "[[1, 2] ]]", "[1, 2]]", "[[1}]]"])
def test_every_way_a_value_can_end_cuts_what_the_rule_says(seg):
    """Whatever the space before the closing brackets, what is cut is what the rule cuts.
    Text that is not JSON fails as json.loads does, or (the rest parses) leaves a value its
    reader cannot parse."""
    text = '{"a": [{"seg": %s, "n": 1}, {"seg": [[7]]}]}' % seg
    try:
        want = json.loads(text)
    except json.JSONDecodeError as e:
        want = e
    try:
        out = loads_deferring(text, "seg", "a")
    except json.JSONDecodeError as e:
        assert (e.msg, e.pos) == (want.msg, want.pos)
        return
    assert deferred_texts(out) == rule_cuts(text, "seg") and deferred_count(out) == 2
    if isinstance(want, ValueError):
        with pytest.raises(json.JSONDecodeError):
            parsed(out)
    else:
        assert parsed(out) == want


def test_random_documents_read_as_json_loads_does():
    """Many polygons, rings and layouts (any indent, spaces around brackets): the cut texts
    and the data are what the rule and json.loads give."""
    rnd = random.Random(7)
    for _ in range(200):
        items = []
        for k in range(rnd.randrange(1, 8)):
            rings = [[rnd.choice([rnd.randrange(-9, 999), rnd.uniform(-1e3, 1e3)])
                      for _ in range(rnd.randrange(0, 7))] for _ in range(rnd.randrange(1, 4))]
            seg = rnd.choice([rings, rings, [], {"counts": [1, 2], "size": [3, 4]}])
            items.append({"id": k, "seg": seg} if rnd.random() < 0.9 else [k])
        indent = rnd.choice([None, 0, 1, 2, "\t"])
        text = json.dumps({"b": 1, "a": items}, indent=indent)
        if rnd.random() < 0.3:
            text = text.replace("]", rnd.choice([" ]", "]  ", "\n]"]))
        out = loads_deferring(text, "seg", "a")
        assert parsed(out) == json.loads(text)
        assert deferred_texts(out) == rule_cuts(text, "seg")


def test_duplicate_keys_parse_as_json_loads_does():
    text = '{"a": [{"seg": [[1]], "seg": [[2]]}]}'
    out = loads_deferring(text, "seg", "a")
    assert parsed(out) == json.loads(text) == {"a": [{"seg": [[2]]}]}


@pytest.mark.parametrize("text", [
    '{"seg": [[1, 2]]]}',  # a stray ] after the cut value
    '{"seg": [[1, 2]], "x": }',
    '{"seg": [[1, 2]]',  # cut short
])
def test_errors_name_the_texts_own_position(text):
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as got:
        loads_deferring(text, "seg", "a")
    assert (got.value.msg, got.value.pos) == (want.value.msg, want.value.pos)


def test_a_broken_value_is_left_for_its_reader():
    out = loads_deferring('{"a": [{"seg": [[1,, 2]]}]}', "seg", "a")
    assert isinstance(out["a"][0]["seg"], Deferred)
    with pytest.raises(json.JSONDecodeError):
        json.loads(out["a"][0]["seg"])


def test_overlapping_values_cost_linear_work(monkeypatch):
    """A hostile text of many keys whose lists all end at one far "]]": each value would be
    searched and scanned to that end (quadratic: 20,000 keys took seconds). The end is found
    once, and values scanned over again and again end the cutting: the text is parsed whole,
    the last (cuttable) value too."""
    import packer.sources.lazyjson as lazyjson
    searches = []

    class Counting:
        def search(self, text, start):
            searches.append(start)
            return lazyjson.LIST_END_RE.search(text, start)

    monkeypatch.setattr(lazyjson, "LIST_END_RE", lazyjson.LIST_END, raising=False)
    monkeypatch.setattr(lazyjson, "LIST_END", Counting())
    n = 2000
    text = '{"a": [' + ",".join('{"seg": [1, "x"]}' for _ in range(n)) + ', {"seg": [[1]]}]}'
    out = loads_deferring(text, "seg", "a")
    assert out == json.loads(text) and deferred_count(out) == 0
    assert len(searches) == 1


def test_empty_lists_are_left_alone_and_cost_nothing():
    """``"seg": []`` (box-only exports) is not cut, and thousands of them before the polygons
    do not make every later value be scanned again (which ended the cutting)."""
    doc = {"a": [{"seg": []} for _ in range(5000)] + [{"seg": [[1, 2, 3]]} for _ in range(10)]}
    out = loads_deferring(json.dumps(doc), "seg", "a")
    assert parsed(out) == doc
    assert deferred_count(out) == 10
