"""The local cluster's ports: every `ray start` gets one distinct port per component, also where
the kernel hands a just-freed port out again (which is what it does; a node once failed to start
in a full test run with "metrics_export is trying to use a port number 41929 that is used by other
components", the same port as its dashboard agent's gRPC one)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from workloads.client import cluster, local


class _Kernel:
    """Hands out the lowest port not held by an open socket, as a kernel may for ephemeral ports."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def socket(self) -> "_Socket":
        return _Socket(self)


class _Socket:
    def __init__(self, kernel: _Kernel) -> None:
        self.kernel, self.port = kernel, None

    def bind(self, address: tuple[str, int]) -> None:
        assert address == ("127.0.0.1", 0)
        self.port = min(set(range(40000, 40100)) - self.kernel.held)
        self.kernel.held.add(self.port)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

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
    return kernel


def test_ports_asked_for_one_by_one_can_repeat_and_ports_asked_for_together_cannot(kernel):
    assert cluster.free_port() == cluster.free_port()  # the hazard, as the model of the kernel has it
    ports = cluster.free_ports(5)
    assert len(set(ports)) == 5 and not kernel.held  # all released once chosen
    assert 40000 not in cluster.free_ports(3, besides=(40000,))


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
