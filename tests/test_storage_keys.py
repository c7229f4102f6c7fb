"""A key read from storage or from a run folder becomes a local path only inside the folder it is
written to (workloads/files.py): `..`, absolute keys, empty or `.` parts and NUL are refused with the
key named, and no symbolic link on the way is followed, for reading or for writing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from workloads.files import create_inside, key_parts, path_inside

PARTS = st.sampled_from(["a", "b", "..", ".", "", "link-out", "link-in", "file", "x\x00y", "..a", "a..", " "])
KEYS = st.one_of(st.lists(PARTS, min_size=0, max_size=6).map("/".join),
                 st.text(alphabet="ab./\\\x00-", max_size=24))


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """root/ with a file, a folder, a link to a folder outside and a link to its own folder;
    outside/ beside it holds a file a key must never reach."""
    base = tmp_path_factory.mktemp("keys")
    root, outside = base / "root", base / "outside"
    (root / "a" / "b").mkdir(parents=True)
    (root / "file").write_text("inside")
    outside.mkdir()
    (outside / "secret").write_text("outside")
    (root / "link-out").symlink_to(outside)
    (root / "a" / "link-in").symlink_to(root / "a" / "b")
    return root


def _is_plain(key: str) -> bool:
    return key != "" and all(part not in ("", ".", "..") and "\x00" not in part for part in key.split("/"))


@settings(max_examples=400)
@given(key=KEYS)
@example(key="../outside/secret")
@example(key="link-out/secret")
@example(key="/etc/passwd")
@example(key="a/link-in/x")
@example(key="a//b")
def test_a_key_resolves_inside_its_folder_without_a_link_or_is_refused_by_name(tree, key):
    try:
        path = path_inside(tree, key)
    except ValueError as exc:
        assert repr(key) in str(exc) and "\n" not in str(exc)
        assert not _is_plain(key) or "symbolic link" in str(exc)
        return
    assert _is_plain(key), key
    assert path == tree.joinpath(*key.split("/"))
    assert os.path.realpath(path).startswith(os.path.realpath(tree) + os.sep)
    here = tree
    for part in key.split("/"):
        here = here / part
        assert not here.is_symlink(), key


@settings(max_examples=300)
@given(key=KEYS)
def test_the_lexical_check_takes_exactly_the_plain_relative_keys(key):
    if _is_plain(key):
        assert key_parts(key) == key.split("/")
    else:
        with pytest.raises(ValueError, match="refused the key"):
            key_parts(key)


def test_a_key_that_climbs_out_or_goes_through_a_link_names_the_key_and_why(tree):
    with pytest.raises(ValueError, match=r"refused the key '\.\./outside/secret': '\.\.' climbs out"):
        path_inside(tree, "../outside/secret")
    with pytest.raises(ValueError, match=r"refused the key '/etc/passwd': it is absolute"):
        path_inside(tree, "/etc/passwd")
    with pytest.raises(ValueError, match=r"refused the key 'link-out/secret': .*link-out is a symbolic link"):
        path_inside(tree, "link-out/secret")
    assert path_inside(tree, "a/b/new") == tree / "a" / "b" / "new"  # need not exist


def test_writing_follows_no_link_even_one_made_after_the_check(tree, monkeypatch):
    with create_inside(tree, "a/b/written") as out:
        out.write(b"ok")
    assert (tree / "a" / "b" / "written").read_bytes() == b"ok"
    with pytest.raises(ValueError, match="symbolic link"):
        create_inside(tree, "link-out/secret")
    (tree / "a" / "late").mkdir()
    # A folder swapped for a link between the check and the open: the open itself refuses it.
    monkeypatch.setattr("workloads.files.path_inside", lambda root, key: Path(root, key))
    (tree / "a" / "late").rmdir()
    (tree / "a" / "late").symlink_to(tree.parent / "outside")
    with pytest.raises(ValueError, match=r"refused the key 'a/late/secret': .*symbolic link"):
        create_inside(tree, "a/late/secret")
    (tree / "a" / "final").symlink_to(tree.parent / "outside" / "secret")
    with pytest.raises(ValueError, match=r"refused the key 'a/final': .*symbolic link"):
        create_inside(tree, "a/final")
    assert (tree.parent / "outside" / "secret").read_text() == "outside"
