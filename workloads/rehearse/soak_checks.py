"""The checks of a finished soak (workloads/rehearse/soak.py), each a function of what the soak
recorded: the steps each fault cost against its allowance, restarts no fault explains, each step's
loss against the uninterrupted run, the growth of each process's resident memory after its warm-up,
the bytes in the bucket, the run's MLflow record; `judge` adds them to the record and `failed_lines`
says what failed, one line each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from workloads.client.report import completed_losses
from workloads.rehearse.soak_plan import OUTAGES

if TYPE_CHECKING:
    from workloads.rehearse.job_logs import JobLogs
    from workloads.rehearse.services import MlflowServer
    from workloads.rehearse.soak_plan import SoakSettings

JUDGED_ROLES = ("driver", "head", "train worker")
"""The roles whose memory must be judged for the memory check to hold."""

REFERENCE_TOLERANCE = 0.0
"""Relative gap allowed between a step's loss and the uninterrupted run's: none. The same loop on the
same samples, ranks and mesh adds the same numbers in the same order, and a step redone after a
restart from a checkpoint repeats its loss bit for bit."""


LOG_LAG_STEPS = 20
"""How far behind the run the job log may be when a fault comes (Ray forwards worker lines in batches)."""


class FinishedSoak(Protocol):
    """What the checks and the record read of a soak that ran (workloads/rehearse/soak.py's Soak)."""

    settings: SoakSettings
    record: dict
    """What the run noted (Soak.run); `judge` adds the checks."""
    memory: list[dict]
    storage_samples: list[dict]
    tracker: MlflowServer
    reference: dict[int, float]
    """The uninterrupted run's loss at each step, set by `judge`."""

    @property
    def logs(self) -> JobLogs: ...


def fault_rows(record: dict, logs: JobLogs, *, checkpoint_every: int) -> list[dict]:
    """Each fault with what it cost and whether that was within its allowance: no restart and no
    step lost through an outage; otherwise at most the steps since the last checkpoint (the newest
    complete checkpoint in storage is resumed from), and for a drained node a checkpoint saved on
    the notice too. The steps lost are those the attempt the fault hit trained beyond the step the
    next attempt resumed from."""
    notices = logs.records("[preemption] ")
    rows = []
    for event in record["faults"]:
        row = {"kind": event["kind"], "step": event["step"], "at_s": event["at_s"],
               "recovery_s": round(event["trained_again_s"] - event["at_s"], 1) if event["trained_again_s"] else None}
        if event["kind"] in OUTAGES:
            restarted = event["attempt_after"] is not None
            row.update(resumed_from=None, lost=0, allowance="no restart, no step lost", within=not restarted)
        else:
            before = max([event.get("trained_to") or 0, *logs.steps.get(event["attempt_before"], [0])])
            resumed = min(logs.steps[event["attempt_after"]]) - 1 if event["attempt_after"] else None
            row.update(resumed_from=resumed, lost=None if resumed is None else before - resumed)
            row["allowance"] = f"at most {checkpoint_every} (the checkpoint interval)"
            row["within"] = resumed is not None and 0 <= before - resumed <= checkpoint_every
            if "complete in storage and not registered" in event["detail"]:  # that checkpoint is resumed from
                row["allowance"] = "none: the complete checkpoint the head never registered is resumed from"
                row["within"] = resumed is not None and before == resumed
            if event["kind"] == "node-drain":  # and the loop saved a checkpoint on the notice
                notice = next((n for n in notices if n.get("event") == "checkpoint-on-notice"
                               and n.get("step", 0) >= event["step"] - LOG_LAG_STEPS), None)
                row["allowance"] += ", and a checkpoint on the notice"
                row["notice_step"] = None if notice is None else notice["step"]
                row["within"] = row["within"] and notice is not None
        rows.append(row)
    return rows


def unplanned_restarts(record: dict, logs: JobLogs) -> list[int]:
    """Attempts that no fault explains (rank 0's pids)."""
    explained = {e["attempt_after"] for e in record["faults"]}
    return [pid for pid in logs.attempt_pids[1:] if pid not in explained]


def loss_gaps(losses: dict[int, float], reference: dict[int, float]) -> dict:
    steps = sorted(reference)
    gaps = {s: abs(losses[s] - reference[s]) / abs(reference[s]) for s in steps if s in losses}
    return {"steps_compared": len(gaps), "missing_steps": [s for s in steps if s not in losses],
            "max_relative_gap": max(gaps.values()) if gaps else None,
            "within": bool(gaps) and len(gaps) == len(steps) and max(gaps.values()) <= REFERENCE_TOLERANCE}


def memory_growth(samples: list[dict], *, settings: SoakSettings, until_s: float,
                  attempts_trained_s: list[float]) -> dict[str, dict]:
    """Per role: the largest growth of a process's resident memory after its warm-up (from its
    start; for a train worker, from the first of `attempts_trained_s`, when an attempt first
    trained, after its start: a worker that never trained is not judged), while the run
    trained (until `until_s`: the driver's work after training, its report to the tracker, is not
    growth), among the processes that lived long enough beyond their warm-up to judge (`settings`):
    the mean of its last three samples against the mean of its first three after warm-up. `longest`
    is the judged process that lived longest: its pid, life, and those two means (start, end);
    `unjudged`, when no process of the role was judged, says why for the one sampled longest after
    its warm-up."""
    by_process: dict[tuple[str, int], list[dict]] = {}
    for sample in samples:
        if sample["t"] <= until_s:
            by_process.setdefault((sample["role"], sample["pid"]), []).append(sample)
    roles: dict[str, dict] = {}
    for (role, pid), series in by_process.items():
        entry = roles.setdefault(role, {"processes": 0, "judged": 0, "max_growth_mib": None, "pid": None,
                                        "peak_rss_mib": 0.0, "longest": None, "unjudged": None})
        entry["processes"] += 1
        entry["peak_rss_mib"] = max(entry["peak_rss_mib"], max(s["rss_mib"] for s in series))
        warm_from = series[0]["t"]
        if role == "train worker":
            warm_from = min((t for t in attempts_trained_s if t >= series[0]["t"]), default=float("inf"))
        settled = [s for s in series if s["t"] >= warm_from + settings.memory_warmup_s]
        span = settled[-1]["t"] - settled[0]["t"] if settled else -1.0
        if len(settled) < 6 or span < settings.memory_judged_after_s:
            if entry["unjudged"] is None or span > entry["unjudged"]["span_s"]:
                entry["unjudged"] = {"pid": pid, "span_s": round(span, 1),
                                     "why": why_unjudged(series, warm_from=warm_from, settled=settled,
                                                         settings=settings, until_s=until_s)}
            continue
        start, end = (sum(s["rss_mib"] for s in part) / 3 for part in (settled[:3], settled[-3:]))
        growth = end - start
        lived = series[-1]["t"] - series[0]["t"]
        if entry["longest"] is None or lived > entry["longest"]["lived_s"]:
            entry["longest"] = {"pid": pid, "lived_s": round(lived, 1), "start_mib": round(start, 1),
                                "end_mib": round(end, 1)}
        entry["judged"] += 1
        if entry["max_growth_mib"] is None or growth > entry["max_growth_mib"]:
            entry["max_growth_mib"], entry["pid"] = round(growth, 1), pid
    for entry in roles.values():
        entry["within"] = entry["max_growth_mib"] is None or entry["max_growth_mib"] <= settings.memory_growth_limit_mib
        if entry["judged"]:
            entry["unjudged"] = None
    return roles


def judgeable_at(samples: list[dict], *, settings: SoakSettings, attempts_trained_s: list[float]) -> dict[str, float]:
    """For each role of JUDGED_ROLES with a process in the latest samples: when the earliest of those
    processes will have been sampled long enough after its warm-up to be judged (as memory_growth
    judges), if it lives and trains on until then; a role missing there is missing here."""
    if not samples:
        return {}
    latest = samples[-1]["t"]
    first: dict[tuple[str, int], float] = {}
    for sample in samples:
        first.setdefault((sample["role"], sample["pid"]), sample["t"])
    alive = {(sample["role"], sample["pid"]) for sample in samples if sample["t"] == latest}
    # Six samples after the warm-up span at least five sample intervals; one more for where the
    # warm-up ends between two samples.
    window = settings.memory_warmup_s + max(settings.memory_judged_after_s, 5 * settings.sample_every_s) \
        + settings.sample_every_s
    ready: dict[str, float] = {}
    for role, pid in alive:
        if role not in JUDGED_ROLES:
            continue
        warm_from = first[(role, pid)]
        if role == "train worker":
            warm_from = min((t for t in attempts_trained_s if t >= warm_from), default=latest)
        ready[role] = min(ready.get(role, float("inf")), warm_from + window)
    return ready


def why_unjudged(series: list[dict], *, warm_from: float, settled: list[dict], settings: SoakSettings,
                 until_s: float) -> str:
    """Why a process's memory could not be judged: it never trained, it had no sample after its
    warm-up, or too short a stretch of samples after it."""
    if warm_from == float("inf"):
        return f"it never trained (sampled from t = {series[0]['t']} to {series[-1]['t']} s)"
    warm_end = warm_from + settings.memory_warmup_s
    if not settled:
        return (f"no sample after its warm-up (t >= {warm_end:.1f} s): its last sample while the run trained was at "
                f"t = {series[-1]['t']} s (training ended at {until_s} s)")
    return (f"{len(settled)} samples over {settled[-1]['t'] - settled[0]['t']:.1f} s after its warm-up (t >= "
            f"{warm_end:.1f} s), short of 6 samples over {settings.memory_judged_after_s:g} s")


def retention(samples: list[dict], *, keep: int) -> dict:
    """The bucket's bytes stay bounded: at every sample at most `keep` checkpoints plus one being
    written and one a skip or a killed save left (deleted at the next stored checkpoint or attempt),
    each no bigger than the largest complete one, plus 1 MiB of Ray's and the loop's small files."""
    if not samples:
        return {"samples": 0, "within": False}
    largest = max((max(s["checkpoint_bytes"]) for s in samples if s["checkpoint_bytes"]), default=0)
    bound = (keep + 2) * largest + 2**20
    most = max(s["bytes"] for s in samples)
    return {"samples": len(samples), "max_bytes": most, "bound_bytes": bound, "checkpoint_bytes": largest,
            "max_checkpoint_folders": max(s["checkpoint_folders"] for s in samples),
            "final_checkpoint_folders": samples[-1]["checkpoint_folders"],
            "within": most <= bound and max(s["checkpoint_folders"] for s in samples) <= keep + 2}


def tracked_runs(uri: str, *, run_name: str) -> list:
    """The MLflow runs of the run name (workloads.train.tracking tags each with it)."""
    from mlflow import MlflowClient

    from workloads.train.tracking import RUN_NAME_TAG

    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'")


def tracked_losses(uri: str, *, run_name: str, run_id: str = "") -> dict[int, list[float]]:
    """Every training loss the run's MLflow run holds, by step (a redone step is logged again)."""
    from mlflow import MlflowClient

    if not run_id:
        runs = tracked_runs(uri, run_name=run_name)
        if not runs:
            return {}
        run_id = runs[0].info.run_id
    losses: dict[int, list[float]] = {}
    for metric in MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train_loss"):
        losses.setdefault(metric.step, []).append(metric.value)
    return losses


def mlflow_record(uri: str, *, run_name: str, losses: dict[int, float], steps: int) -> dict:
    """The run's MLflow record: one run of that name, FINISHED, with every step's training loss, each
    value logged (a redone step is logged again) equal to the step's loss."""
    runs = tracked_runs(uri, run_name=run_name)
    if len(runs) != 1:
        return {"runs": len(runs), "within": False}
    run = runs[0]
    tracked = tracked_losses(uri, run_name=run_name, run_id=run.info.run_id)
    wrong = sorted(step for step, values in tracked.items() if step in losses
                   and any(abs(v - losses[step]) > REFERENCE_TOLERANCE * abs(losses[step]) for v in values))
    missing = [s for s in range(1, steps + 1) if s not in tracked]
    return {"runs": 1, "run_id": run.info.run_id, "status": run.info.status,
            "values": sum(len(v) for v in tracked.values()), "steps_logged": len(tracked),
            "missing_steps": missing, "steps_with_another_loss": wrong,
            "within": run.info.status == "FINISHED" and not missing and not wrong}


def judge(soak: FinishedSoak, *, reference: dict[int, float]) -> dict:
    """The checks of a finished soak, added to its record; record["passed"] says whether all passed."""
    record, settings, logs = soak.record, soak.settings, soak.logs
    soak.reference = reference
    losses = completed_losses(logs.lines)
    rows = fault_rows(record, logs, checkpoint_every=settings.checkpoint_every)
    memory = memory_growth(soak.memory, settings=settings, until_s=record["trained_until_s"],
                           attempts_trained_s=record["attempts_trained_s"])
    unplanned = unplanned_restarts(record, logs)
    checks = {
        "run_succeeded": {"exit_code": record["exit_code"], "within": record["exit_code"] == 0},
        "every_fault_brought": {"brought": len(record["faults"]), "planned": settings.faults,
                                "within": len(record["faults"]) == settings.faults},
        "faults_within_allowance": {"beyond": [r for r in rows if not r["within"]],
                                    "within": all(r["within"] for r in rows)},
        "no_unplanned_restart": {"attempts": unplanned, "within": not unplanned},
        "losses_match_uninterrupted": loss_gaps(losses, reference),
        "memory": {"roles": memory, "sampler": record["sampler"],
                   "within": all(r["within"] for r in memory.values()) and record["sampler"]["stopped"] is None
                   and all(memory.get(role, {}).get("judged") for role in JUDGED_ROLES)},
        "retention": retention(soak.storage_samples, keep=settings.keep_checkpoints),
        "mlflow": mlflow_record(soak.tracker.uri, run_name=settings.run_name, losses=losses, steps=settings.steps),
        "no_process_left": {"left": record["processes_left"], "within": not record["processes_left"]},
        "no_shared_memory_left": {"left": record["shared_memory_left"], "within": not record["shared_memory_left"]},
    }
    record.update(fault_table=rows, checks=checks,
                  skipped_checkpoints=len({line.split("[checkpoints] warning: ", 1)[1] for line in logs.lines
                                           if "[checkpoints] warning: " in line}))
    record["passed"] = all(check["within"] for check in checks.values())
    return record


def _failed_memory(check: dict) -> str:
    parts = []
    if (stopped := check["sampler"]["stopped"]) is not None:
        parts.append(f"the memory sampler stopped at t = {stopped['at_s']} s: {stopped['error']} (no sample after "
                     "it: what follows is judged on the samples before)")
    for role, entry in check["roles"].items():
        if not entry["within"]:
            parts.append(f"{role} pid {entry['pid']} grew {entry['max_growth_mib']} MiB after its warm-up")
    for role in JUDGED_ROLES:
        entry = check["roles"].get(role)
        if entry is None:
            parts.append(f"no {role} process was sampled")
        elif not entry["judged"]:
            unjudged = entry["unjudged"]
            parts.append(f"no {role} process was judged (pid {unjudged['pid']}, the one sampled longest after its "
                         f"warm-up: {unjudged['why']})")
    return "; ".join(parts)


def _failed_mlflow(check: dict) -> str:
    if check["runs"] != 1:
        return f"{check['runs']} MLflow runs of the run's name, not 1"
    return (f"run {check['run_id']} {check['status']}, {len(check['missing_steps'])} step(s) without a loss (first: "
            f"{check['missing_steps'][:5]}), {len(check['steps_with_another_loss'])} with another loss than the "
            f"job logged (first: {check['steps_with_another_loss'][:5]})")


FAILED = {
    "run_succeeded": lambda c: f"`python -m workloads submit` exited {c['exit_code']}",
    "every_fault_brought": lambda c: f"{c['brought']} of {c['planned']} faults brought: the run ended first",
    "faults_within_allowance": lambda c: "; ".join(
        f"{r['kind']} after step {r['step']} lost {r['lost']} step(s), resumed from {r['resumed_from']} "
        f"(allowance: {r['allowance']})" for r in c["beyond"]),
    "no_unplanned_restart": lambda c: f"attempts no fault explains (rank 0 pids): {c['attempts']}",
    "losses_match_uninterrupted": lambda c: (
        f"{len(c['missing_steps'])} step(s) never completed (first: {c['missing_steps'][:5]}), largest relative gap "
        f"{c['max_relative_gap']} against the uninterrupted run (allowed: {REFERENCE_TOLERANCE})"),
    "memory": _failed_memory,
    "retention": lambda c: ("no sample of the bucket" if not c["samples"] else
                            f"up to {c['max_bytes']} bytes in {c['max_checkpoint_folders']} checkpoint folders, "
                            f"bound {c['bound_bytes']} bytes"),
    "mlflow": _failed_mlflow,
    "no_process_left": lambda c: "still running: " + ", ".join(f"{p['role']} pid {p['pid']}" for p in c["left"]),
    "no_shared_memory_left": lambda c: "left: " + ", ".join(c["left"]),
}
"""One line per failed check, saying what failed."""


def failed_lines(checks: dict[str, dict]) -> list[str]:
    """`FAILED <check>: <what>` for each check that did not hold."""
    return [f"FAILED {name}: {FAILED[name](check)}" for name, check in checks.items() if not check["within"]]
