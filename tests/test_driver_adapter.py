"""The Ray Train adapter's checkpoint loader with real ray.train.Checkpoint objects: used in place on a
local filesystem, downloaded once from a remote one (an in-memory fsspec filesystem stands in for S3),
and once per node however many ranks restore at the same time."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import fsspec
import pyarrow.fs
import pytest
import ray.train

from workloads.context import RESTORE_PREFIX
from workloads.launch import ray_train


def test_no_checkpoint_means_a_fresh_start(monkeypatch, tmp_path):
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    assert ray_train.checkpoint_loader(restore_root=tmp_path)() is None


def test_a_local_checkpoint_is_used_in_place(monkeypatch, tmp_path):
    folder = tmp_path / "checkpoint_000002"
    folder.mkdir()
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: ray.train.Checkpoint.from_directory(str(folder)))
    assert ray_train.checkpoint_loader(restore_root=tmp_path / "restored")() == folder
    assert not (tmp_path / "restored").exists()


def test_a_remote_checkpoint_is_downloaded_once_and_its_cost_is_reported(monkeypatch, tmp_path, capsys):
    memory = fsspec.filesystem("memory")
    memory.pipe("/bucket/run/checkpoint_000004/.metadata", b"dcp metadata")
    memory.pipe("/bucket/run/checkpoint_000004/__0_0.distcp", b"shard 0")
    remote = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(memory))
    checkpoint = ray.train.Checkpoint("/bucket/run/checkpoint_000004", filesystem=remote)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: checkpoint)

    latest = ray_train.checkpoint_loader(restore_root=tmp_path, rank=3)
    folder = latest()
    assert folder == tmp_path / "checkpoint_000004"
    assert (folder / "__0_0.distcp").read_bytes() == b"shard 0" and (folder / ".metadata").is_file()
    memory.rm("/bucket/run", recursive=True)  # a second call must not fetch again
    assert latest() == folder
    (line,) = capsys.readouterr().out.splitlines()  # one download, one line
    restore = json.loads(line.removeprefix(RESTORE_PREFIX))
    assert (restore["checkpoint"], restore["rank"], restore["files"]) == ("checkpoint_000004", 3, 2)
    assert restore["bytes"] == len(b"dcp metadata") + len(b"shard 0") and restore["seconds"] >= 0


def test_a_remote_checkpoint_whose_key_climbs_out_is_refused_before_anything_is_written(monkeypatch, tmp_path):
    """Ray's own download writes each key below the folder as it is: `sub/../../../escaped` lands
    beside the restore folder. The keys are checked first (workloads/files.py)."""
    memory = fsspec.filesystem("memory")
    memory.pipe("/bucket/climb/checkpoint_000004/.metadata", b"dcp metadata")
    memory.pipe("/bucket/climb/checkpoint_000004/sub/../../../escaped", b"written outside")
    remote = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(memory))
    checkpoint = ray.train.Checkpoint("/bucket/climb/checkpoint_000004", filesystem=remote)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: checkpoint)
    with pytest.raises(ValueError, match=r"refused the key 'sub/\.\./\.\./\.\./escaped'"):
        ray_train.checkpoint_loader(restore_root=tmp_path / "restored")()
    assert not (tmp_path / "escaped").exists()
    assert not (tmp_path / "restored").exists() or not any((tmp_path / "restored").rglob("*.metadata"))


class _CountingCheckpoint:
    """A persisted checkpoint whose download is slow and counted in a file the processes share."""

    def __init__(self, path: str, counter: str) -> None:
        self.path, self.counter = path, counter

    def to_directory(self, target: str) -> None:
        with open(self.counter, "a") as f:
            f.write("download\n")
        time.sleep(0.5)  # long enough for the other ranks to arrive while it runs
        os.makedirs(target)
        with open(os.path.join(target, "__0_0.distcp"), "wb") as f:
            f.write(b"shard 0")


def _restore_as_a_rank(checkpoint, restore_root, results) -> None:
    results.put(str(ray_train.restore_once_per_node(checkpoint, restore_root=restore_root)))


def test_the_ranks_of_a_node_download_a_checkpoint_once(tmp_path):
    """Four ranks of one node restore at once: one download, one folder, all of them use it (a 1.5B
    model's checkpoint is ~18.5 GB; one copy per rank would fill the node's root volume)."""
    counter = tmp_path / "downloads"
    counter.write_text("")
    root = tmp_path / "restored"
    (root / "checkpoint_000002").mkdir(parents=True)  # a copy from an earlier attempt
    checkpoint = _CountingCheckpoint("/bucket/run/checkpoint_000004", str(counter))
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_restore_as_a_rank, args=(checkpoint, root, results)) for _ in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=60)
        assert rank.exitcode == 0
    folders = {results.get(timeout=5) for _ in ranks}
    assert folders == {str(root / "checkpoint_000004")}
    assert counter.read_text().splitlines() == ["download"]
    assert (root / "checkpoint_000004" / "__0_0.distcp").read_bytes() == b"shard 0"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["checkpoint_000004"]
