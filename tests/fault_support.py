"""What the fault-injection tests on a local Ray cluster share: an S3 API (a moto server) that every
Ray process reaches through the standard AWS environment, and readers of the job's log lines and of
the checkpoints in the bucket."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch.distributed.checkpoint as dcp

from workloads.rehearse.services import UNSET_FOR_S3, S3Server, s3_environment
from workloads.client.cluster import free_port
from workloads.client.report import parse_train_line

BUCKET = "checkpoints"


@dataclass(frozen=True, kw_only=True)
class FakeS3:
    endpoint: str
    client: object
    """boto3 S3 client on the moto server."""
    server: S3Server
    """The server itself: stopped and started again, it keeps the bucket (a storage outage)."""


@contextmanager
def fake_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeS3]:
    """A moto S3 server on 127.0.0.1 with one bucket, and the standard AWS environment pointing at it
    (set before the Ray nodes start, so every Ray process inherits it as pods inherit theirs)."""
    server = S3Server(port=free_port())
    server.start()
    for name, value in s3_environment(server.endpoint).items():
        monkeypatch.setenv(name, value)
    for name in UNSET_FOR_S3:
        monkeypatch.delenv(name, raising=False)
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    try:
        yield FakeS3(endpoint=server.endpoint, client=client, server=server)
    finally:
        server.stop()


def bucket_keys(s3: FakeS3, prefix: str) -> list[str]:
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def checkpoint_folders(s3: FakeS3, run_prefix: str) -> dict[str, set[str]]:
    """The run's checkpoint folders in the bucket and the files each holds."""
    folders: dict[str, set[str]] = {}
    for key in bucket_keys(s3, run_prefix.rstrip("/") + "/"):
        parts = key[len(run_prefix.rstrip("/")) + 1:].split("/")
        if len(parts) == 2 and parts[0].startswith("checkpoint_") and parts[1]:
            folders.setdefault(parts[0], set()).add(parts[1])
    return folders


def download(s3: FakeS3, prefix: str, target: Path) -> Path:
    for key in bucket_keys(s3, prefix.rstrip("/") + "/"):
        if key.endswith("/"):  # a folder marker
            continue
        path = target / Path(key).relative_to(prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        s3.client.download_file(BUCKET, key, str(path))
    return target


def progress(folder: Path) -> dict:
    """The step and data position a loop checkpoint (torch.distributed.checkpoint) holds."""
    state = {"progress": {"step": 0, "data_position": 0}}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state["progress"]


def steps_logged(logs: str) -> list[int]:
    return [int(record["step"]) for record in map(parse_train_line, logs.splitlines()) if record]


def job_log_tail(client, job_id: str, lines: int = 60) -> str:
    return "\n".join(client.get_job_logs(job_id).splitlines()[-lines:])


def wait_for(predicate, *, timeout_s: float, what: str, poll_s: float = 0.2, job: tuple | None = None):
    """`predicate()` once it is true. `job`: (JobSubmissionClient, job id) of the run the wait is on:
    if that job ends first the wait fails at once, with the end of its log, not at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and (status := job[0].get_job_status(job[1])).is_terminal():
            raise AssertionError(f"job {job[1]} ended {status} while waiting for {what}:\n{job_log_tail(*job)}")
        time.sleep(poll_s)
    tail = f":\n{job_log_tail(*job)}" if job is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{tail}")


def paused(plan: Path, *, run: str, timeout_s: float, job: tuple | None = None) -> dict:
    """The marker of the run's pause that the plan lists (which process paused), once it is taken."""
    def marker():
        found = sorted(plan.parent.glob(f"paused-{run}-*.json"))
        return json.loads(found[0].read_text()) if found else None

    return wait_for(marker, timeout_s=timeout_s, what=f"a process of run {run} to pause as {plan} says", job=job)
