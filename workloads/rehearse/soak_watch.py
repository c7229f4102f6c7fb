"""The run as a soak watches it (workloads/rehearse/soak.py): its job logs read as they grow, on the
soak's clock (seconds from its start), and the user's command while it runs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from workloads.rehearse.job_logs import JobLogs


class RunWatch:
    """The run's job logs (`logs`), read on the soak's clock; when a step last showed, and when each
    attempt first trained."""

    def __init__(self, temp_dir: Path, run: str) -> None:
        self.logs = JobLogs(temp_dir, run)
        self.started = time.monotonic()
        self.last_step_s = 0.0
        """When the job logs last showed a new step: training ended then."""
        self.submitter: Optional[subprocess.Popen] = None
        """The user's command, `python -m workloads submit`, while it runs."""
        self.attempts_trained_s: list[float] = []
        """When each attempt's first step showed in the job logs."""

    def now(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def read(self) -> None:
        """Read what the job logs say since the last read, and note when a new step showed."""
        latest, attempts = self.logs.latest_step(), len(self.logs.attempt_pids)
        self.logs.read()
        if self.logs.latest_step() != latest:
            self.last_step_s = self.now()
        self.attempts_trained_s += [self.now()] * (len(self.logs.attempt_pids) - attempts)

    def read_for(self, seconds: float, *, until: Callable[[], bool] = lambda: False) -> None:
        """Wait `seconds` (or until `until()`), reading the job logs meanwhile: the progress lines
        and the time of the last step come from them."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            self.read()
            time.sleep(0.5)

    def await_step(self, step: int, submitter: subprocess.Popen) -> bool:
        """Wait until the run has logged `step` or later; False when the run ended first."""
        while submitter.poll() is None:
            self.read()
            if self.logs.latest_step() >= step:
                return True
            time.sleep(0.2)
        return False
