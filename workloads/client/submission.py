"""The Jobs API request of a run: the driver command, its pinned runtime_env and the uploaded package.

A GPU run on EKS (`expect="efa"`) gets the EFA transport env and the GPU-only packages in its
runtime_env; a CPU run installs nothing at job start.
"""

from __future__ import annotations

import json
import shlex
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Optional

from workloads.client.datapaths import stage_files
from workloads.client.run_record import record_submission
from workloads.transport.gate import EFA_TRANSPORT_ENV

PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The `workloads` package, uploaded as the job's working_dir."""

GPU_PACKAGES = ("liger-kernel==0.8.5", "peft==0.21.2")
"""Installed into GPU jobs' runtime_env: the loop's fused linear cross-entropy uses liger-kernel when
importable (docs/PERFORMANCE.md), and LoRA fine-tunes peft. The same pins as pyproject's `gpu`
extra and dependencies."""

TRACKING_PACKAGES = ("mlflow-skinny==3.17.2", "sagemaker-mlflow==0.5.0")
"""Installed into the runtime_env of a tracked job on EKS (and of any job tracked to a SageMaker ARN):
MLflow's client, and the plugin that signs its requests with the pod's IAM credentials. The same
pins as pyproject's `tracking` extra."""

EVALUATE_PACKAGES = ("lm-eval==0.4.13", "datasets==5.2.0", "evaluate==0.4.6", "rouge-score==0.1.2")
"""Installed into a GPU job's runtime_env when the run is evaluated (evaluate.tasks, the default):
EleutherAI's lm-evaluation-harness and the pins of what it needs that the image lacks. The same pins
as pyproject's `evaluate` extra."""

JOB_ENV = {
    "RAY_DEDUP_LOGS": "0",
    "PYTHONUNBUFFERED": "1",
}
"""Every worker line reaches the job logs unfolded and at once (progress and the NCCL logs)."""



@dataclass(frozen=True, kw_only=True)
class Submission:
    entrypoint: str
    runtime_env: dict
    metadata: dict


def runtime_env(*, working_dir: str, expect: Literal["efa", "any"], install: bool = True,
                tracking_uri: str = "", evaluate: bool = False) -> dict:
    """The job's pinned runtime_env. Only an EFA (GPU) run declares the transport and installs
    GPU_PACKAGES, and, when tracked, TRACKING_PACKAGES (also installed for a SageMaker ARN on any
    cluster: nothing else reads one), unless `install` is off (a cluster that cannot reach PyPI: the
    loop then uses its chunked loss, and tracks only with an MLflow of its own); a CPU run needs no
    network at job start."""
    packages = list(GPU_PACKAGES) if expect == "efa" else []
    if tracking_uri and (expect == "efa" or tracking_uri.startswith("arn:")):
        packages += TRACKING_PACKAGES
    if evaluate and expect == "efa":
        packages += EVALUATE_PACKAGES
    env_vars = {**JOB_ENV, **EFA_TRANSPORT_ENV} if expect == "efa" else dict(JOB_ENV)
    env: dict = {"working_dir": working_dir, "env_vars": env_vars}
    if install and packages:
        # pip_check off: `pip check` would also judge the image's own packages, not just these.
        env["pip"] = {"packages": packages, "pip_check": False}
    return env


def build_submission(*, train: dict, run_name: str, storage_path: str, max_failures: int,
                     working_dir: str, expect: Literal["efa", "any"], gpus: int = 0,
                     install: bool = True, wait_nodes_s: Optional[float] = None, workers: int = 0,
                     min_nodes: int = 0, wait_gpus_s: Optional[float] = None) -> Submission:
    """The Jobs API request: the driver command, a pinned runtime_env and searchable metadata."""
    driver_args = ["python", "-m", "workloads.launch.driver", "--config-json", json.dumps(train, separators=(",", ":")),
                   "--run-name", run_name, "--storage-path", storage_path, "--max-failures", str(max_failures)]
    if gpus:
        driver_args += ["--gpus", str(gpus)]
    if wait_nodes_s is not None:
        driver_args += ["--wait-nodes-s", f"{wait_nodes_s:g}"]
    if wait_gpus_s is not None:
        driver_args += ["--wait-gpus-s", f"{wait_gpus_s:g}"]
    if workers:
        driver_args += ["--workers", str(workers)]
    if min_nodes:
        driver_args += ["--min-nodes", str(min_nodes)]
    return Submission(
        entrypoint=shlex.join(driver_args),
        runtime_env=runtime_env(working_dir=working_dir, expect=expect, install=install,
                                tracking_uri=(train.get("tracking") or {}).get("uri", ""),
                                evaluate=bool(((train.get("evaluate") or {}).get("tasks") or "").strip())),
        metadata={"run_name": run_name, "storage_path": storage_path},
    )


@contextmanager
def staged_package(files: tuple[tuple[str, Path], ...] = ()) -> Iterator[Path]:
    """A temporary folder holding only the `workloads` package and the local `files` the config
    names, each at its place: what the job's working_dir uploads."""
    with tempfile.TemporaryDirectory(prefix="workloads-job-") as tmp:
        shutil.copytree(PACKAGE_DIR, Path(tmp) / "workloads",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        stage_files(Path(tmp), files)
        yield Path(tmp)



@dataclass(frozen=True, kw_only=True)
class SubmitRequest:
    train: dict
    """TrainConfig.to_dict() of the run."""
    run_name: str
    """Ray Train run name; submitting again with the same name and storage resumes the run."""
    storage_path: str
    max_failures: int
    expect: Literal["efa", "any"]
    """Network required between nodes, for the in-band gate, the job env and the offline check."""
    quiet: bool
    """Print only progress, not every job log line."""
    gpus: int = 0
    """GPUs the job waits for before training (the stack's worker GPUs); 0: not known."""
    install: bool = True
    """Install GPU_PACKAGES into a GPU job's runtime_env (off for clusters that cannot reach PyPI)."""
    files: tuple[tuple[str, Path], ...] = ()
    """Local files and folders uploaded with the job: (place in its working_dir, local path)."""
    wait_nodes_s: Optional[float] = None
    """How long the job waits for a lost node to come back (None: the driver's default)."""
    resubmits: int = 3
    """How many times a job that the cluster lost with its head is submitted again."""
    workers: int = 0
    """CPU workers a run without GPUs waits for (set on a resubmission: the world size it had)."""
    min_nodes: int = 0
    """An elastic run goes on with at least this many nodes after a node loss; 0: all of them."""
    wait_gpus_s: Optional[float] = None
    """How long the job waits for its GPUs (or CPU workers) before it fails (None: the driver's
    default)."""


def submit_job(client, request: SubmitRequest, *, submission_id: Optional[str] = None) -> str:
    """Upload the staged package with the driver command; returns the job's submission id. The
    submission is recorded on this machine first (workloads/client/run_record.py)."""
    record_submission(run_name=request.run_name, storage_path=request.storage_path, train=request.train,
                      files=request.files)
    with staged_package(request.files) as working_dir:
        submission = build_submission(train=request.train, run_name=request.run_name,
                                      storage_path=request.storage_path, max_failures=request.max_failures,
                                      working_dir=str(working_dir), expect=request.expect, gpus=request.gpus,
                                      install=request.install, wait_nodes_s=request.wait_nodes_s,
                                      workers=request.workers, min_nodes=request.min_nodes,
                                      wait_gpus_s=request.wait_gpus_s)
        return client.submit_job(entrypoint=submission.entrypoint, runtime_env=submission.runtime_env,
                                 metadata=submission.metadata, submission_id=submission_id)

