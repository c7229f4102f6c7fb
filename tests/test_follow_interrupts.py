"""Ctrl-C or SIGTERM while `logs --follow` or `submit` follows a job: the reattach hint and nothing else
(no traceback of the log stream's async generator, its aiohttp session or its event loop), exit 130
for Ctrl-C and 143 (128 + 15) for SIGTERM.

The cluster is a Jobs API on 127.0.0.1 that answers as Ray's does where these commands ask: its
version, the job's details and the jobs' list, and the job's log as a WebSocket that sends a line and
then stays open, as a running job's does. The client is Ray's own JobSubmissionClient, whose
`tail_job_logs` is an async generator over an aiohttp session."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from interrupts import sigint_at_default

JOB_ID, RUN_NAME = "r1-job1", "r1"
FIRST_LINE = "a line of the job"
NOISE = ("Traceback", "Exception ignored", "Unclosed client session", "Event loop is closed", "aclose()",
         "Task was destroyed")


class JobsApi:
    """The Jobs API of a cluster running one job (JOB_ID of run RUN_NAME), on its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.address = ""
        self._runner = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self.ready.wait(30), "the Jobs API did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        from aiohttp import web

        self._stop = asyncio.Event()
        job = {"type": "SUBMISSION", "job_id": "02000000", "submission_id": JOB_ID, "status": "RUNNING",
               "entrypoint": "python -m workloads.launch.driver", "metadata": {"run_name": RUN_NAME},
               "start_time": 1}

        async def version(request):
            return web.json_response({"version": "4", "ray_version": "2.58.0", "ray_commit": "x",
                                      "session_name": "s"})

        async def jobs(request):
            return web.json_response([job])

        async def one_job(request):
            return web.json_response(job)

        async def tail(request):
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            await ws.send_str(f"{FIRST_LINE}\n")
            await self._stop.wait()  # a running job's log stays open
            return ws

        app = web.Application()
        app.router.add_get("/api/version", version)
        app.router.add_get("/api/jobs/", jobs)
        app.router.add_get("/api/jobs/{job_id}", one_job)
        app.router.add_get("/api/jobs/{job_id}/logs/tail", tail)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.address = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def jobs_api():
    api = JobsApi()
    yield api
    api.close()


def _follow_and_interrupt(argv: list[str], *, sig: signal.Signals, repo_root: Path) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "workloads", *argv], cwd=repo_root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=sigint_at_default)
    seen = []
    stuck = threading.Timer(120, proc.kill)  # a command that never follows fails the test, not the suite
    stuck.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if FIRST_LINE in line:
                break
        else:
            raise AssertionError(f"the command ended before following the job:\n{''.join(seen)}")
        proc.send_signal(sig)
        rest = proc.communicate(timeout=60)[0]
    finally:
        stuck.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(seen) + rest


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("command", ["logs", "submit"])
def test_an_interrupted_follow_says_how_to_reattach_and_nothing_else(command, sig, jobs_api, repo_root, tmp_path):
    target = ["--address", jobs_api.address]
    argv = (["logs", JOB_ID, "--follow", *target] if command == "logs" else
            ["submit", *target, "--preset", "demo-cpu", "--run-name", RUN_NAME, "--storage-path", str(tmp_path),
             "--verbose"])
    code, out = _follow_and_interrupt(argv, sig=sig, repo_root=repo_root)
    assert code == 128 + sig, out
    assert f"reattach: python -m workloads logs --follow {JOB_ID} --address {jobs_api.address}" in out
    assert [noise for noise in NOISE if noise in out] == [], out
