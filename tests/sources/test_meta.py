"""Metadata tables (.jsonl, .csv): inferred and checked column types, --label, and every bad
row's error."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import packer
from packer.errors import PackerError
from packer.sources.table import fit_identity, read_meta

REPO = str(Path(packer.__file__).resolve().parent.parent)

ROWS = [
    {"path": "a.jpg", "tags": [1, 4, 7], "emb": [0.5, -1, 2.25], "score": 3, "flag": True,
     "caption": "a cat, on a mat", "n": 1, "species": "cat"},
    {"path": "sub/b.jpg", "tags": [], "emb": [1, 2, 3], "score": 0.5, "flag": False,
     "caption": "", "n": -2, "species": "dog"},
    {"path": "./c.jpg", "tags": [2], "emb": [0.0, 0.0, 1e-3], "score": 1, "flag": True,
     "caption": "ünïcode \"quoted\"", "n": 3, "species": "cat"},
]
SCHEMA = [
    {"name": "tags", "type": "array", "dtype": "int64", "shape": [-1]},
    {"name": "emb", "type": "array", "dtype": "float32", "shape": [3]},
    {"name": "score", "type": "float"},
    {"name": "flag", "type": "bool"},
    {"name": "caption", "type": "str"},
    {"name": "n", "type": "int"},
]


def jsonl(tmp_path, rows, name="meta.jsonl"):
    (tmp_path / "img").mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return tmp_path / "img", path


def csv_file(tmp_path, text, name="meta.csv"):
    (tmp_path / "img").mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return tmp_path / "img", path


CSV = ('path,tags,emb,score,flag,caption,n,species\r\n'
       'a.jpg,"[1, 4, 7]","[0.5, -1, 2.25]",3,True,"a cat, on a mat",1,cat\r\n'
       'sub/b.jpg,[],"[1, 2, 3]",0.5,false,,-2,dog\r\n'
       './c.jpg,[2],"[0.0, 0.0, 1e-3]",1,TRUE,"ünïcode ""quoted""",+3,cat\r\n')


def check_common(src, with_species=True):
    assert [p for p, _ in src.entries] == ["a.jpg", "sub/b.jpg", "c.jpg"]
    ann = src.annotations
    assert ann.task == "generic" and ann.fit is fit_identity
    assert ann.schema == SCHEMA + ([{"name": "species", "type": "str"}] if with_species else [])
    row = ann.rows[0]
    assert row["tags"] == [1, 4, 7] and row["emb"] == [0.5, -1.0, 2.25]
    assert type(row["emb"][1]) is float and type(ann.rows[1]["emb"][0]) is float
    assert [r["score"] for r in ann.rows] == [3.0, 0.5, 1.0]
    assert type(ann.rows[0]["score"]) is float
    assert [r["flag"] for r in ann.rows] == [True, False, True]
    assert [r["caption"] for r in ann.rows] == ["a cat, on a mat", "", 'ünïcode "quoted"']
    assert [r["n"] for r in ann.rows] == [1, -2, 3]
    assert ann.fit(row, 10, 10) == (row, [])
    assert pickle.loads(pickle.dumps(ann.fit)) is fit_identity


def test_jsonl_types_and_rows(tmp_path):
    src = read_meta(*jsonl(tmp_path, ROWS))
    check_common(src)
    assert src.classes == [] and [lab for _, lab in src.entries] == [-1, -1, -1]
    assert list(src.annotations.rows[0]) == [f["name"] for f in src.annotations.schema]


def test_csv_types_and_rows(tmp_path):
    check_common(read_meta(*csv_file(tmp_path, CSV)))


@pytest.mark.parametrize("make", ["jsonl", "csv"])
def test_label_column_of_names(tmp_path, make):
    args = jsonl(tmp_path, ROWS) if make == "jsonl" else csv_file(tmp_path, CSV)
    src = read_meta(*args, label="species")
    assert src.classes == ["cat", "dog"]
    assert [lab for _, lab in src.entries] == [0, 1, 0]
    check_common(src, with_species=False)
    assert "species" not in src.annotations.rows[0]


def test_label_column_of_indices_may_be_named_label(tmp_path):
    rows = [{"path": "a.jpg", "label": 3}, {"path": "b.jpg", "label": 0}]
    src = read_meta(*jsonl(tmp_path, rows), label="label")
    assert src.classes == ["0", "1", "2", "3"]
    assert src.entries == [("a.jpg", 3), ("b.jpg", 0)]
    assert src.annotations.schema == [] and src.annotations.rows == [{}, {}]


@pytest.mark.parametrize("rows, label, message", [
    ([{"path": "a.jpg", "c": 1}, {"path": "b.jpg", "c": -1}], "c",
     r"meta\.jsonl:2: the label column 'c' holds -1; class indices must be >= 0"),
    ([{"path": "a.jpg", "c": 1.5}], "c", "holds float values; a class label must be"),
    ([{"path": "a.jpg", "c": "x"}, {"path": "b.jpg", "c": ""}], "c",
     r"meta\.jsonl:2: the label column 'c' is empty"),
    ([{"path": "a.jpg", "c": 1}], "d", r"Table\(images, table, label='d'\): .* has no such column"),
])
def test_bad_label_column(tmp_path, rows, label, message):
    with pytest.raises(PackerError, match=message):
        read_meta(*jsonl(tmp_path, rows), label=label)


def test_fixed_length_int_lists_get_a_fixed_shape(tmp_path):
    rows = [{"path": "a.jpg", "box": [1, 2, 3, 4]}, {"path": "b.jpg", "box": [5, 6, 7, 8]}]
    assert read_meta(*jsonl(tmp_path, rows)).annotations.schema == [
        {"name": "box", "type": "array", "dtype": "int64", "shape": [4]}]


@pytest.mark.parametrize("rows, message", [
    ([{"path": "/etc/passwd.jpg"}], r"meta\.jsonl:1: path '/etc/passwd\.jpg' is absolute"),
    ([{"path": "a.jpg"}, {"path": "x/../../b.jpg"}], r"meta\.jsonl:2: path .* contains '\.\.'"),
    ([{"path": ""}], r"meta\.jsonl:1: path '' is empty"),
    ([{"path": 3}], r"meta\.jsonl:1: path '3' must be a string"),
    ([{"path": "a.jpg"}, {"path": "./a.jpg"}],
     r"meta\.jsonl:2: path 'a\.jpg' is listed twice \(also line 1\)"),
    ([{"path": "a.jpg"}, {"file": "b.jpg"}], r"meta\.jsonl:2: no 'path'"),
    ([{"path": "a.jpg", "x": 1}, {"path": "b.jpg", "x": None}],
     r"meta\.jsonl:2: column 'x' is null"),
    ([{"path": "a.jpg", "x": 1}, {"path": "b.jpg"}],
     r"meta\.jsonl:2: no value for column 'x'"),
    ([{"path": "a.jpg", "x": 1}, {"path": "b.jpg", "x": 2.5}, {"path": "c.jpg", "x": "s"}],
     r"column 'x' mixes types: int \(first at line 1\) and str \(first at line 3\)"),
    ([{"path": "a.jpg", "x": True}, {"path": "b.jpg", "x": 1}],
     r"column 'x' mixes types: bool \(first at line 1\) and int \(first at line 2\)"),
    ([{"path": "a.jpg", "x": [1]}, {"path": "b.jpg", "x": 1}], "mixes types: list of int"),
    (['{"path": "a.jpg", "x": NaN}'], r"meta\.jsonl:1: column 'x' holds nan"),
    (['{"path": "a.jpg", "x": [1, Infinity]}'], r"meta\.jsonl:1: column 'x' holds inf"),
    ([{"path": "a.jpg", "x": 2 ** 64}], "beyond 64-bit integers"),
    ([{"path": "a.jpg", "x": ["a", "b"]}], r"column 'x' is list of something else, which is "
                                          r"not a supported type"),
    ([{"path": "a.jpg", "x": [[1, 2]]}], "list of something else"),
    ([{"path": "a.jpg", "x": {"k": 1}}], "column 'x' is an object, which is not"),
    ([{"path": "a.jpg", "2x": 1}], r"meta\.jsonl:1: column name '2x' must be a letter"),
    ([{"path": "a.jpg", "y": 1}, {"path": "b.jpg", "a-b": 1}],
     r"meta\.jsonl:2: column name 'a-b'"),
    ([{"path": "a.jpg", "x" * 65: 1}], "column name 'x{65}' must be"),
    ([{"path": "a.jpg", "width": 1}], "column 'width' clashes with a name every record uses"),
    ([{"path": "a.jpg", "label": 1}], r"column 'label' clashes .* or make it the label \(label='label'\)"),
    (['{"path": "a.jpg", "x": 1', ], r"meta\.jsonl:1: not valid JSON \(.* at column \d+\)"),
    (['["a.jpg"]'], r"meta\.jsonl:1: expected a JSON object"),
    (['{"path": "a.jpg", "path": "b.jpg"}'], r"meta\.jsonl:1: key 'path' appears twice"),
    ([{"path": "a.jpg", "e": [1, 2]}, {"path": "b.jpg", "e": [0.5, -1e39]}],
     r"meta\.jsonl:2: column 'e' holds -1e\+39, beyond 32-bit floats"),
    pytest.param(['{"path": "a.jpg", "x": ' + "[" * 5000 + "]" * 5000 + "}"],  # no traceback
                 r"meta\.jsonl:1: JSON nested too deeply", id="deep"),
    pytest.param(['{"path": "a.jpg", "x": ' + "7" * 5000 + "}"],
                 r"meta\.jsonl:1: a number with over 4300 digits", id="long-number"),
    ([], "lists no images"),
])
def test_bad_jsonl(tmp_path, rows, message):
    with pytest.raises(PackerError, match=message):
        read_meta(*jsonl(tmp_path, rows))


@pytest.mark.parametrize("text, message", [
    ("path,x\na.jpg,1\nb.jpg,\n", r"meta\.csv:3: column 'x' is null"),
    ("path,x\na.jpg,1.5\nb.jpg,nan\n", r"meta\.csv:3: column 'x' holds nan"),
    ("path,x\na.jpg,1\nb.jpg,-inf\n", r"meta\.csv:3: column 'x' holds -inf"),
    ("path,x\na.jpg,1\nb.jpg,2,3\n", r"meta\.csv:3: 3 cells, but the header names 2 columns"),
    ("file,x\na.jpg,1\n", r"meta\.csv:1: the header has no 'path' column"),
    ("path,x,x\na.jpg,1,2\n", r"meta\.csv:1: column 'x' appears twice"),
    ("path,x\na.jpg,[1\nb.jpg,[2]\n", r"meta\.csv:2: column 'x': '\[1' is not a JSON list"),
    ("path,x\na.jpg,\"[1, NaN]\"\n", r"meta\.csv:2: column 'x' holds nan"),
    ("path,x\n../a.jpg,1\n", r"meta\.csv:2: path '\.\./a\.jpg' contains '\.\.'"),
    ("path,height\na.jpg,1\n", "column 'height' clashes"),
    ("path,x\n", "lists no images"),
    pytest.param("path,x\na.jpg," + "7" * 5000 + "\n", r"meta\.csv:2: column 'x' holds inf",
                 id="long-number"),
    pytest.param("path,x\na.jpg,[" + "7" * 5000 + "]\n",
                 r"meta\.csv:2: .* \(a number with over 4300 digits", id="long-number-in-list"),
    pytest.param("path,x\na.jpg," + "[" * 5000 + "]" * 5000 + "\n",
                 r"meta\.csv:2: .* \(JSON nested too deeply", id="deep"),
    ("", "lists no images"),
])
def test_bad_csv(tmp_path, text, message):
    with pytest.raises(PackerError, match=message):
        read_meta(*csv_file(tmp_path, text))


def test_csv_inference_rules(tmp_path):
    text = ("path,i,f,b,s,mixed,words,date\n"
            "a.jpg,1,1,true,x,1,[not a list,2024-01-01\n"
            "b.jpg,2,2.5e3,False,,true,plain,2024-01-02\n")
    src = read_meta(*csv_file(tmp_path, text))
    assert [f["type"] for f in src.annotations.schema] == ["int", "float", "bool", "str",
                                                           "str", "str", "str"]
    assert src.annotations.rows[1] == {"i": 2, "f": 2500.0, "b": False, "s": "", "mixed": "true",
                                       "words": "plain", "date": "2024-01-02"}


def test_unsupported_file_and_encoding(tmp_path):
    img, path = jsonl(tmp_path, [{"path": "a.jpg"}], name="meta.json")
    with pytest.raises(PackerError, match=r"must end in \.jsonl .* or \.csv"):
        read_meta(img, path)
    path = tmp_path / "latin.csv"
    path.write_bytes(b"path,x\ncaf\xe9.jpg,1\n")
    with pytest.raises(PackerError, match="is not UTF-8 text"):
        read_meta(img, path)
    with pytest.raises(PackerError, match=r"Table\(images, table, label\): images .* does not"):
        read_meta(tmp_path / "nope", path)
    with pytest.raises(PackerError, match="does not exist"):
        read_meta(img, tmp_path / "nope.csv")


def test_only_listed_rows_in_file_order(tmp_path):
    img, path = jsonl(tmp_path, [{"path": "z.jpg"}, {"path": "a.jpg"}])
    (img / "unlisted.jpg").write_bytes(b"x")
    src = read_meta(img, path)
    assert src.entries == [("z.jpg", -1), ("a.jpg", -1)]


def test_an_object_of_many_keys_is_checked_for_repeats_in_linear_time(tmp_path):
    # 100,000 keys took minutes when each key was counted among all the others
    row = {"path": "a.jpg", "x": {str(i): i for i in range(100_000)}}
    images, meta = jsonl(tmp_path, [row])
    code = ("import sys\nfrom packer.errors import PackerError\n"
            "from packer.sources.table import read_meta\n"
            "try:\n read_meta(sys.argv[1], sys.argv[2])\nexcept PackerError as e:\n print(e)")
    out = subprocess.run([sys.executable, "-c", code, str(images), str(meta)], timeout=60,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    assert "column 'x' is an object, which is not a supported type" in out.stdout, out


def test_float_lists_up_to_what_float32_rounds_to_its_maximum_are_kept(tmp_path):
    # 3.4028235e+38 (numpy's print of float32's maximum) rounds to it: not beyond
    src = read_meta(*jsonl(tmp_path, [{"path": "a.jpg", "e": [1.0, 3.4028235e+38]}]))
    assert src.annotations.rows[0]["e"] == [1.0, 3.4028235e+38]
