"""The local cluster's ports: every `ray start` gets one distinct port per component, also where
the kernel hands a just-freed port out again (which is what it does; a node once failed to start
in a full test run with "metrics_export is trying to use a port number 41929 that is used by other
components", the same port as its dashboard agent's gRPC one), and none from the kernel's ephemeral
range, which it hands out by itself (a worker node's runtime-env agent once failed with "Address
already in use" in a full test run: its port, chosen free, was taken before the agent bound it)."""

from __future__ import annotations

import contextlib
import errno
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_cluster_tools import HTTP_401, ForeignListener

from workloads.client import cluster
from workloads.local import run as local

FLOOR = 32768
"""The model kernel's ephemeral range starts here (Linux's default)."""


class _Kernel:
    """Ports held by open sockets, and ports some other process listens on."""

    def __init__(self, taken: set[int] = frozenset()) -> None:
        self.held: set[int] = set()
        self.taken = set(taken)

    def socket(self) -> "_Socket":
        return _Socket(self)


class _Socket:
    def __init__(self, kernel: _Kernel) -> None:
        self.kernel, self.port = kernel, None

    def bind(self, address: tuple[str, int]) -> None:
        host, port = address
        assert host == "" and cluster.PORT_FLOOR <= port  # every interface, a port named
        if port in self.kernel.held or port in self.kernel.taken:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        self.port = port
        self.kernel.held.add(port)

    def close(self) -> None:
        self.kernel.held.discard(self.port)

    def __enter__(self) -> "_Socket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def kernel(monkeypatch) -> _Kernel:
    kernel = _Kernel()
    monkeypatch.setattr(cluster, "socket", SimpleNamespace(socket=kernel.socket))
    monkeypatch.setattr(cluster, "ephemeral_floor", lambda: FLOOR)
    return kernel


def test_ports_are_distinct_free_below_the_ephemeral_range_and_released_once_chosen(kernel):
    kernel.taken = set(range(cluster.PORT_FLOOR, FLOOR, 2))  # every other port listened on elsewhere
    ports = cluster.free_ports(50, besides=(cluster.PORT_FLOOR + 1,))
    assert len(set(ports)) == 50 and not kernel.held
    assert all(cluster.PORT_FLOOR <= p < FLOOR and p not in kernel.taken for p in ports)
    assert cluster.PORT_FLOOR + 1 not in ports


def test_a_range_too_full_is_an_error_that_says_so(kernel):
    kernel.taken = set(range(cluster.PORT_FLOOR, FLOOR - 3))
    assert sorted(cluster.free_ports(3)) == [FLOOR - 3, FLOOR - 2, FLOOR - 1]
    range_ = f"{cluster.PORT_FLOOR}-{FLOOR - 1}"
    with pytest.raises(RuntimeError, match=f"only 3 of the 4 ports asked for are free in {range_}"):
        cluster.free_ports(4)


def test_where_the_ephemeral_range_starts_low_any_port_above_the_floor_will_do(kernel, monkeypatch):
    monkeypatch.setattr(cluster, "ephemeral_floor", lambda: 1024)
    assert all(cluster.PORT_FLOOR <= p < 65536 for p in cluster.free_ports(20))


def test_the_ephemeral_range_is_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "EPHEMERAL_RANGE", tmp_path / "ip_local_port_range")
    (tmp_path / "ip_local_port_range").write_text("40000\t60999\n")
    assert cluster.ephemeral_floor() == 40000
    (tmp_path / "ip_local_port_range").unlink()  # not Linux
    assert cluster.ephemeral_floor() == 32768


@pytest.mark.parametrize("index", [0, 1])
def test_every_component_of_a_node_gets_its_own_port(kernel, index):
    gcs_port, dashboard_port = cluster.free_ports(2)
    argv = local._node_argv(index=index, gcs_port=gcs_port, dashboard_port=dashboard_port,
                            temp_dir=Path("/tmp/ray"), cpus=1)
    ports = [int(m) for arg in argv for m in re.findall(r"^--[\w-]*port=(\d+)$", arg)]
    ports += [int(arg.rsplit(":", 1)[1]) for arg in argv if arg.startswith("--address=")]
    assert len(ports) == (7 if index == 0 else 5), argv  # head: 4 agents, GCS, dashboard, client
    assert len(set(ports)) == len(ports), argv
    assert gcs_port in ports


def test_the_jobs_api_is_on_loopback_every_node_is_token_guarded_and_no_node_exports_metrics(kernel):
    gcs_port, dashboard_port = cluster.free_ports(2)
    argvs = [local._node_argv(index=i, gcs_port=gcs_port, dashboard_port=dashboard_port,
                              temp_dir=Path("/tmp/ray"), cpus=1) for i in (0, 1, 2)]
    # The Jobs API (which runs any code it is sent) on the head's loopback only; each node advertises
    # a loopback address of its own (Ray binds the head's agents to loopback because it is 127.0.0.1).
    assert "--dashboard-host=127.0.0.1" in argvs[0]
    assert [next(a for a in argv if a.startswith("--node-ip-address=")) for argv in argvs] == [
        "--node-ip-address=127.0.0.1", "--node-ip-address=127.0.0.2", "--node-ip-address=127.0.0.3"]
    env = local._node_env("t" * 32)
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN"]) == ("token", "t" * 32)
    # Ray's Prometheus exporter answers without the token, on every interface of a node that is not
    # 127.0.0.1 itself: the local nodes run without it.
    assert env["RAY_enable_metrics_collection"] == "0"


# --- the ports the client sends the token to are its own head's --------------------------------------

FAKE_RAY_START = """
import http.server, sys, threading, time
options = dict(arg[2:].split("=", 1) for arg in sys.argv[1:] if arg.startswith("--") and "=" in arg)

class Unauthorized(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(401)
        self.end_headers()

    def log_message(self, *args):
        pass

def serve(host, port):
    try:
        server = http.server.ThreadingHTTPServer((host, int(port)), Unauthorized)
    except OSError:
        return  # taken: this head comes up without it
    threading.Thread(target=server.serve_forever, daemon=True).start()

if "--head" in sys.argv:
    serve("0.0.0.0", options["port"])  # the GCS
    serve("127.0.0.1", options["dashboard-port"])
    serve("127.0.0.1", options["dashboard-agent-listen-port"])
print("Ray runtime started.", flush=True)
time.sleep(600)
"""
"""`ray start` with the real options, listening on the head's GCS, dashboard and agent ports where it
can, and answering HTTP as a head answers a request without the token."""


@pytest.fixture
def fake_ray_start(monkeypatch, tmp_path):
    """Nodes started by FAKE_RAY_START; `taken_by_other` names the head's ports another process
    takes first (as another account of the machine may, between their choice and the head's bind)."""
    taken_by_other: list[str] = []
    listeners: list[ForeignListener] = []
    node_argv = local._node_argv

    def fake_node_argv(**kw):
        argv = node_argv(**kw)
        if kw["index"] == 0:
            for name in taken_by_other:
                listeners.append(ForeignListener(kw[name], record=tmp_path / f"{name}.received", answer=HTTP_401))
        return [sys.executable, "-c", FAKE_RAY_START, *argv[2:]]

    monkeypatch.setattr(local, "_node_argv", fake_node_argv)
    yield SimpleNamespace(taken_by_other=taken_by_other, listeners=listeners)
    for listener in listeners:
        listener.stop()


def test_a_head_whose_jobs_api_port_another_process_holds_is_refused_before_the_token_goes_there(
        fake_ray_start, tmp_path):
    """Ray 2.58 fails a head whose dashboard port is taken, but the client does not rest on that (a
    head left to choose its port takes the next free one): it sends the token only to a port that a
    process of its head listens on, whatever answers there."""
    fake_ray_start.taken_by_other.append("dashboard_port")
    spec = local.LocalClusterSpec(nodes=1, start_timeout_s=20)
    refused = None
    try:
        with local.local_ray_cluster(spec, log_dir=tmp_path / "ray") as ray:
            with cluster.connect(stack=None, address=ray.address, token=ray.token) as conn:
                with contextlib.suppress(Exception):  # whatever the client makes of the answer
                    cluster.job_client(conn)
    except RuntimeError as exc:
        refused = str(exc)
    other = fake_ray_start.listeners[0]
    assert b"authorization" not in other.received().lower()
    assert refused == (f"the Ray head's dashboard (Jobs API) port 127.0.0.1:{other.port} is held by another "
                       "process, not by the head: the Ray token is not sent there")


def test_a_head_that_holds_its_ports_is_up(fake_ray_start, tmp_path):
    spec = local.LocalClusterSpec(nodes=1, start_timeout_s=20)
    with local.local_ray_cluster(spec, log_dir=tmp_path / "ray") as ray:
        assert ray.address == f"http://127.0.0.1:{ray.nodes.dashboard_port}"
