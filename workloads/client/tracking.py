"""The run's experiment tracker as the commands set it up: which URI, experiment, run name and tags
the job's config carries (workloads/train/tracking.py does the logging), the local store of
`run --local`, what a local run adds at its end (its report, loss plot and exported model), and how
to open the UI.

A job that is stopped (`stop`), or a local run interrupted with its cluster, ends its tracker run
KILLED from here (`end_stopped_run`): its rank 0 was killed before it could say so, or said FAILED
when its peers went first.

The URI is, first to last: `--set tracking.uri=...`, $MLFLOW_TRACKING_URI where the command runs,
the stack's SageMaker managed MLflow tracking server (`ray-eks:mlflow`: its ARN, a stack output),
and for `run --local` a sqlite store under runs/mlflow. The experiment defaults to the stack's name,
or `local`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Callable, Optional

from workloads.client.report import parse_prefixed
from workloads.context import TRACKING_PREFIX

STORE_DIR = "mlflow"
"""The local store's folder under runs/: mlflow.db and artifacts/."""

PROJECT_DIR = Path(__file__).resolve().parents[2]


def local_store_uri(runs_dir: Path) -> str:
    """The sqlite URI of the local store under `runs_dir` (absolute: the Ray workers write it too),
    made here when it is new: MLflow gives a new store a "Default" experiment whose artifacts go to
    ./mlruns of the process that made it, which was a rank's temporary working folder, deleted
    with the job; made here, they go to artifacts/ beside the database."""
    folder = (runs_dir / STORE_DIR).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    if not (folder / "mlflow.db").exists() and mlflow_installed():
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        from workloads.train.tracking import default_artifact_location

        SqlAlchemyStore(uri, default_artifact_location(uri)).engine.dispose()
    return uri


def mlflow_installed() -> bool:
    return importlib.util.find_spec("mlflow") is not None


def git_commit(project_dir: Path = PROJECT_DIR) -> Optional[str]:
    """The checkout's commit, with `-dirty` when tracked files have changes; None outside git."""
    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(project_dir), *args], capture_output=True, text=True,
                                  timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def stack_image(stack: str, project_dir: Path = PROJECT_DIR) -> Optional[str]:
    """The Ray image the stack file names (its default when it names none); None when unreadable."""
    try:
        from infra.config import DEFAULT_RAY_IMAGE, config_key, read_stack_values, stack_file

        values = read_stack_values(stack_file(stack, project_dir))
    except Exception:  # a tag is not worth failing a submission for
        return None
    return str(values.get(config_key("ray_image")) or DEFAULT_RAY_IMAGE)


def split_credentials(uri: str) -> tuple[str, dict[str, str]]:
    """(the URI without its user and password, MLflow's environment variables that carry them). A
    URI travels in the job's entrypoint, its report and its logs: the credentials must not."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri, {}
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    found = {"MLFLOW_TRACKING_USERNAME": urllib.parse.unquote(parts.username or ""),
             "MLFLOW_TRACKING_PASSWORD": urllib.parse.unquote(parts.password or "")}
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), {k: v for k, v in found.items() if v}


def with_tracking(train: dict, *, uri: str, run_name: str, experiment: str = "",
                  tags: Optional[dict[str, str]] = None) -> dict:
    """The job's config with the tracker filled in where the user set nothing: the URI (without any
    credentials in it, `split_credentials`), experiment and run name, and the tags (a user's own tag
    of the same key wins)."""
    section = dict(train.get("tracking") or {})
    section["uri"], _ = split_credentials(section.get("uri") or uri)
    section["experiment"] = section.get("experiment") or experiment
    section["run_name"] = section.get("run_name") or run_name
    section["tags"] = {**(tags or {}), **(section.get("tags") or {})}
    return {**train, "tracking": section}


def resolve_uri(train: dict, *, stack_uri: Optional[str] = None, local_default: Optional[str] = None,
                environ: Optional[dict] = None) -> str:
    """The URI the run logs to (module docstring's order); empty: not tracked."""
    env = os.environ if environ is None else environ
    mine = (train.get("tracking") or {}).get("uri") or ""
    if mine == "off":
        return ""
    return mine or env.get("MLFLOW_TRACKING_URI") or stack_uri or local_default or ""


def credentials_note(uri: str, *, environ: Optional[dict] = None) -> str:
    """One line for a submission to a cluster of its own (`submit`), when this machine holds
    credentials the job might need (in the tracking URI, or MLflow's or the hub's variables): they
    are not sent with the job, and where the job finds them instead. Empty when there are none."""
    from workloads.launch.credentials import CREDENTIAL_NAMES, CREDENTIALS_SECRET

    env = os.environ if environ is None else environ
    names = sorted({*split_credentials(uri)[1], *(n for n in CREDENTIAL_NAMES if env.get(n))})
    if not names:
        return ""
    return (f"{', '.join(names)} stay on this machine (a job's entrypoint and runtime_env are shown to whoever "
            f"lists jobs): on a stack the job reads them from the Kubernetes Secret {CREDENTIALS_SECRET} of the "
            f"Ray namespace (kubectl -n ray create secret generic {CREDENTIALS_SECRET} --from-env-file=FILE; "
            "docs/SECURITY.md), on a cluster of your own from its processes' environment")


def client_tags(*, stack: Optional[str] = None) -> dict[str, str]:
    """What only the submitting machine knows: the checkout's commit, and with a stack its name and image."""
    tags: dict[str, str] = {}
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    if stack:
        tags["stack"] = stack
        image = stack_image(stack)
        if image:
            tags["image"] = image
    return tags


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackedRun:
    run_id: str
    experiment: str
    experiment_id: str
    uri: str


def tracked_run(logs: str) -> Optional[TrackedRun]:
    """The tracker run a job's log names (rank 0's last `[tracking] {...}` line), or None."""
    found = None
    for line in logs.splitlines():
        record = parse_prefixed(line, TRACKING_PREFIX)
        if record and record.get("run_id"):
            found = record
    if found is None:
        return None
    return TrackedRun(run_id=str(found["run_id"]), experiment=str(found.get("experiment", "")),
                      experiment_id=str(found.get("experiment_id", "")), uri=str(found.get("uri", "")))


def end_stopped_run(logs: str, *, say: Callable[[str], None], uri: str = "") -> bool:
    """End the tracker run a job's log names KILLED, once this command stopped the job (or its local
    cluster) while it ran: left RUNNING when its rank 0 was killed first, or FAILED when its rank 0
    or the driver saw its peers go first. A run that FINISHED is left so. `uri`: the tracker's
    (default: as the log names it, without a password). True when it was ended here."""
    run = tracked_run(logs)
    if run is None:
        return False
    from workloads.train.tracking import end_run

    status = "KILLED"
    if not end_run(uri or run.uri, run_id=run.run_id, status=status, over=("RUNNING", "FAILED"), say=say):
        return False
    say(f"tracking: run {run.run_id} ended {status}")
    return True


def _shown(path: Path) -> str:
    """A path relative to the working folder when it is under it (what a user types), else absolute."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def ui_command(uri: str) -> Optional[str]:
    """The one command that opens the MLflow UI on a local store (sqlite or a folder); None for a server."""
    if uri.startswith("sqlite:///"):
        store = f"sqlite:///{_shown(Path(uri.removeprefix('sqlite:///')))}"
    elif uri.startswith("file:") or ":" not in uri:
        store = _shown(Path(uri.removeprefix("file://")))
    else:
        return None
    mlflow = Path(sys.executable).with_name("mlflow")
    program = _shown(mlflow) if mlflow.exists() else "mlflow"
    return shlex.join([program, "ui", "--backend-store-uri", store, "--port", "5000"])


def where_to_look(run: TrackedRun, *, uri: str) -> str:
    """One line: the run, and how to open it (the UI command of a local store, the server's page)."""
    command = ui_command(uri)
    if command is not None:
        return f"run {run.run_id} in experiment {run.experiment}; open the UI: {command} (then http://127.0.0.1:5000)"
    if uri.startswith("arn:"):
        return (f"run {run.run_id} in experiment {run.experiment} on {uri}; open the UI: aws sagemaker "
                f"create-presigned-mlflow-tracking-server-url --tracking-server-name {uri.rsplit('/', 1)[-1]}")
    page = f"{uri.rstrip('/')}/#/experiments/{run.experiment_id}/runs/{run.run_id}"
    return f"run {run.run_id} in experiment {run.experiment}: {page}"


def add_local_results(run: TrackedRun, *, train: dict, files: tuple[Path, ...], model: Optional[Path],
                      say: Callable[[str], None]) -> bool:
    """Add what a local run made after the job (the report, the loss plot, the exported model's
    folder) to its tracker run. Bounded wait; never raises."""
    from workloads.train.config import TrackingConfig
    from workloads.train.tracking import annotate_run

    settings = TrackingConfig(**{k: v for k, v in (train.get("tracking") or {}).items()
                                 if k in {f.name for f in dataclasses.fields(TrackingConfig)}})
    tags = {"model_location": str(model.resolve())} if model is not None and model.is_dir() else {}
    return annotate_run(settings, run_id=run.run_id, tags=tags, files=tuple(p for p in files if p.is_file()),
                        say=say)
