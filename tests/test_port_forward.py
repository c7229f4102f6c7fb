"""The Ray token goes only to the `kubectl port-forward` the client started, never to a listener of
another process: any account of the machine may listen on a free port of 127.0.0.1 (issue 50).

The stack path runs with `pulumi` and `kubectl` replaced by scripts that answer like them
(tests/fake_cluster_tools.py), the port-forward relaying to a stand-in of the head's Jobs API that
keeps the Authorization header of each request. Another process listens where the token could go
astray, and the tests assert on what it received."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time

import pytest
import requests
from fake_cluster_tools import ForeignListener, install_fake_tools

from workloads.client import cluster, submit
from workloads.client.socket_owners import holds_listener

TOKEN = "f" * 64


class _JobsApi(http.server.BaseHTTPRequestHandler):
    """What `list` asks the head's Jobs API: its version, and the jobs (none)."""

    answers = {"/api/version": {"ray_version": "2.58.0", "version": "4", "ray_commit": "0"}, "/api/jobs/": []}
    tokens: list[str]

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.tokens.append(self.headers.get("Authorization", ""))
        body = json.dumps(self.answers.get(self.path, {})).encode()
        self.send_response(200 if self.path in self.answers else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def head():
    """The head's Jobs API; `.tokens` holds the Authorization header of each request it had."""
    handler = type("JobsApi", (_JobsApi,), {"tokens": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.tokens = handler.tokens
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def stack(head, tmp_path, monkeypatch):
    install_fake_tools(tmp_path, monkeypatch, token=TOKEN, dashboard_port=head.server_port)
    return tmp_path


@pytest.fixture
def other_process(tmp_path):
    """Starts listeners of another process: other_process(port) -> ForeignListener."""
    started: list[ForeignListener] = []

    def listen(port: int) -> ForeignListener:
        started.append(ForeignListener(port, record=tmp_path / f"received-{port}"))
        return started[-1]

    yield listen
    for listener in started:
        listener.stop()


def _lines(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_the_token_goes_to_the_port_kubectl_listens_on_not_to_one_another_process_took_first(
        stack, head, other_process, monkeypatch, capsys):
    """A port chosen free and released before kubectl binds it (free_port, then `kubectl port-forward
    PORT:8265`) can be taken in between by another account, and a wait that any listener satisfies
    then sends the token there. Here the other process holds the port such a choice gives, and kubectl
    binds late: the client must reach the port kubectl itself listens on."""
    taken = other_process(cluster.free_port())
    monkeypatch.setattr(cluster, "free_port", lambda: taken.port)
    monkeypatch.setenv("FAKE_BIND_DELAY_S", "1")
    code = submit.main("list", ["--stack", "us-west-2"])
    err = capsys.readouterr().err
    assert TOKEN.encode() not in taken.received()
    assert code == 0, err
    assert head.tokens and set(head.tokens) == {f"Bearer {TOKEN}"}
    forwarded = [int(port) for port in _lines(stack / "ports")]
    assert len(forwarded) == 1 and forwarded[0] != taken.port


def test_a_port_that_kubectl_names_but_another_process_holds_gets_no_token(stack, head, other_process,
                                                                         monkeypatch, capsys):
    """kubectl's own line is not taken on trust: the client sends nothing to a port unless the
    kubectl it started is the process listening there."""
    taken = other_process(cluster.free_port())
    monkeypatch.setenv("FAKE_SAYS_PORT", str(taken.port))
    assert submit.main("list", ["--stack", "us-west-2"]) == submit.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert taken.received() == b"" and head.tokens == []
    assert (f"kubectl port-forward to svc/ray-head-svc:8265 says it listens on 127.0.0.1:{taken.port}, but no "
            "socket of it does: another process holds the port; nothing was sent there") in err
    assert err.count("\n") == 1
    pid = int(_lines(stack / "pids")[0])
    assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)  # that kubectl was stopped


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_after_a_port_forward_drops_no_request_reaches_whoever_listens_on_its_port(stack, head, other_process):
    """kubectl exits when its connection to the pod breaks, and its port is then anyone's: a client
    made before the drop must not send its next request there. A new client restores the forward
    (what following a job does after a drop) and reaches the head again."""
    with cluster.connect(stack="us-west-2", address=None, token=None) as conn:
        client = cluster.job_client(conn, address=conn.current_address())
        assert client.list_jobs() == []
        pid, port = int(_lines(stack / "pids")[0]), int(_lines(stack / "ports")[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _is_zombie(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        taken = other_process(port)  # the dropped forward's port, taken as soon as it was free
        with pytest.raises(requests.exceptions.ConnectionError):
            client.list_jobs()
        assert taken.received() == b""
        again = cluster.job_client(conn, address=conn.current_address())
        assert again.list_jobs() == []
    assert taken.received() == b""
    assert len(_lines(stack / "pids")) == 2  # the forward was restored
    assert set(head.tokens) == {f"Bearer {TOKEN}"}


def test_a_port_kubectl_no_longer_listens_on_while_it_runs_gets_no_token(stack, head, other_process, monkeypatch,
                                                                       caplog):
    """Each connection is passed on once its other end is seen to be kubectl's socket, not because
    kubectl still runs: a port kubectl has stopped listening on is anyone's."""
    monkeypatch.setattr(cluster, "ACCEPT_TIMEOUT_S", 1.0)
    with cluster.connect(stack="us-west-2", address=None, token=None) as conn:
        client = cluster.job_client(conn, address=conn.current_address())
        assert client.list_jobs() == []
        pid, port = int(_lines(stack / "pids")[0]), int(_lines(stack / "ports")[0])
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while holds_listener([pid], port=port) and time.monotonic() < deadline:
            time.sleep(0.05)
        taken = other_process(port)
        with pytest.raises(requests.exceptions.ConnectionError):
            client.list_jobs()
        assert taken.received() == b""
    assert f"a connection to 127.0.0.1:{port}, kubectl's port-forward, did not reach kubectl" in caplog.text
    assert set(head.tokens) == {f"Bearer {TOKEN}"}
