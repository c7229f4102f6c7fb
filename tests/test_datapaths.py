"""Paths in the training config: resolved and checked on this machine before a local run starts or a
job is submitted, uploaded with a submitted job, and found again on the cluster's nodes, whose Ray
Train workers run in a folder of their own."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from workloads.client import datapaths, submit
from workloads.train import paths
from workloads.train.config import preset, with_overrides


def config(*overrides: str) -> dict:
    return with_overrides(preset("demo-cpu"), list(overrides)).to_dict()


@pytest.fixture
def here(tmp_path: Path) -> Path:
    (tmp_path / "corpus.jsonl").write_text('{"text": "a b"}\n')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    return tmp_path


JSONL = ("data.kind=jsonl", "data.path=corpus.jsonl", "data.tokenizer=tok")


def test_only_fields_that_name_files_are_paths(here):
    assert datapaths.config_paths(config(), cwd=here) == []  # synthetic data, a named architecture
    hub = config("data.kind=jsonl", "data.path=corpus.jsonl", "data.tokenizer=Qwen/Qwen2.5-1.5B")
    assert [p.field for p in datapaths.config_paths(hub, cwd=here)] == ["data.path"]
    found = datapaths.config_paths(config(*JSONL, "model.name_or_path=./tok"), cwd=here)
    assert [(p.field, p.local) for p in found] == [
        ("data.path", here / "corpus.jsonl"), ("data.tokenizer", here / "tok"), ("model.name_or_path", here / "tok")]


def test_a_local_run_gets_absolute_paths(here):
    resolved = datapaths.resolved_for_local_run(config(*JSONL), cwd=here)
    assert (resolved["data"]["path"], resolved["data"]["tokenizer"]) == (str(here / "corpus.jsonl"), str(here / "tok"))
    assert resolved["model"]["name_or_path"] == "tiny-qwen2"


@pytest.mark.parametrize(("override", "field"), [
    ("data.path=missing.jsonl", "data.path 'missing.jsonl'"),
    ("data.tokenizer=./missing", "data.tokenizer './missing'"),
])
def test_a_local_run_refuses_a_path_that_names_nothing(here, override, field):
    with pytest.raises(ValueError, match=f"{field} is not a file or folder here .{here}/"):
        datapaths.resolved_for_local_run(config(*JSONL, override), cwd=here)


def test_a_job_uploads_relative_files_once_and_points_at_them(here):
    train, files = datapaths.files_for_job(config(*JSONL, "model.name_or_path=tok"), cwd=here,
                                           upload_absolute=False)
    assert train["data"]["path"] == "job_files/data.path/corpus.jsonl"
    assert train["data"]["tokenizer"] == train["model"]["name_or_path"] == "job_files/data.tokenizer/tok"
    assert files == (("job_files/data.path/corpus.jsonl", here / "corpus.jsonl"),
                     ("job_files/data.tokenizer/tok", here / "tok"))


def test_absolute_paths_are_uploaded_only_to_a_stack(here):
    absolute = config("data.kind=jsonl", f"data.path={here / 'corpus.jsonl'}", "data.tokenizer=/nodes/tok")
    train, files = datapaths.files_for_job(absolute, cwd=here, upload_absolute=False)
    assert train == absolute and files == ()  # --address: the nodes may see the same files
    train, files = datapaths.files_for_job(absolute, cwd=here, upload_absolute=True)
    assert train["data"]["path"] == "job_files/data.path/corpus.jsonl"
    assert train["data"]["tokenizer"] == "/nodes/tok"  # not here: a path on the nodes
    assert files == (("job_files/data.path/corpus.jsonl", here / "corpus.jsonl"),)


def test_a_job_refuses_a_missing_relative_path_and_files_too_large(here, monkeypatch):
    with pytest.raises(ValueError, match="data.path 'nope.jsonl' is not a file or folder here"):
        datapaths.files_for_job(config(*JSONL, "data.path=nope.jsonl"), cwd=here, upload_absolute=True)
    monkeypatch.setattr(datapaths, "MAX_UPLOAD_BYTES", 10)
    with pytest.raises(ValueError, match="hold 0 MiB, more than the 0 MiB uploaded with a job"):
        datapaths.files_for_job(config(*JSONL), cwd=here, upload_absolute=False)


def test_the_working_dir_carries_the_files(here):
    _, files = datapaths.files_for_job(config(*JSONL), cwd=here, upload_absolute=False)
    with submit.staged_package(files) as working_dir:
        assert (working_dir / "job_files/data.path/corpus.jsonl").read_text() == '{"text": "a b"}\n'
        assert (working_dir / "job_files/data.tokenizer/tok/tokenizer.json").is_file()
        assert (working_dir / "workloads" / "__init__.py").is_file()


def test_a_worker_finds_an_uploaded_file_from_its_own_folder(tmp_path, monkeypatch):
    job = tmp_path / "job"
    (job / "job_files").mkdir(parents=True)
    (job / "job_files" / "corpus.jsonl").write_text("{}\n")
    worker_dir = tmp_path / "ray-train-session"
    worker_dir.mkdir()
    monkeypatch.setattr(paths, "JOB_ROOT", job)
    monkeypatch.chdir(worker_dir)
    assert paths.resolve_path("job_files/corpus.jsonl", field="data.path", hub_id_allowed=False) == str(
        job / "job_files" / "corpus.jsonl")
    assert paths.resolve_path("Qwen/Qwen2.5-1.5B", field="data.tokenizer", hub_id_allowed=True) == "Qwen/Qwen2.5-1.5B"
    # Written as a path but missing: a clear error naming the node, not a hub lookup.
    with pytest.raises(ValueError, match=f"data.tokenizer './tok' is not a file or folder on {socket.gethostname()}"):
        paths.resolve_path("./tok", field="data.tokenizer", hub_id_allowed=True)
    with pytest.raises(ValueError, match="data.path 'corpus.jsonl' is not a file or folder"):
        paths.resolve_path("corpus.jsonl", field="data.path", hub_id_allowed=False)
