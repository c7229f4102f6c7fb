"""Idle to zero, the Ray side, rehearsed with Ray's own autoscaler (v2) on a local cluster that starts
with no worker node: a submission makes the autoscaler start two worker nodes, the job trains the
demo's model on them and passes the post-run checks, and once the nodes have been idle for the idle
time the autoscaler removes them; every process of the cluster is stopped at the end, and only its
own. The provider's process-group handling is checked on plain processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from workloads.rehearse.idle_rehearsal import DEMO_WORKERS, format_result, passed, rehearse
from workloads.local.autoscaling import (AutoscalingSpec, LocalNodeProvider, autoscaling_config,
                                         group_is_ours, stop_process_group)


def _cmdlines() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return found


@pytest.mark.slow
def test_a_cluster_at_zero_grows_for_a_job_trains_and_shrinks_back_after_the_idle_time(tmp_path):
    idle_s = 15.0
    result = rehearse(out=tmp_path, idle_s=idle_s, steps=4, say=lambda message: None)
    print(format_result(result))
    assert result.workers_at_start == 0
    assert result.status == "SUCCEEDED" and result.exit_code == 0
    assert result.most_workers == DEMO_WORKERS
    assert "placement check passed: 2 ranks trained on 2 node(s), as planned" in result.checks
    assert result.workers_at_end == 0
    assert passed(result) and result.watcher["stopped"] is None and result.watcher["passes"] > 10
    events = [what for _, what in result.events]
    assert events.index("worker nodes: 2") < events.index("first training step") < events.index("job SUCCEEDED")
    # The nodes go once idle for the idle time, not before, and not long after.
    assert idle_s <= result.training_to_idle_s <= idle_s + 60
    assert result.idle_to_training_s < 240
    marker = f"127.0.0.1:{result.gcs_port}"
    deadline = time.monotonic() + 10
    while any(marker in line for line in _cmdlines()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [line for line in _cmdlines() if marker in line]


def test_a_node_group_is_signalled_only_while_it_holds_a_process_of_this_cluster():
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--address=127.0.0.1:1"],
                            start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert group_is_ours(ours.pid, "127.0.0.1:1") and not group_is_ours(other.pid, "127.0.0.1:1")
        stop_process_group(other.pid, grace_s=1, marker="127.0.0.1:1")
        stop_process_group(ours.pid, grace_s=1, marker="127.0.0.1:1")
        assert ours.wait(timeout=10) != 0
        assert other.poll() is None  # not this cluster's: left alone
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_the_provider_lists_the_head_and_forgets_nodes_that_exited(tmp_path):
    config = {"state_dir": str(tmp_path), "gcs_port": 1, "dashboard_port": 2, "temp_dir": str(tmp_path)}
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    dead.wait()
    (tmp_path / "nodes.json").write_text(
        '{"local-worker-3": {"ip": "127.0.0.2", "pid": %d, "started": 0, "tags": {"ray-node-type": "worker"}}}'
        % dead.pid)
    provider = LocalNodeProvider(config, "c")
    assert provider.non_terminated_nodes({}) == ["local-head"]
    assert provider.node_tags("local-head")["ray-node-type"] == "head"
    assert provider.internal_ip("local-head") == "127.0.0.1"
    assert (tmp_path / "nodes.json").read_text().strip() == "{}"
    assert provider._next == 4  # node IDs are never reused


def test_the_autoscaler_config_starts_with_no_worker_and_at_most_the_group(tmp_path):
    from workloads.local.run import LocalClusterSpec, LocalNodes

    nodes = LocalNodes(LocalClusterSpec(nodes=1), token="t", log_dir=tmp_path, temp_dir=tmp_path)
    config = autoscaling_config(AutoscalingSpec(max_nodes=2, idle_timeout_s=30), nodes=nodes, state_dir=tmp_path)
    worker = config["available_node_types"]["worker"]
    assert (worker["min_workers"], worker["max_workers"], config["max_workers"]) == (0, 2, 2)
    assert config["available_node_types"]["ray.head.default"]["resources"] == {"CPU": 0}
    assert config["idle_timeout_minutes"] == 0.5
    assert config["provider"]["module"] == "workloads.local.autoscaling.LocalNodeProvider"
