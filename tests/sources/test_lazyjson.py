"""loads_deferring: the same data as json.loads, with one key's polygon lists left as text."""
from __future__ import annotations

import json

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


SEG = [[1.5, 2, 3e2, -4, 5, 6]]


@pytest.mark.parametrize("doc, deferred", [
    ({"a": [{"seg": SEG}, {"seg": SEG + [[7, 8]]}]}, 2),
    ({"a": [{"seg": {"counts": "x]]", "size": [1, 2]}}]}, 0),  # an RLE: parsed here
    ({"a": [{"seg": [["x]]"]]}]}, 0),  # a string inside: parsed here
    ({"a": [{"seg": [[[1]], [2]]}]}, 0),  # deeper: the first ]] is not the end
    ({"a": [{"seg": [1, [2, 3]]}]}, 1),  # any list: the reader of the text checks it
    ({"a": [{"x\"seg": [[1, 2]]}]}, 0),  # the key inside another key's text
    ({"a": [{"seg": [[1]], "other": "\u0000"}]}, 0),  # a NUL anywhere: parsed whole
    ({"seg": [[1]], "b": {"seg": [[2]]}}, 2),
    ({"seg": []}, 0),
])
@pytest.mark.parametrize("indent", [None, 1])
def test_same_data_as_json_loads(doc, deferred, indent):
    text = json.dumps(doc, indent=indent)
    out = loads_deferring(text, "seg")
    assert parsed(out) == json.loads(text)
    assert deferred_count(out) == deferred


def test_duplicate_keys_parse_as_json_loads_does():
    text = '{"a": {"seg": [[1]], "seg": [[2]]}}'
    assert parsed(loads_deferring(text, "seg")) == json.loads(text) == {"a": {"seg": [[2]]}}


@pytest.mark.parametrize("text", [
    '{"seg": [[1, 2]]]}',  # a stray ] after the cut value
    '{"seg": [[1, 2]], "x": }',
    '{"seg": [[1, 2]]',  # cut short
])
def test_errors_name_the_texts_own_position(text):
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as got:
        loads_deferring(text, "seg")
    assert (got.value.msg, got.value.pos) == (want.value.msg, want.value.pos)


def test_a_broken_value_is_left_for_its_reader():
    out = loads_deferring('{"seg": [[1,, 2]]}', "seg")
    assert isinstance(out["seg"], Deferred)
    with pytest.raises(json.JSONDecodeError):
        json.loads(out["seg"])


def test_overlapping_values_cost_linear_work(monkeypatch):
    """A hostile text of many keys whose lists all end at one far "]]": each value would be
    searched and scanned to that end (quadratic: 20,000 keys took seconds). The end is found
    once, and values scanned over again and again end the cutting."""
    import packer.sources.lazyjson as lazyjson
    searches = []

    class Counting:
        def search(self, text, start):
            searches.append(start)
            return lazyjson.LIST_END_RE.search(text, start)

    monkeypatch.setattr(lazyjson, "LIST_END_RE", lazyjson.LIST_END, raising=False)
    monkeypatch.setattr(lazyjson, "LIST_END", Counting())
    n = 2000
    text = '{"a": [' + ",".join('{"seg": [1, "x"]}' for _ in range(n)) + '], "z": [[1]]}'
    assert loads_deferring(text, "seg") == json.loads(text)
    assert len(searches) == 1


def test_empty_lists_are_left_alone_and_cost_nothing():
    """``"seg": []`` (box-only exports) is not cut, and thousands of them before the polygons
    do not make every later value be scanned again (which ended the cutting)."""
    doc = {"a": [{"seg": []} for _ in range(5000)] + [{"seg": [[1, 2, 3]]} for _ in range(10)]}
    out = loads_deferring(json.dumps(doc), "seg")
    assert parsed(out) == doc
    assert deferred_count(out) == 10
