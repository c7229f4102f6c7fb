"""A run's job logs on the local cluster's head, read as they grow (a soak's view of its run)."""

from __future__ import annotations

import json
from pathlib import Path

from workloads.client.report import WORKER_PID, parse_prefixed, parse_train_line

SESSION_LATEST = "session_latest"
"""Ray's link, in its temp folder, to the newest session's folder (ray_constants.SESSION_LATEST)."""


class JobLogs:
    """The run's job logs as Ray writes them on the head (job-driver-<submission id>.log in each
    session's logs folder; a restarted head starts a new session, and the files of the old one
    stay on this machine's disk), read as they grow. Each training attempt is known by its rank 0's
    process (workloads.client.report.attempts)."""

    def __init__(self, temp_dir: Path, run: str) -> None:
        self.temp_dir, self.run = temp_dir, run
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, str] = {}
        self.lines: list[str] = []
        self.attempt_pids: list[int] = []
        """Rank 0's process of each attempt that trained a step, in order."""
        self.steps: dict[int, list[int]] = {}
        """The steps each attempt (by its pid) logged, in order."""

    def _session_logs(self, pattern: str) -> list[Path]:
        """The files of each head's session that match, never through `session_latest`: that link
        names the newest session, so a file would be read twice (under two paths), and a restarted
        head moves it between a glob and an open (a soak in a full test run failed on that, reading
        job1's log where the new session had none). Known by its name, not by asking whether it is a
        link: every node that starts on this machine removes the link and makes it again (Ray's
        try_to_symlink), and in between it is no link, so a glob that listed it kept it (a soak
        failed on that 45 s in, when a worker node started)."""
        return [path for path in self.temp_dir.glob(f"session_*/logs/{pattern}")
                if path.parent.parent.name != SESSION_LATEST]

    def files(self) -> list[Path]:
        found = self._session_logs(f"job-driver-{self.run}-job*.log")
        return sorted(found, key=lambda p: int(p.stem.rsplit("-job", 1)[1]))

    def read(self) -> None:
        for path in self.files():
            with path.open("rb") as stream:
                stream.seek(self.offsets.get(path, 0))
                chunk = stream.read()
            self.offsets[path] = self.offsets.get(path, 0) + len(chunk)
            *complete, rest = (self.partial.get(path, "") + chunk.decode(errors="replace")).split("\n")
            self.partial[path] = rest
            for line in complete:
                self._add(line)

    def _add(self, line: str) -> None:
        self.lines.append(line)
        record = parse_train_line(line)
        process = WORKER_PID.search(line)
        if record is None or process is None:
            return
        pid = int(process.group(1))
        if pid not in self.steps:
            self.attempt_pids.append(pid)
            self.steps[pid] = []
        if int(record["step"]) not in self.steps[pid]:
            self.steps[pid].append(int(record["step"]))

    def latest_step(self) -> int:
        return self.steps[self.attempt_pids[-1]][-1] if self.attempt_pids else 0

    def last_trained(self, pid: int) -> int:
        """The last step attempt `pid` logged, read from its rank 0's own output file on its node
        (worker-<id>-<job>-<pid>.out in the session's logs), which keeps the lines that the head's
        log monitor had not yet forwarded into the job log when a fault took the head down."""
        found = [int(record["step"]) for path in self._session_logs(f"worker-*-{pid}.out")
                 for line in path.read_text(errors="replace").splitlines()
                 if (record := parse_train_line(line)) is not None]
        return max([*found, *self.steps.get(pid, [0])])

    def records(self, prefix: str) -> list[dict]:
        """The JSON records after `prefix` in the lines, once each (Ray forwards a worker line twice)."""
        seen, found = set(), []
        for line in self.lines:
            record = parse_prefixed(line, prefix)
            key = json.dumps(record, sort_keys=True)
            if record is not None and key not in seen:
                seen.add(key)
                found.append(record)
        return found
