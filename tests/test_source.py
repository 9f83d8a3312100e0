"""Finding images and labels: ImageFolder's rule, ``--list`` files, ``--part`` selection."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from helpers import TV_IMG_EXTENSIONS, imagefolder_rule
from packer.errors import PackerError
from packer.sources.base import IMG_EXTENSIONS, EmptyClassWarning, ImageList, parse_part, select
from packer.sources.folder import ImageFolder, find_classes, read_list, scan_folder


def scan_quietly(root):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmptyClassWarning)
        return scan_folder(root, allow_empty=True)


def touch(root: Path, *rels: str) -> None:
    for rel in rels:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")


def test_extensions_are_torchvisions():
    assert sorted(IMG_EXTENSIONS) == sorted(TV_IMG_EXTENSIONS)


def test_class_order_is_torchvisions_not_case_insensitive(tmp_path):
    names = ["a", "B", "é", "Z9", "_x", "Z10", "b c"]
    touch(tmp_path, *(f"{n}/img.jpg" for n in names))
    classes = find_classes(tmp_path)
    assert classes == imagefolder_rule(tmp_path)[0]
    # code-point order: upper case < '_' < lower case < non-ASCII; 'Z10' before 'Z9'
    assert classes == ["B", "Z10", "Z9", "_x", "a", "b c", "é"]
    assert classes != sorted(names, key=str.lower)


def test_odd_tree_matches_imagefolder_exactly(odd_tree):
    src = scan_quietly(odd_tree.root)
    classes, class_to_idx, samples = imagefolder_rule(odd_tree.root)
    assert src.classes == classes
    assert src.class_to_idx == class_to_idx
    assert src.entries == samples
    assert {p for p, _ in src.entries} == set(odd_tree.good) | set(odd_tree.bad)


def test_walk_order_sorts_whole_paths(tmp_path):
    # torchvision sorts os.walk's (dirpath, ...) tuples: a folder's files come before its
    # subfolders', and 'sub/deeper' sorts after 'sub-dir' ('/' > '-' > ' '); not depth-first.
    touch(tmp_path, "c/z.jpg", "c/sub/b.jpg", "c/sub/A.jpg", "c/sub/deeper/a.jpg",
          "c/sub dir/a.jpg", "c/sub-dir/a.jpg", "c/Sub/a.jpg")
    src = scan_folder(tmp_path)
    assert [p for p, _ in src.entries] == [
        "c/z.jpg", "c/Sub/a.jpg", "c/sub/A.jpg", "c/sub/b.jpg", "c/sub dir/a.jpg",
        "c/sub-dir/a.jpg", "c/sub/deeper/a.jpg"]
    assert src.entries == imagefolder_rule(tmp_path)[2]


def test_extensions_case_insensitive_and_other_files_ignored(tmp_path):
    touch(tmp_path, "c/a.JPG", "c/b.Jpeg", "c/c.PNG", "c/d.TiF", "c/e.webp", "c/f.Bmp",
          "c/g.ppm", "c/h.PGM", "c/i.tiff",
          "c/notes.txt", "c/anim.gif", "c/raw.cr2", "c/j.jpg.bak", "c/jpg", "c/.jpg.swp")
    rels = [p for p, _ in scan_folder(tmp_path).entries]
    assert rels == ["c/a.JPG", "c/b.Jpeg", "c/c.PNG", "c/d.TiF", "c/e.webp", "c/f.Bmp",
                    "c/g.ppm", "c/h.PGM", "c/i.tiff"]


def test_one_extension_as_a_string_is_one_extension_as_in_torchvision(tmp_path):
    touch(tmp_path, "c/a.png", "c/b.jpg", "c/d.jpeg", "c/e.svg")
    assert [p for p, _ in scan_folder(tmp_path, extensions=".png").entries] == ["c/a.png"]
    src = ImageFolder(tmp_path, extensions=".png")
    assert [p for p, _ in src.read().entries] == ["c/a.png"]
    assert src.options()["extensions"] == ".png"


def test_symlinked_class_and_subfolders_are_followed(tmp_path):
    outside = tmp_path / "outside"
    touch(outside, "cls/x.jpg", "sub/y.png")
    root = tmp_path / "root"
    touch(root, "real/a.jpg")
    (root / "linked").symlink_to(outside / "cls", target_is_directory=True)
    (root / "real/linksub").symlink_to(outside / "sub", target_is_directory=True)
    (root / "dangling_dir").symlink_to(tmp_path / "nowhere", target_is_directory=True)
    src = scan_folder(root)
    assert src.classes == ["linked", "real"]  # a broken link is not a folder (as in torchvision)
    assert src.entries == [("linked/x.jpg", 0), ("real/a.jpg", 1), ("real/linksub/y.png", 1)]
    assert src.entries == imagefolder_rule(root)[2]


def test_empty_class_is_an_error_as_in_torchvision(tmp_path):
    touch(tmp_path, "a/1.jpg", "c/3.jpg", "only_txt/readme.txt")
    (tmp_path / "b").mkdir()
    with pytest.raises(PackerError, match=r"no images in the class folder\(s\) b, only_txt .*"
                                          r"ImageFolder\(root, allow_empty=True\)"):
        scan_folder(tmp_path)


def test_extensions_or_is_valid_file_pick_files_as_in_torchvision(tmp_path):
    touch(tmp_path, "a/1.jpg", "a/2.PNG", "a/3.txt", "b/4.jpeg")
    picked = scan_folder(tmp_path, extensions=(".png", ".txt"), allow_empty=True)
    assert [p for p, _ in picked.entries] == ["a/2.PNG", "a/3.txt"]
    seen = []
    picked = scan_folder(tmp_path, is_valid_file=lambda p: seen.append(p) or p.endswith("4.jpeg"),
                         allow_empty=True)
    assert [p for p, _ in picked.entries] == ["b/4.jpeg"]
    assert str(tmp_path / "a" / "1.jpg") in seen  # called with the full path, as torchvision does
    with pytest.raises(PackerError, match="not both"):
        scan_folder(tmp_path, extensions=(".jpg",), is_valid_file=bool)


def test_empty_class_is_kept_with_a_warning_when_allowed(tmp_path):
    touch(tmp_path, "a/1.jpg", "c/3.jpg", "only_txt/readme.txt")
    (tmp_path / "b").mkdir()
    with pytest.warns(EmptyClassWarning) as rec:
        src = scan_folder(tmp_path, allow_empty=True)
    assert src.classes == ["a", "b", "c", "only_txt"]
    assert src.entries == [("a/1.jpg", 0), ("c/3.jpg", 2)]
    msgs = sorted(str(w.message) for w in rec)
    assert len(msgs) == 2
    assert "'b' has no images" in msgs[0] and "label 1" in msgs[0]
    assert "'only_txt' has no images" in msgs[1]


def test_files_in_root_are_not_classes(tmp_path):
    touch(tmp_path, "stray.jpg", "a/1.jpg")
    assert scan_folder(tmp_path).classes == ["a"]


def test_missing_or_flat_source_is_a_clear_error(tmp_path):
    with pytest.raises(PackerError, match="does not exist or is not a folder"):
        scan_folder(tmp_path / "nope")
    touch(tmp_path, "flat.jpg")
    with pytest.raises(PackerError, match=r"no class folders .*FileList"):
        scan_folder(tmp_path)


# -- --list ------------------------------------------------------------------------------------

def write_list(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_list_with_integer_labels(tmp_path):
    lst = write_list(tmp_path / "l.txt", "# comment\nx/a.jpg\t2\n\ny b/c d.png\t0\r\nz.jpg\t 2 \n")
    src = read_list(tmp_path, lst)
    assert src.classes == ["0", "1", "2"]
    assert src.entries == [("x/a.jpg", 2), ("y b/c d.png", 0), ("z.jpg", 2)]


def test_list_with_class_names(tmp_path):
    lst = write_list(tmp_path / "l.txt", "a.jpg\tdog\nb.jpg\tCat\nc.jpg\tdog\nd.jpg\tcat\n")
    src = read_list(tmp_path, lst)
    assert src.classes == ["Cat", "cat", "dog"]  # code-point order, like folder classes
    assert src.entries == [("a.jpg", 2), ("b.jpg", 0), ("c.jpg", 2), ("d.jpg", 1)]


def test_list_path_may_contain_tabs_label_is_after_the_last(tmp_path):
    lst = write_list(tmp_path / "l.txt", "odd\tname.jpg\t1\n")
    assert read_list(tmp_path, lst).entries == [("odd\tname.jpg", 1)]


@pytest.mark.parametrize("text, match", [
    ("a.jpg 1\n", r"l\.txt:1: expected 'relative/path<TAB>label'"),
    ("a.jpg\t1\nb.jpg\t\n", r"l\.txt:2: expected"),
    ("\t3\n", r"l\.txt:1: expected"),
    ("/etc/passwd\t1\n", r"l\.txt:1: path /etc/passwd is absolute"),
    ("a/../../x.jpg\t1\n", r"l\.txt:1: path a/\.\./\.\./x\.jpg contains '\.\.'; it must stay inside"),
    ("a\0b.jpg\t1\n", r"l\.txt:1: path a\\x00b\.jpg contains a NUL character"),
    ("a.jpg\t-1\n", r"labels must be >= 0"),
    ("# only a comment\n\n", r"lists no images"),
])
def test_list_bad_lines(tmp_path, text, match):
    with pytest.raises(PackerError, match=match):
        read_list(tmp_path, write_list(tmp_path / "l.txt", text))


# -- --part and --shuffle ----------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [(None, None), ("0/1", (0, 1)), ("3/4", (3, 4))])
def test_parse_part(text, want):
    assert parse_part(text) == want


@pytest.mark.parametrize("text, match", [
    ("1", "must look like K/N"), ("a/b", "must look like K/N"), ("1/2/3", "must look like K/N"),
    ("4/4", "numbered from 0"), ("-1/4", "numbered from 0"), ("0/0", "numbered from 0")])
def test_parse_part_errors(text, match):
    with pytest.raises(PackerError, match=match):
        parse_part(text)


def make_source(n=23, classes=3) -> ImageList:
    return ImageList(Path("/x"), [str(c) for c in range(classes)],
                  [(f"{i % classes}/{i:03d}.jpg", i % classes) for i in range(n)])


@pytest.mark.parametrize("shuffle", [False, True])
def test_parts_are_disjoint_and_cover_everything(shuffle):
    src = make_source()
    parts = [select(src, part=(k, 4), shuffle=shuffle, seed=7).entries for k in range(4)]
    flat = [e for p in parts for e in p]
    assert len(flat) == len(set(flat)) == len(src.entries)
    assert set(flat) == set(src.entries)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_shuffle_is_a_seeded_permutation():
    src = make_source(50)
    a = select(src, shuffle=True, seed=1).entries
    assert a == select(src, shuffle=True, seed=1).entries
    assert a != select(src, shuffle=True, seed=2).entries
    assert a != src.entries and sorted(a) == sorted(src.entries)
    assert select(src).entries == src.entries


def test_list_keeps_unusual_characters_and_newline_styles(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_bytes("a\u2028b.jpg\t0\r\nc\x0cd.jpg\t1\re.jpg\t1\n".encode("utf-8"))
    assert read_list(tmp_path, lst).entries == [("a\u2028b.jpg", 0), ("c\x0cd.jpg", 1), ("e.jpg", 1)]


def test_list_that_is_not_utf8(tmp_path):
    lst = tmp_path / "l.txt"
    lst.write_bytes(b"caf\xe9.jpg\t0\n")
    with pytest.raises(PackerError, match=r"l\.txt is not UTF-8 text \(invalid continuation byte "
                                          r"at byte 3\); save it as UTF-8"):
        read_list(tmp_path, lst)


def test_class_folder_name_that_is_not_utf8(tmp_path):
    import os
    touch(tmp_path, "a/1.jpg")
    os.mkdir(os.path.join(os.fsencode(tmp_path), b"caf\xe9"))
    with pytest.raises(PackerError, match=r"class folder 'caf\\xe9' in .* not valid UTF-8.*rename it"):
        scan_folder(tmp_path)


def test_symlink_loop_is_skipped_with_a_warning_not_walked_forever(tmp_path):
    from packer.sources.base import SymlinkLoopWarning
    from packer.sources.folder import scan_folder
    (tmp_path / "cat" / "sub").mkdir(parents=True)
    (tmp_path / "cat" / "a.jpg").write_bytes(b"x")
    (tmp_path / "cat" / "sub" / "b.jpg").write_bytes(b"x")
    (tmp_path / "cat" / "sub" / "loop").symlink_to(tmp_path / "cat", target_is_directory=True)
    with pytest.warns(SymlinkLoopWarning, match="loop"):
        src = scan_folder(tmp_path)
    assert [p for p, _ in src.entries] == ["cat/a.jpg", "cat/sub/b.jpg"]
