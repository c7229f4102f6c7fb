"""The model and data cache is the user's own folder: by default under the XDG cache folder, made
0700; a cache folder that another user owns, or that others may write to, is refused with its path
and the fix before anything is read from it or written to it (another account could otherwise plant
the weights or data a run trains on, or read what was fetched with the user's credentials)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from workloads.model_io.cache import CACHE_ENV, cache_root, fill_once


def _fill(folder: Path) -> None:
    (folder / "config.json").write_text("{}")


def test_the_default_cache_is_the_users_own_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "workloads"
    entry = fill_once(cache_root(), "hub--org_model--default", _fill)
    assert entry.filled_here and (entry.path / "config.json").is_file()
    assert stat.S_IMODE((tmp_path / "xdg" / "workloads").stat().st_mode) == 0o700
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "workloads"
    assert cache_root("/data/cache") == Path("/data/cache")  # cache_dir, then $WORKLOADS_CACHE, first


def test_a_cache_folder_others_may_write_is_refused_with_the_fix(tmp_path):
    shared = tmp_path / "workloads-cache"
    shared.mkdir()
    shared.chmod(0o777)
    filled = []
    with pytest.raises(ValueError, match=rf"cache folder {shared} is writable by other users .*chmod go-w {shared}"):
        fill_once(shared, "s3--bucket_model", filled.append)
    assert filled == [] and list(shared.iterdir()) == []


def test_a_cache_folder_another_user_made_first_is_refused(tmp_path):
    if os.geteuid() == 0:
        theirs = tmp_path / "workloads-cache"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 65534, 65534)
    else:
        theirs = Path("/")  # root's
    filled = []
    with pytest.raises(ValueError, match=rf"cache folder {theirs} is owned by another user .*{CACHE_ENV}"):
        fill_once(theirs, "hub--org_model--default", filled.append)
    assert filled == []
