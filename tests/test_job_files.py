"""A local data file travels with the job when it is small, and is refused before submitting when it
is too big."""

from __future__ import annotations

from pathlib import Path

from workloads.client import submit


def test_a_small_local_data_file_travels_with_the_job(tmp_path):
    from workloads.client.job_files import UPLOAD_DIR, stage_data_file
    from workloads.model_io import sources

    data = tmp_path / "mine.jsonl"
    data.write_text('{"text": "hello"}\n')
    train = {"data": {"kind": "jsonl", "path": str(data)}, "steps": 3}
    job = tmp_path / "job"
    job.mkdir()
    staged = stage_data_file(train, job)
    assert staged["data"]["path"] == f"{UPLOAD_DIR}/mine.jsonl" and train["data"]["path"] == str(data)
    assert (job / UPLOAD_DIR / "mine.jsonl").read_text() == data.read_text()
    # On a node, the relative path is found among the job's files (the folder holding `workloads`).
    assert sources.JOB_ROOT == Path(sources.__file__).resolve().parents[2]
    for kept in ({"data": {"kind": "jsonl", "path": "s3://b/k.jsonl"}},
                 {"data": {"kind": "jsonl", "path": "/on/the/nodes.jsonl"}}, {"data": {"kind": "synthetic"}}):
        assert stage_data_file(kept, job) == kept


def test_a_too_big_data_file_is_refused_before_submitting(tmp_path, capsys):
    from workloads.client import job_files

    data = tmp_path / "big.jsonl"
    with data.open("wb") as f:
        f.truncate((job_files.MAX_UPLOAD_MIB + 1) * 2**20)
    argv = ["--address", "http://127.0.0.1:9", "--preset", "demo-cpu", "--set", "data.kind=jsonl",
            "--set", f"data.path={data}", "--set", "data.tokenizer=t"]
    assert submit.main("submit", argv) == 2
    err = capsys.readouterr().err
    assert f"is 101 MiB, more than the {job_files.MAX_UPLOAD_MIB} MiB a job takes along" in err
    assert "aws s3 cp" in err and "data.path=s3://BUCKET/data/big.jsonl" in err
