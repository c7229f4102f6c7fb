"""The Ray Train adapter's checkpoint loader with real ray.train.Checkpoint objects: used in place on a
local filesystem, downloaded once from a remote one (an in-memory fsspec filesystem stands in for S3)."""

from __future__ import annotations

import fsspec
import pyarrow.fs
import ray.train

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


def test_a_remote_checkpoint_is_downloaded_once(monkeypatch, tmp_path):
    memory = fsspec.filesystem("memory")
    memory.pipe("/bucket/run/checkpoint_000004/.metadata", b"dcp metadata")
    memory.pipe("/bucket/run/checkpoint_000004/__0_0.distcp", b"shard 0")
    remote = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(memory))
    checkpoint = ray.train.Checkpoint("/bucket/run/checkpoint_000004", filesystem=remote)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: checkpoint)

    latest = ray_train.checkpoint_loader(restore_root=tmp_path)
    folder = latest()
    assert folder == tmp_path / "checkpoint_000004"
    assert (folder / "__0_0.distcp").read_bytes() == b"shard 0" and (folder / ".metadata").is_file()
    memory.rm("/bucket/run", recursive=True)  # a second call must not fetch again
    assert latest() == folder
