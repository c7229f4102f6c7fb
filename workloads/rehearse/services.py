"""Local stand-ins of a run's services, which a rehearsal or a test takes down and brings back:
moto's S3 server for checkpoints, and a real `mlflow server` for tracking.

Both listen on 127.0.0.1 and come back on the port they had, with what they held: moto's buckets
live in this process (the server is a thread of it), and the MLflow server keeps its runs in a
sqlite file. Every Ray process reaches the S3 server through the standard AWS environment
(`s3_environment`, set before the nodes start, as pods inherit theirs).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

MLFLOW = Path(sys.executable).with_name("mlflow")
FAKE_KEY = "testing"
"""moto takes any keys; these are the stand-ins' (and the tests')."""


def s3_environment(endpoint: str) -> dict[str, str]:
    """The standard AWS environment that points S3 clients (boto3, pyarrow) at `endpoint`, with
    fake keys; AWS_PROFILE, AWS_SESSION_TOKEN and AWS_ENDPOINT_URL must be unset beside it."""
    return {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_KEY, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}


UNSET_FOR_S3 = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL")


@dataclass
class S3Server:
    """moto's S3 server on 127.0.0.1:`port`, in a thread of this process."""

    port: int
    server: Optional[object] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self.server is not None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per S3 request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        """Stop answering (connections are refused); the buckets are kept for `start`."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    def client(self):
        """A boto3 S3 client of the server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=FAKE_KEY,
                            aws_secret_access_key=FAKE_KEY, region_name="us-east-1")

    def filesystem(self):
        """pyarrow's S3 filesystem on the server (what Ray Train writes checkpoints through)."""
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(endpoint_override=self.endpoint, access_key=FAKE_KEY, secret_key=FAKE_KEY,
                                       region="us-east-1")


@dataclass
class MlflowServer:
    """A real `mlflow server` with a sqlite store and a local artifact folder under `root`, in its
    own process group (its uvicorn worker with it), stopped by that group only."""

    root: Path
    port: int
    proc: Optional[subprocess.Popen] = None

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
        # Without its job runner (two more Python processes at every start): nothing here runs an MLflow job.
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
        kill_group(self.proc.pid)
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
