"""Pause points for fault-injection tests: a training process stops at a named moment and waits there,
so that a test can bring its fault (a SIGKILL, a lost node, a restarted head) at exactly that moment
instead of racing the training loop.

Inert unless the environment variable WORKLOADS_PAUSE_PLAN names a file; this module is the one place
that reads it, and no launcher, pod or job environment of this project sets it. When it is set, the file
(JSON, read at every pause point, absent meaning no pause) lists the pauses:

    {"pauses": [{"point": "checkpoint-upload", "run": "save-kill", "step": 4, "rank": 1}]}

A process that reaches a listed point writes a marker beside the plan,
`paused-<run>-<point>-step<step>-rank<rank>.json` ({"pid", "host", ...}: which process to kill), says
so on stdout, and sleeps until it is killed, `max_s` (default 600) has passed, or a release file
beside the marker (`...rank<rank>.release`) exists. Each pause is taken once: once its marker exists,
the point lets every later process through (the resumed run reaches the same step again).

Points: `checkpoint-upload` (a rank has saved its shard of the step's checkpoint locally, and rank 0's
part may already be in storage, but this rank's part is not), `checkpoint-uploaded` (this rank's part
is in storage, but its report has not reached Ray Train's controller, so the checkpoint is not
registered), `after-report` (the step's metrics, and checkpoint if any, are reported and persisted).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Mapping, Optional

from workloads.files import replace_whole

PAUSE_PLAN_ENV = "WORKLOADS_PAUSE_PLAN"
POINTS = ("checkpoint-upload", "checkpoint-uploaded", "after-report")
PAUSE_PREFIX = "[fault-pause] "


@dataclass(frozen=True, kw_only=True)
class Pause:
    point: str
    """Where: one of POINTS."""
    run: str
    """The Ray Train run name (the experiment) it applies to."""
    step: int
    """The training step whose point it is."""
    rank: int
    """The world rank that pauses; the other ranks run on until they wait for it."""
    max_s: float = 600.0
    """How long the process waits to be killed before it goes on."""

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"{PAUSE_PLAN_ENV}: point {self.point!r} is not one of {', '.join(POINTS)}")

    def marker_name(self) -> str:
        return f"paused-{self.run}-{self.point}-step{self.step}-rank{self.rank}.json"

    def release_name(self) -> str:
        """The file that ends the pause early (whoever planned it writes it, before or during it)."""
        return self.marker_name().removesuffix(".json") + ".release"


def write_plan(path: Path, pauses: list[Pause]) -> None:
    """Write the plan whole, in one rename: every rank reads it at each of its points, and a plan
    rewritten in place can be read half-written (an empty file, once, in a soak inside a full test
    run: the rank failed with "not a readable JSON plan" and the run restarted with no fault)."""
    replace_whole(path, json.dumps({"pauses": [asdict(pause) for pause in pauses]}))


def read_plan(path: Path) -> list[Pause]:
    """The pauses a plan file lists; none when the file does not exist. ValueError for a malformed
    plan, naming the variable and the file: a plan that silently paused nothing would make its test
    pass for the wrong reason."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{PAUSE_PLAN_ENV}={path}: not a readable JSON plan: {exc}") from None
    known = {f.name for f in fields(Pause)}
    pauses = []
    for entry in (data or {}).get("pauses", []):
        unknown = set(entry) - known
        if unknown:
            raise ValueError(f"{PAUSE_PLAN_ENV}={path}: unknown key(s) {', '.join(sorted(unknown))} "
                             f"(a pause has {', '.join(sorted(known))})")
        pauses.append(Pause(**entry))
    return pauses


def pause_point(point: str, *, run: str, step: Optional[int], rank: int,
                environ: Mapping[str, str] = os.environ, sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic) -> Optional[Path]:
    """Pause here if the plan lists this point for this run, step and rank and the pause was not
    taken yet; returns its marker when it paused (after `max_s`, or once released), else None at once."""
    plan = environ.get(PAUSE_PLAN_ENV)
    if not plan or step is None:
        return None
    plan_path = Path(plan)
    for pause in read_plan(plan_path):
        if (pause.point, pause.run, pause.step, pause.rank) != (point, run, step, rank):
            continue
        marker = plan_path.parent / pause.marker_name()
        draft = marker.with_name(f".{marker.name}.{os.getpid()}")
        draft.write_text(json.dumps({**asdict(pause), "pid": os.getpid(), "host": socket.gethostname()}))
        try:
            os.link(draft, marker)  # complete or absent, and one process takes the pause
        except FileExistsError:
            return None
        finally:
            draft.unlink()
        print(f"{PAUSE_PREFIX}rank {rank} of run {run} paused at {point} of step {step} (pid {os.getpid()}); "
              f"waiting up to {pause.max_s:.0f} s to be killed", flush=True)
        deadline = clock() + pause.max_s
        release = plan_path.parent / pause.release_name()
        while clock() < deadline and not release.exists():
            sleep(0.2)
        return marker
    return None
