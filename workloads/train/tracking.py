"""The run in an experiment tracker (MLflow), logged by rank 0 only; off unless a URI is set.

Ray Train V2 has no tracking callback, so the loop calls this module: `start` when it has resumed
(the config as parameters, the run's shape as tags, a restart or resize as an event), `log_step` at
each log step, `finish` at the end (the loop's summary and the run's status). Without a URI, or on
any rank but 0, these are no-ops and MLflow is never imported.

A tracker that is down or slow never stops or slows training: every record goes to a bounded buffer
that a background thread sends in order. When a request fails, the thread warns once, keeps the
records (the oldest step records are dropped beyond `tracking.buffer_records`, and counted), and
retries with a growing pause; when the tracker answers again it says so and sends what it kept.
`finish` waits at most `tracking.flush_timeout_s` for that, then returns. A record the tracker
refuses (a 4xx answer) is skipped with a warning rather than retried for ever.

The run id is kept with each checkpoint (workloads/train/checkpoint.py `Progress`), so a resumed or
resubmitted run continues the same tracker run; a run whose checkpoint predates its tracker run is
found again by its run name.

A run ends FINISHED with the loop's summary; a loop that raises ends it FAILED, or KILLED when
interrupted (`ends_with_the_run`, around the loop in each adapter). A run whose rank 0 is killed
before it can say so (a stopped job, a local cluster stopped with Ctrl-C, a worker lost) is ended
afterwards by whoever sees the job end (`end_run`: the job's driver when Ray Train gives up, the
client on `stop` and on a local run's end), only while it is still RUNNING.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from workloads.context import TRACKING_PREFIX
from workloads.train.config import PREFERENCE_METRICS, TrackingConfig, TrainConfig

if TYPE_CHECKING:  # both import torch, which the driver's use of this module does not need
    from workloads.train.checkpoint import Progress
    from workloads.train.parallel import MeshPlan

URI_ENV = "MLFLOW_TRACKING_URI"
"""Read where rank 0 runs when the config sets no URI (MLflow's own variable)."""

STEP_METRICS = {
    "loss": "train_loss",
    "eval_loss": "eval_loss",
    "lr": "lr",
    "tokens_per_s_per_device": "tokens_per_s_per_device",
    "mfu": "mfu",
    "grad_norm": "grad_norm",
    "peak_mem_gib": "peak_mem_gib",
    # A preference objective's (workloads/train/preference.py), under TRL's names.
    **{name: name for name in PREFERENCE_METRICS},
    **{f"eval_{name}": f"eval_{name}" for name in PREFERENCE_METRICS},
}
"""The loop's step record keys -> the tracker's metric names."""

RUN_NAME_TAG = "workloads.run_name"
"""The Ray Train run name: how a resumed run finds its tracker run when no checkpoint names it."""

PARAM_VALUE_LIMIT = 6000
"""MLflow's longest parameter value (characters)."""
BATCH_PARAMS = 100
"""MLflow's most parameters in one log_batch request."""


OFF = "off"
"""The URI that turns tracking off whatever $MLFLOW_TRACKING_URI says."""


def tracking_uri(settings: TrackingConfig, environ: Optional[dict] = None) -> str:
    """The URI rank 0 logs to: the config's, else $MLFLOW_TRACKING_URI; empty: no tracking."""
    if settings.uri.strip() == OFF:
        return ""
    env = os.environ if environ is None else environ
    return (settings.uri or env.get(URI_ENV, "")).strip()


def public_uri(uri: str) -> str:
    """The URI without a password (http://user:secret@host -> http://user@host)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = f"{parts.username}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def default_artifact_location(uri: str) -> Optional[str]:
    """A sqlite store keeps its artifacts in `artifacts/` beside the database file (MLflow's own
    default, ./mlruns, would be relative to each process's working folder); None for any other
    store, whose server decides."""
    if not uri.startswith("sqlite:///"):
        return None
    database = Path(uri.removeprefix("sqlite:///"))
    return (database.parent / "artifacts").absolute().as_uri()


def config_params(cfg: TrainConfig) -> dict[str, str]:
    """The config flattened to dotted keys (`model.name_or_path`), lists as JSON; the tracking
    section is left out (it says where the run is logged, not how it trains)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}{key}.", inner)
            return
        text = value if isinstance(value, str) else json.dumps(value)
        out[prefix.rstrip(".")] = text[:PARAM_VALUE_LIMIT]

    walk("", {k: v for k, v in cfg.to_dict().items() if k != "tracking"})
    return out


def step_metrics(record: dict) -> dict[str, float]:
    """The tracker's metrics of one step record; missing and None values left out."""
    out = {}
    for key, name in STEP_METRICS.items():
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


@dataclass(frozen=True, kw_only=True)
class Resumption:
    """How this start of the run relates to the checkpoint it resumed from."""

    step: int
    """The step it resumed after (0: a fresh start)."""
    world_size: int
    """Ranks of this start."""
    saved_world_size: int
    """Ranks that saved the checkpoint (0: not recorded)."""
    nodes: int
    """Nodes of this start."""
    samples_per_step: int = 0
    """Samples per optimizer step of this start, kept across a resize (workloads/train/elastic.py)."""
    grad_accum_steps: int = 0
    """Micro-steps per optimizer step of this start, rescaled to keep them."""

    def event(self) -> Optional[tuple[str, str]]:
        """(tag key, message) of a restart or resize; None for a fresh start."""
        if self.step == 0:
            return None
        resized = self.saved_world_size and self.saved_world_size != self.world_size
        kind = "resize" if resized else "restart"
        was = f", was {self.saved_world_size}" if resized else ""
        if resized and self.samples_per_step:
            was += (f"; {self.samples_per_step} samples per optimizer step kept with grad_accum_steps="
                    f"{self.grad_accum_steps}")
        return (f"event.step-{self.step:07d}.{kind}",
                f"resumed after step {self.step} on {self.world_size} ranks ({self.nodes} node(s)){was}")


class Tracker:
    """No tracking (no URI, or a rank other than 0): every call does nothing."""

    @property
    def run_id(self) -> str:
        return ""

    def log_step(self, record: dict) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass

    def end(self, status: str) -> None:
        pass


_UNFINISHED: list[Tracker] = []
"""This process's trackers whose run has not ended: what `ends_with_the_run` ends when the loop
raises (the loop itself only ends a run that reaches its summary)."""


@contextlib.contextmanager
def ends_with_the_run() -> Iterator[None]:
    """Around a run of the training loop: when it raises, each tracker run it opened in this
    process ends FAILED, or KILLED for an interruption (Ctrl-C, SIGTERM turned into SystemExit),
    instead of staying RUNNING; then the exception goes on."""
    try:
        yield
    except BaseException as exc:
        status = "KILLED" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "FAILED"
        for tracker in list(_UNFINISHED):
            tracker.end(status)
        raise


class MlflowSink:
    """The few MLflow client calls the tracker makes. Importing it imports MLflow."""

    def __init__(self, uri: str) -> None:
        # The tracker retries on its own schedule: MLflow's retries (7, backing off for minutes)
        # would hold each record that long, and its 120 s timeout hide a server that hangs.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)

    def experiment_id(self, name: str, *, artifact_location: Optional[str]) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location)
        except Exception:
            found = self.client.get_experiment_by_name(name)  # created meanwhile by another run
            if found is None:
                raise
            return found.experiment_id

    def existing_run(self, experiment_id: str, *, run_id: str, run_name: str):
        """The run to continue: `run_id` when the tracker has it, else the newest of the
        experiment's runs tagged with `run_name`; None when there is none."""
        if run_id:
            try:
                return self.client.get_run(run_id)
            except Exception as exc:
                if _http_status(exc) != 404:
                    raise
        if run_name and "'" not in run_name:
            runs = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
                                           order_by=["attributes.start_time DESC"], max_results=1)
            if runs:
                return runs[0]
        return None

    def find_run(self, experiment: str, *, run_name: str):
        """The newest run of `experiment` named `run_name`, or None (nothing is created)."""
        found = self.client.get_experiment_by_name(experiment)
        return None if found is None else self.existing_run(found.experiment_id, run_id="", run_name=run_name)

    def create_run(self, experiment_id: str, *, run_name: str, tags: dict[str, str]):
        return self.client.create_run(experiment_id, run_name=run_name or None, tags=tags)

    def set_running(self, run_id: str) -> None:
        self.client.update_run(run_id, status="RUNNING")

    def log_batch(self, run_id: str, *, metrics: tuple = (), params: Optional[dict] = None,
                  tags: Optional[dict] = None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        items = [Param(k, v) for k, v in (params or {}).items()]
        for start in range(0, max(len(items), 1), BATCH_PARAMS):
            self.client.log_batch(
                run_id, params=items[start:start + BATCH_PARAMS],
                metrics=[Metric(k, v, ts, step) for k, v, ts, step in metrics] if start == 0 else [],
                tags=[RunTag(k, v) for k, v in (tags or {}).items()] if start == 0 else [])

    def log_json(self, run_id: str, obj: Any, name: str) -> None:
        self.client.log_dict(run_id, obj, name)

    def log_file(self, run_id: str, path: Path) -> None:
        self.client.log_artifact(run_id, str(path))

    def end(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def status(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.status


def _http_status(exc: BaseException) -> Optional[int]:
    status = getattr(exc, "get_http_status_code", None)
    try:
        return int(status()) if callable(status) else None
    except (TypeError, ValueError):
        return None


def refused(exc: BaseException) -> bool:
    """The tracker answered and refused the request (4xx but 429): sending it again cannot help."""
    status = _http_status(exc)
    return status is not None and 400 <= status < 500 and status != 429


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


@dataclass(eq=False)
class _Record:
    kind: str
    """params, tags, metrics, json, end"""
    payload: Any
    droppable: bool = False


class BackgroundTracker(Tracker):
    """Rank 0's tracker: records buffered in order and sent by a daemon thread (module docstring)."""

    def __init__(self, *, sink_factory: Callable[[], Any], settings: TrackingConfig, uri: str,
                 run_id: str = "", say: Callable[[str], None] = lambda line: print(line, flush=True),
                 backoff_s: tuple[float, float] = (1.0, 30.0), clock: Callable[[], float] = time.time) -> None:
        self.settings, self.uri, self.say, self.clock = settings, uri, say, clock
        self._sink_factory = sink_factory
        self._backoff = backoff_s
        self._known_id = run_id
        """The id from the checkpoint (until the run is open) or the open run's id."""
        self._open = False
        self._pending: deque[_Record] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._sending: Optional[_Record] = None
        self._resumed_params: Optional[dict] = None
        """The parameters of the run continued, once open (None: a new run)."""
        self._wake = threading.Event()
        self.dropped = 0
        """Step records dropped from a full buffer."""
        self.handled = 0
        """Records the tracker took or refused."""
        self._thread = threading.Thread(target=self._work, name="tracking", daemon=True)
        self._thread.start()
        _UNFINISHED.append(self)

    @property
    def run_id(self) -> str:
        with self._cv:
            return self._known_id

    def put(self, kind: str, payload: Any, *, droppable: bool = False) -> None:
        """Queue one record; never blocks on the tracker. A full buffer drops its oldest step record
        (never the one being sent, nor the few others: the opening record, the summary, the end)."""
        with self._cv:
            if self._closing:
                return
            if droppable and len(self._pending) >= self.settings.buffer_records:
                self.dropped += 1
                victim = next((r for r in self._pending if r.droppable and r is not self._sending), None)
                if victim is None:
                    return
                self._pending.remove(victim)
            self._pending.append(_Record(kind, payload, droppable))
            self._cv.notify()

    def log_step(self, record: dict) -> None:
        metrics = step_metrics(record)
        if metrics and "step" in record:
            stamp = int(self.clock() * 1000)
            self.put("metrics", tuple((k, v, stamp, int(record["step"])) for k, v in metrics.items()),
                     droppable=True)

    def finish(self, summary: dict, *, status: str = "FINISHED") -> None:
        """Queue the summary and the end of the run, then wait at most flush_timeout_s for them."""
        steps = summary.get("steps_done", 0) + summary.get("resumed_from_step", 0)
        stamp = int(self.clock() * 1000)
        means = {"mean_tokens_per_s_per_device": summary.get("tokens_per_s_per_device"),
                 "mean_mfu": summary.get("mfu")}
        known = tuple((k, float(v), stamp, steps) for k, v in means.items()
                      if isinstance(v, (int, float)) and math.isfinite(v))
        if known:
            self.put("metrics", known)
        self.put("json", (summary, "summary.json"))
        self.end(status)

    def end(self, status: str) -> None:
        """Queue the end of the run with `status` (FINISHED, FAILED, KILLED), then wait at most
        flush_timeout_s for it and what was queued before it."""
        self.put("end", status)
        self.close(timeout_s=self.settings.flush_timeout_s)

    def close(self, *, timeout_s: float) -> None:
        if self in _UNFINISHED:
            _UNFINISHED.remove(self)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        with self._cv:
            left = len(self._pending)
        if left or self.dropped:
            parts = [f"{left} record(s) not sent within {timeout_s:g} s"] if left else []
            if self.dropped:
                parts.append(f"{self.dropped} step record(s) dropped from the full buffer")
            self.say(f"{TRACKING_PREFIX}warning: {public_uri(self.uri)}: {'; '.join(parts)}; training was not "
                     "held up")

    def _next(self) -> Optional[_Record]:
        with self._cv:
            while not self._pending and not self._closing:
                self._cv.wait()
            self._sending = self._pending[0] if self._pending else None
            return self._sending

    def _work(self) -> None:
        sink = None
        failures = 0
        pause = self._backoff[0]
        while (record := self._next()) is not None:
            try:
                if sink is None:
                    sink = self._sink_factory()
                if not self._open:
                    self._open_run(sink)
                self._send(sink, record)
            except ImportError as exc:
                self.say(f"{TRACKING_PREFIX}warning: tracking is off: {first_line(exc)} (install the `tracking` "
                         "extra, or on the cluster the job's runtime_env pip packages)")
                with self._cv:
                    self._pending.clear()
                return
            except Exception as exc:
                if refused(exc) and not self._open:
                    self.say(f"{TRACKING_PREFIX}warning: tracking is off: {public_uri(self.uri)} refused to open "
                             f"the run: {first_line(exc)}")
                    with self._cv:
                        self._pending.clear()
                    return
                if refused(exc):
                    self.say(f"{TRACKING_PREFIX}warning: {public_uri(self.uri)} refused the {record.kind} record: "
                             f"{first_line(exc)}; skipped")
                else:
                    failures += 1
                    if failures == 1:
                        self.say(f"{TRACKING_PREFIX}warning: {public_uri(self.uri)} did not answer "
                                 f"({first_line(exc)}); training goes on, records are kept (up to "
                                 f"{self.settings.buffer_records}) and sent when it answers")
                    if self._wake.is_set():  # closing: retry often until finish stops waiting
                        time.sleep(min(pause, 1.0))
                    else:
                        self._wake.wait(pause)
                    pause = min(pause * 2, self._backoff[1])
                    continue
            with self._cv:
                if self._pending and self._pending[0] is record:
                    self._pending.popleft()
                self._sending = None
                self.handled += 1
            if failures:
                self.say(f"{TRACKING_PREFIX}{public_uri(self.uri)} answers again after {failures} failed "
                         "attempt(s); sending the records kept meanwhile")
                failures, pause = 0, self._backoff[0]

    def _open_run(self, sink) -> None:
        """Find or create the experiment and the run, and say which (one [tracking] JSON line)."""
        settings = self.settings
        experiment_id = sink.experiment_id(
            settings.experiment_name,
            artifact_location=settings.artifact_location or default_artifact_location(self.uri))
        found = sink.existing_run(experiment_id, run_id=self.run_id, run_name=settings.run_name)
        if found is None:
            run_id = sink.create_run(experiment_id, run_name=settings.run_name,
                                     tags={RUN_NAME_TAG: settings.run_name} if settings.run_name else {}).info.run_id
        else:
            run_id = found.info.run_id
            sink.set_running(run_id)
        with self._cv:
            self._known_id = run_id
            self._open = True
            self._resumed_params = dict(found.data.params) if found is not None else None
        self.say(TRACKING_PREFIX + json.dumps({
            "run_id": run_id, "experiment": settings.experiment_name, "experiment_id": experiment_id,
            "uri": public_uri(self.uri), "continued": found is not None}, separators=(",", ":")))

    def _send(self, sink, record: _Record) -> None:
        run_id = self.run_id
        if record.kind == "open":
            payload = record.payload
            params, tags = dict(payload["params"]), dict(payload["tags"])
            previous = self._resumed_params
            if previous is not None:
                # MLflow parameters are immutable: a resumed run logs the new ones, and says which changed.
                changed = {k: (previous[k], v) for k, v in params.items() if k in previous and previous[k] != v}
                params = {k: v for k, v in params.items() if k not in previous}
                if changed:
                    tags[f"params_changed.step-{payload['step']:07d}"] = "; ".join(
                        f"{k}: {old} -> {new}" for k, (old, new) in sorted(changed.items()))[:5000]
            sink.log_batch(run_id, params=params, tags=tags, metrics=payload["metrics"])
        elif record.kind == "metrics":
            sink.log_batch(run_id, metrics=record.payload)
        elif record.kind == "tags":
            sink.log_batch(run_id, tags=record.payload)
        elif record.kind == "json":
            obj, name = record.payload
            sink.log_json(run_id, obj, name)
        elif record.kind == "end":
            # A failure or an interruption does not overwrite what whoever stopped the run said of it.
            if record.payload == "FINISHED" or sink.status(run_id) == "RUNNING":
                sink.end(run_id, record.payload)
        else:
            raise AssertionError(record.kind)


def run_tags(cfg: TrainConfig, *, resumption: Resumption, parallelism: str) -> dict[str, str]:
    """The tags of this start: the client's (stack, image, git commit), the run's shape, an event.
    (RUN_NAME_TAG is set once, when the run is created: a continued run keeps the name it is found by.)"""
    tags = {**cfg.tracking.tags, "world_size": str(resumption.world_size), "nodes": str(resumption.nodes),
            "parallelism": parallelism}
    event = resumption.event()
    if event is not None:
        tags[event[0]] = event[1]
    return tags


def start(cfg: TrainConfig, *, rank: int, progress: Progress, world_size: int, nodes: int, plan: MeshPlan,
          sink_factory: Optional[Callable[[], Any]] = None, environ: Optional[dict] = None,
          clock: Callable[[], float] = time.time, **kwargs) -> Tracker:
    """Rank 0's tracker for this start of the run, resumed at `progress` (a no-op without a URI or
    on other ranks): its first record carries the config as parameters, the tags, and the world size
    at the resumed step."""
    uri = tracking_uri(cfg.tracking, environ)
    if rank != 0 or not uri:
        return Tracker()
    resumption = Resumption(step=progress.step, world_size=world_size, saved_world_size=progress.world_size,
                            nodes=nodes, samples_per_step=cfg.samples_per_rank_per_step * world_size,
                            grad_accum_steps=cfg.grad_accum_steps)
    tracker = BackgroundTracker(sink_factory=sink_factory or (lambda: MlflowSink(uri)), settings=cfg.tracking,
                                uri=uri, run_id=progress.tracking_run_id, clock=clock, **kwargs)
    stamp = int(clock() * 1000)
    parallelism = f"{plan.kind} {'x'.join(map(str, plan.shape))}"
    tracker.put("open", {
        "params": config_params(cfg), "tags": run_tags(cfg, resumption=resumption, parallelism=parallelism),
        "metrics": (("world_size", float(world_size), stamp, progress.step),), "step": progress.step})
    return tracker


def _within(timeout_s: float, call: Callable[[], Any]) -> tuple[Any, Optional[str]]:
    """(what `call` returned, None), or (None, why it did not within `timeout_s`): in a daemon
    thread, so that a tracker that hangs holds nobody up."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((call(), None))
        except BaseException as exc:  # reported to the caller; this thread must not die with a traceback
            outcome.append((None, first_line(exc)))

    thread = threading.Thread(target=run, name="tracking-call", daemon=True)
    thread.start()
    thread.join(timeout=timeout_s)
    return outcome[0] if outcome else (None, f"no answer within {timeout_s:g} s")


def annotate_run(settings: TrackingConfig, *, run_id: str, tags: dict[str, str], timeout_s: float = 30.0,
                 files: tuple[Path, ...] = (), say: Callable[[str], None] = print,
                 sink_factory: Optional[Callable[[], Any]] = None, environ: Optional[dict] = None) -> bool:
    """Add tags and files to a run that has ended (the exported model's place, the client's report),
    waiting at most `timeout_s`; False, with one warning, when it could not. Never raises. Without
    `run_id` (a checkpoint saved before the run was open) the run is found by `settings.run_name`."""
    uri = tracking_uri(settings, environ)
    if not uri or not (run_id or settings.run_name):
        return False
    target = [run_id]

    def send() -> None:
        sink = (sink_factory or (lambda: MlflowSink(uri)))()
        if not target[0]:
            found = sink.find_run(settings.experiment_name, run_name=settings.run_name)
            if found is None:
                raise LookupError(f"no run named {settings.run_name} in experiment {settings.experiment_name}")
            target[0] = found.info.run_id
        if tags:
            sink.log_batch(target[0], tags=tags)
        for path in files:
            sink.log_file(target[0], path)

    _, why = _within(timeout_s, send)
    if why is not None:
        say(f"{TRACKING_PREFIX}warning: could not add {', '.join([*tags, *(p.name for p in files)])} to run "
            f"{target[0] or settings.run_name} at {public_uri(uri)}: {why}")
        return False
    return True


def end_run(uri: str, *, run_id: str = "", status: str, experiment: str = "", run_name: str = "",
            over: tuple[str, ...] = ("RUNNING",), timeout_s: float = 30.0, say: Callable[[str], None] = print,
            sink_factory: Optional[Callable[[], Any]] = None) -> bool:
    """End a tracker run whose status is one of `over` with `status` (FAILED, KILLED): the run of a
    job that failed or was stopped where its rank 0 could not say so (killed with its worker, or its
    cluster). Whoever stops a running job ends its run KILLED over FAILED too: its ranks fail as
    their peers are stopped. The run is `run_id`, else the newest named `run_name` in `experiment`.
    True when it was ended here; False when it was not in one of those states, or, with one
    warning, when the tracker could not be told within `timeout_s`. Never raises."""
    target = [run_id]

    def send() -> bool:
        sink = (sink_factory or (lambda: MlflowSink(uri)))()
        if not target[0]:
            found = sink.find_run(experiment, run_name=run_name)
            if found is None:
                return False  # the run never opened: nothing to end
            target[0] = found.info.run_id
        if sink.status(target[0]) not in over:
            return False
        sink.end(target[0], status)
        return True

    ended, why = _within(timeout_s, send)
    if why is not None:
        say(f"{TRACKING_PREFIX}warning: could not end run {target[0] or run_name} at {public_uri(uri)} as "
            f"{status}: {why}")
        return False
    return bool(ended)
