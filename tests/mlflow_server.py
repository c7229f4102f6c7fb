"""A real `mlflow server` on 127.0.0.1 for the tracking tests: a sqlite store and a local artifact folder,
in its own process group (its uvicorn worker with it), stopped by that group only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

MLFLOW = Path(sys.executable).with_name("mlflow")


@dataclass
class MlflowServer:
    root: Path
    port: int
    proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def database(self) -> Path:
        return self.root / "mlflow.db"

    def argv(self) -> list[str]:
        return [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.database}",
                "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
                "--port", str(self.port), "--workers", "1"]

    def start(self, *, wait_s: float = 180.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = (self.root / "server.log").open("a")
        # Without its job runner (two more Python processes at every start): the tests run no MLflow job.
        env = {**os.environ, "MLFLOW_TRACKING_URI": "", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        if wait_s:
            self.wait_up(wait_s)

    def wait_up(self, wait_s: float = 180.0) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"mlflow server not up on {self.uri} within {wait_s:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL its process group at once, as a server that goes away does."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def log_tail(self) -> str:
        path = self.root / "server.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-20:]) if path.exists() else ""


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by `pid` (a server started in another process)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
