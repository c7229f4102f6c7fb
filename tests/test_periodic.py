"""Samplers and watchers that never die silently (workloads/periodic.py), the soak's sampler among
them, and the local cluster's process listing while a fault takes nodes out and puts them back on
another thread (the KeyError that ended the soak's sampler at its first fault)."""

from __future__ import annotations

import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from workloads.rehearse import soak as soak_module
from workloads.rehearse.cluster_processes import Process, cluster_processes
from workloads.rehearse.soak import Soak
from workloads.rehearse.soak_plan import SoakSettings
from workloads.local import run as local
from workloads.local.run import LocalClusterSpec, LocalNodes
from workloads.periodic import Periodic


def _wait(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failed_pass_is_kept_with_its_traceback_and_the_next_pass_runs():
    calls, said = [], []

    def one_pass() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise KeyError(2)

    with Periodic(one_pass, every_s=0.001, name="test", clock=lambda: 4.5, on_error=said.append) as periodic:
        _wait(lambda: periodic.passes >= 5)
    assert periodic.error_count == 1 and periodic.stopped is None
    error = periodic.errors[0]
    assert (error.at_s, error.error) == (4.5, "KeyError: 2") and "in one_pass" in error.traceback
    assert said == [error]
    record = periodic.record()
    assert record["error_count"] == 1 and record["stopped"] is None and record["passes"] >= 5


def test_errors_beyond_those_kept_are_counted():
    def always() -> None:
        raise OSError("gone")

    with Periodic(always, every_s=0.0, name="test", clock=lambda: 0.0, keep_errors=3) as periodic:
        _wait(lambda: periodic.error_count >= 10)
    assert len(periodic.errors) == 3 and periodic.error_count >= 10 and periodic.stopped is None


def test_a_thread_that_ends_on_its_own_says_when_and_why(monkeypatch):
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's own report of it

    def ends() -> None:
        raise SystemExit(3)

    periodic = Periodic(ends, every_s=0.0, name="test", clock=lambda: 7.0).start()
    _wait(lambda: periodic.stopped is not None)
    assert periodic.record()["stopped"]["at_s"] == 7.0 and periodic.stopped.error == "SystemExit: 3"
    periodic.stop()


@pytest.fixture
def nodes(tmp_path):
    """A LocalNodes whose three nodes are `sleep` processes (no Ray), each with a child."""
    nodes = LocalNodes(LocalClusterSpec(nodes=2, cpus_per_node=1), token="t", log_dir=tmp_path, temp_dir=tmp_path)
    for index in range(3):
        nodes.procs[index] = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    _wait(lambda: all(len(nodes.pids(index)) == 2 for index in range(3)))
    yield nodes
    for proc in nodes.procs.values():
        subprocess.run(["pkill", "-KILL", "-g", str(proc.pid)], check=False)
        proc.wait()


def test_listing_the_processes_while_a_drain_takes_a_node_out_lists_it_as_it_was(nodes, monkeypatch):
    """The soak drains a node by taking it out of `procs` on its own thread; the sampler reads the
    nodes meanwhile. A node that leaves while the listing reads /proc is listed whole from the
    copy the listing began with (its processes still run: they drain), not a KeyError."""
    drained = {}
    descendants = local._descendants

    def draining(root, *args, **kwargs):
        if not drained:
            drained["proc"] = nodes.procs.pop(2)  # the drain, between the listing's start and its end
        return descendants(root, *args, **kwargs)

    monkeypatch.setattr(local, "_descendants", draining)
    listed = cluster_processes(nodes)
    assert {process.node for process in listed} == {0, 1, 2} and len(listed) == 6
    nodes.procs[2] = drained["proc"]


def test_listing_the_processes_holds_while_nodes_leave_and_come_back_on_another_thread(nodes):
    stop, errors = threading.Event(), []

    def churn() -> None:
        while not stop.is_set():
            proc = nodes.procs.pop(2)
            time.sleep(0.002)
            nodes.procs[2] = proc
            time.sleep(0.002)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        for _ in range(100):
            try:
                listed = cluster_processes(nodes)
            except Exception as exc:  # noqa: BLE001 - the failure this test is about
                errors.append(exc)
                break
            assert {process.node for process in listed} <= {0, 1, 2}
            assert nodes.node_of(nodes.procs.get(0, SimpleNamespace(pid=0)).pid) in (0, None)
    finally:
        stop.set()
        churner.join()
    assert not errors


def _soak(tmp_path, said: list[str]) -> Soak:
    cluster = SimpleNamespace(temp_dir=tmp_path, nodes=None)
    storage = SimpleNamespace(client=lambda: None, up=False)
    settings = SoakSettings(steps=100, faults=1, seed=1, sample_every_s=0.001, progress_every_s=1e9)
    return Soak(cluster, storage=storage, bucket="b", tracker=None, plan=tmp_path / "plan.json", out=tmp_path,
                settings=settings, say=said.append)


def test_a_sampler_whose_process_listing_raises_once_mid_run_keeps_sampling(tmp_path, monkeypatch):
    listings = []

    def listing(nodes) -> list[Process]:
        listings.append(len(listings))
        if len(listings) == 3:
            raise KeyError(2)  # as a node taken out of the cluster mid-listing did
        return [Process(pid=10, role="driver", node=0, rss_mib=100.0, started=1)]

    monkeypatch.setattr(soak_module, "cluster_processes", listing)
    said: list[str] = []
    soak = _soak(tmp_path, said)
    with soak.sampler() as sampler:
        _wait(lambda: len(soak.memory) >= 10)
    assert sampler.stopped is None and sampler.error_count == 1
    assert len(soak.memory) >= 10  # sampled on after the failed pass
    assert sampler.errors[0].error == "KeyError: 2" and "listing" in sampler.errors[0].traceback
    assert any("warning: the sampler's pass at t = " in line and "failed (KeyError: 2); the next one runs" in line
               for line in said)


def test_a_rehearsal_thread_that_fails_leaves_its_error_in_the_record():
    from workloads.rehearse.rehearsal import _started

    record: dict = {}

    def restart() -> None:
        raise RuntimeError("Ray node 2 did not start")

    _started(restart, record=record, name="restart").join()
    assert record["restart_error"]["error"] == "RuntimeError: Ray node 2 did not start"
    assert "in restart" in record["restart_error"]["traceback"]
