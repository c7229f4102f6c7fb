"""The job driver's pure parts: worker sizing from cluster resources, its arguments, its failure line."""

from __future__ import annotations

import json

import pytest
from fake_clock import FakeClock
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from workloads.launch.driver import (
    GpusMissingError,
    WorkerPlan,
    failure_reason,
    node_resources,
    parse_args,
    parse_driver_line,
    plan_workers,
    training_failed_errors,
    wait_for_gpus,
)


def eks_nodes(*, gpu_nodes: int = 2, head_cpus: float = 0.0) -> list[dict]:
    """`ray.nodes()` of the stack's RayCluster: a GPU-less head (num-gpus 0, num-cpus 0) on the
    system node and g6.12xlarge workers (4 L4s, 45 CPUs of a 48-vCPU node's pod)."""
    head = {"Alive": True, "NodeManagerHostname": "ray-train-head",
            "Resources": {"CPU": head_cpus, "memory": 8e9, "node:10.0.0.10": 1.0, "node:__internal_head__": 1.0}}
    workers = [{"Alive": True, "NodeManagerHostname": f"ray-train-gpu-worker-{i}",
                "Resources": {"CPU": 45.0, "GPU": 4.0, "memory": 1.5e11, f"node:10.0.1.{i}": 1.0}}
               for i in range(gpu_nodes)]
    dead = {"Alive": False, "Resources": {"CPU": 45.0, "GPU": 4.0}}
    return [head, *workers, dead]


def test_the_plan_counts_the_gpu_nodes_not_the_head():
    """The head joins with no GPU: a plan of 3 nodes would make the post-run check expect a third
    host in the NCCL logs and fail every successful run."""
    plan = plan_workers(node_resources(eks_nodes()))
    assert plan == WorkerPlan(num_workers=8, use_gpu=True, cpus_per_worker=11.0, nodes=2)
    # A head that offers CPUs still hosts no GPU worker.
    assert plan_workers(node_resources(eks_nodes(head_cpus=3.0))).nodes == 2


def test_gpu_workers_share_their_nodes_cpus_unless_told():
    """Ray sets OMP_NUM_THREADS to a worker's CPUs: 1 would starve the host side of every rank."""
    assert plan_workers([{"CPU": 45.0, "GPU": 4.0}, {"CPU": 30.0, "GPU": 4.0}]).cpus_per_worker == 7.0
    assert plan_workers([{"CPU": 2.0, "GPU": 4.0}]).cpus_per_worker == 0.5
    assert plan_workers([{"CPU": 45.0, "GPU": 4.0}], cpus_per_worker=4).cpus_per_worker == 4
    with pytest.raises(ValueError, match="lower --cpus-per-worker"):
        plan_workers([{"CPU": 8.0, "GPU": 4.0}], cpus_per_worker=4)


def test_cpu_workers_fill_the_cpu_slots_of_the_nodes_that_have_them():
    local = [{"CPU": 0.0, "memory": 1e9}, {"CPU": 1.0}, {"CPU": 1.0}]  # the local demo's head and workers
    assert plan_workers(local) == WorkerPlan(num_workers=2, use_gpu=False, cpus_per_worker=1.0, nodes=2)
    assert plan_workers([{"CPU": 7.0}], cpus_per_worker=2).num_workers == 3
    assert plan_workers([{"CPU": 6.0, "GPU": 0.0}], cpus_per_worker=1.5).num_workers == 4
    assert plan_workers([{"CPU": 1.0}, {"CPU": 0.5}]).nodes == 1


def test_a_cluster_without_room_for_one_worker_is_a_clear_error():
    with pytest.raises(ValueError, match="no GPU and 0.5 CPUs"):
        plan_workers([{"CPU": 0.5}])
    with pytest.raises(ValueError, match="positive"):
        plan_workers([{"CPU": 4.0}], cpus_per_worker=0)


def test_the_driver_waits_for_the_gpus_it_expects_with_a_countdown():
    """GPU pods that have not registered yet must not turn into CPU workers on the head."""
    clock, said = FakeClock(), []
    arrivals = {0.0: eks_nodes(gpu_nodes=0), 20.0: eks_nodes(gpu_nodes=1), 40.0: eks_nodes(gpu_nodes=2)}
    read = lambda: node_resources(arrivals[max(t for t in arrivals if t <= clock.now)])  # noqa: E731
    nodes = wait_for_gpus(8, read_nodes=read, timeout_s=600, say=said.append, poll_s=5, every_s=15,
                          clock=clock, sleep=clock.sleep)
    assert plan_workers(nodes).num_workers == 8 and clock.now == 40.0
    assert said == ["waiting for 8 GPU(s): 0 registered; 600 s left", "waiting for 8 GPU(s): 0 registered; 585 s left",
                    "waiting for 8 GPU(s): 4 registered; 570 s left"]


def test_missing_gpus_fail_after_the_timeout_and_never_downgrade():
    clock = FakeClock()
    with pytest.raises(GpusMissingError, match=r"4 of 8 GPU\(s\) registered .* within 60 s \(1 GPU node"):
        wait_for_gpus(8, read_nodes=lambda: node_resources(eks_nodes(gpu_nodes=1)), timeout_s=60,
                      say=lambda _: None, clock=clock, sleep=clock.sleep)
    # An unknown count (0) still needs one GPU: a GPU job never starts on CPUs alone.
    with pytest.raises(GpusMissingError, match="0 of 1 GPU"):
        wait_for_gpus(0, read_nodes=lambda: node_resources(eks_nodes(gpu_nodes=0)), timeout_s=10,
                      say=lambda _: None, clock=clock, sleep=clock.sleep)


def test_an_efa_job_requires_gpus_and_a_cpu_job_does_not():
    base = ["--run-name", "r", "--storage-path", "/tmp/x"]
    assert parse_args([*base, "--config-json", '{"transport": {"expect": "efa"}}']).require_gpus
    assert parse_args([*base, "--config-json", '{"transport": {"expect": "any"}}', "--gpus", "8"]).require_gpus
    assert not parse_args([*base, "--config-json", '{"transport": {"expect": "any"}}']).require_gpus


def test_both_ray_train_failure_types_are_caught():
    from ray.train.base_trainer import TrainingFailedError as V1Error
    from ray.train.v2.api.exceptions import TrainingFailedError as V2Error

    caught = training_failed_errors()
    assert issubclass(V1Error, caught) and issubclass(V2Error, caught)
    try:
        try:
            raise RuntimeError("Traceback ...\nValueError: bad shard")
        except RuntimeError as inner:
            raise V1Error("Training failed") from inner
    except caught as exc:
        assert failure_reason(exc) == "ValueError: bad shard"


def test_arguments_are_validated_with_the_bad_value_named():
    args = parse_args(["--config-json", '{"steps": 3}', "--run-name", "r", "--storage-path", "s3://b/p"])
    assert (args.train, args.run_name, args.storage_path, args.max_failures) == ({"steps": 3}, "r", "s3://b/p", 1)
    base = ["--run-name", "r"]
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_args([*base, "--config-json", "{steps", "--storage-path", "/tmp/x"])
    with pytest.raises(ValueError, match="JSON object"):
        parse_args([*base, "--config-json", "[1]", "--storage-path", "/tmp/x"])
    with pytest.raises(ValueError, match="'runs' must be a URI"):
        parse_args([*base, "--config-json", "{}", "--storage-path", "runs"])
    with pytest.raises(ValueError, match="--max-failures"):
        parse_args([*base, "--config-json", "{}", "--storage-path", "/tmp/x", "--max-failures", "-1"])


def test_the_failure_line_names_each_failing_rank_and_its_error():
    """Ray Train V2 hands the ranks' own exceptions; a MemoryError has no message, and the line used to
    end at `rank 0:` (the rest was only in the job's log)."""
    errors = {1: ValueError("boom on 1\nmore detail"), 0: OSError("no model")}
    assert failure_reason(WorkerGroupError("2 workers failed", errors)) == (
        "rank 0: OSError: no model; rank 1: ValueError: boom on 1")
    assert failure_reason(WorkerGroupError("2 workers failed", {0: MemoryError(), 1: MemoryError()})) == (
        "ranks 0, 1: MemoryError")
    many = {rank: RuntimeError(f"error {rank}") for rank in range(6)}
    assert failure_reason(WorkerGroupError("6 workers failed", many)).endswith(
        "rank 3: RuntimeError: error 3; and 2 other error(s) in the job's log")
    assert failure_reason(ControllerError(RuntimeError("placement\ngroup timed out"))) == "group timed out"


def test_keep_best_has_ray_train_keep_the_checkpoints_of_the_lowest_eval_loss():
    from workloads.launch.driver import checkpoint_config

    best = checkpoint_config({"checkpoint": {"keep_best": True}}, keep=2)
    assert (best.num_to_keep, best.checkpoint_score_attribute, best.checkpoint_score_order) == (2, "eval_loss", "min")
    newest = checkpoint_config({"checkpoint": {"keep_best": False}}, keep=3)
    assert (newest.num_to_keep, newest.checkpoint_score_attribute) == (3, None)


def test_driver_lines_are_found_behind_ray_prefixes():
    record = {"event": "plan", "nodes": 2, "num_workers": 8, "use_gpu": True}
    line = "\x1b[36m(driver pid=1)\x1b[0m [driver] " + json.dumps(record)
    assert parse_driver_line(line) == record
    assert parse_driver_line("[driver] not json") is None
    assert parse_driver_line("[train] {}") is None


# --- a lost node: Ray Train retries the worker group's start without limit; the run waits, bounded ----


def _startup_timed_out():
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState

    return ReschedulingState(training_failed_error=ControllerError(WorkerGroupStartupTimeoutError(num_workers=2)))


def test_a_run_that_lost_a_node_says_it_waits_and_resumes_when_the_node_is_back():
    from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState

    from workloads.launch.ray_train import WorkerGroupWait

    clock, said = FakeClock(), []
    wait = WorkerGroupWait(limit_s=100, num_workers=2, clock=clock, say=said.append)
    wait.after_controller_state_update(None, RunningState())
    lost = WorkerGroupError("a worker died", {1: RuntimeError("ActorDiedError: node 127.0.0.3 died")})
    wait.after_controller_state_update(RunningState(), RestartingState(training_failed_error=lost))
    for _ in range(3):
        clock.now += 20  # each start of the group waits for its resources, then times out
        wait.after_controller_state_update(None, _startup_timed_out())
    clock.now += 5
    wait.after_controller_state_update(None, RunningState())
    assert said == [
        "waiting for a lost node: the 2 workers cannot be placed until its resources come back (on EKS the node "
        f"group replaces the instance, KubeRay the pod); waited {t} s of 100 s" for t in (20, 40, 60)
    ] + ["the 2 workers are placed again after 65 s; the run resumes from its latest checkpoint"]
    # The next loss is timed from its own start.
    wait.after_controller_state_update(None, RestartingState(training_failed_error=lost))
    clock.now += 30
    wait.after_controller_state_update(None, _startup_timed_out())
    assert said[-1].endswith("waited 30 s of 100 s")


def test_a_node_that_does_not_come_back_fails_the_run_with_the_reason():
    from ray.train.v2._internal.execution.controller.state import RestartingState

    from workloads.launch.ray_train import NodesNotBackError, WorkerGroupWait

    clock = FakeClock()
    wait = WorkerGroupWait(limit_s=60, num_workers=8, clock=clock, say=lambda message: None)
    wait.after_controller_state_update(None, RestartingState(training_failed_error=ControllerError(RuntimeError())))
    clock.now += 30
    wait.after_controller_state_update(None, _startup_timed_out())
    clock.now += 30
    with pytest.raises(NodesNotBackError) as err:
        wait.after_controller_state_update(None, _startup_timed_out())
    message = str(err.value)
    assert message.startswith("the 8 workers could not be placed for 60 s (--wait-nodes-s 60): a lost node did not "
                              "come back.")
    assert "resubmitting with the same --run-name resumes from the latest checkpoint" in message
    # What the driver prints: Ray Train raises the callback's error as the controller's failure.
    assert failure_reason(ControllerError(err.value)) == message


def test_the_start_timeout_follows_the_wait_for_a_node():
    from workloads.launch.driver import start_timeout_s

    assert [start_timeout_s(s) for s in (10, 120, 1200)] == [5.0, 20.0, 60.0]
    base = ["--config-json", "{}", "--run-name", "r", "--storage-path", "/tmp/x"]
    assert parse_args(base).wait_nodes_s == 1200.0 and parse_args([*base, "--wait-nodes-s", "30"]).wait_nodes_s == 30
    with pytest.raises(ValueError, match="--wait-nodes-s must be > 0, got 0"):
        parse_args([*base, "--wait-nodes-s", "0"])


def test_a_resumed_cpu_run_waits_until_its_worker_nodes_have_rejoined():
    from workloads.launch.driver import wait_for_cpu_workers

    clock, said = FakeClock(), []
    head, worker = {"CPU": 0.0}, {"CPU": 1.0}
    arrivals = {0.0: [head], 3.0: [head, worker], 6.0: [head, worker, worker]}
    read = lambda: arrivals[max(t for t in arrivals if t <= clock.now)]  # noqa: E731
    nodes = wait_for_cpu_workers(2, read_nodes=read, timeout_s=60, say=said.append, poll_s=1, every_s=5,
                                 clock=clock, sleep=clock.sleep)
    assert plan_workers(nodes).num_workers == 2 and clock.now == 6.0
    assert said == ["waiting for 2 CPU worker slot(s): 0 registered; 60 s left",
                    "waiting for 2 CPU worker slot(s): 1 registered; 55 s left"]
    with pytest.raises(GpusMissingError, match=r"room for 1 of 2 CPU worker\(s\) within 10 s"):
        wait_for_cpu_workers(2, read_nodes=lambda: [head, worker], timeout_s=10, say=lambda _: None,
                             clock=clock, sleep=clock.sleep)


def test_a_waiting_job_asks_for_what_it_waits_for():
    from workloads.launch.driver import demand_bundles

    assert demand_bundles(require_gpus=True, gpus=8, workers=0, cpus_per_worker=None) == [{"GPU": 1.0}] * 8
    assert demand_bundles(require_gpus=True, gpus=0, workers=0, cpus_per_worker=None) == [{"GPU": 1.0}]
    assert demand_bundles(require_gpus=False, gpus=0, workers=2, cpus_per_worker=None) == [{"CPU": 1.0}] * 2
    assert demand_bundles(require_gpus=False, gpus=0, workers=3, cpus_per_worker=2) == [{"CPU": 2.0}] * 3


def test_the_demand_is_held_while_the_job_waits_and_removed_after_even_when_the_wait_fails():
    from workloads.launch.driver import DEMAND_SETTLE_S, GpusMissingError, ask_for

    calls = []

    class Group:
        def wait(self, *, timeout_seconds):
            calls.append(("placed?", timeout_seconds))
            return True

    def placement_group(bundles, *, strategy):
        calls.append(("made", bundles, strategy))
        return group

    group = Group()
    remove = lambda g: calls.append(("removed", g))  # noqa: E731
    with ask_for([{"GPU": 1.0}] * 2, placement_group=placement_group, remove=remove):
        assert calls == [("made", [{"GPU": 1.0}] * 2, "PACK")]
    # Once the wait is over, removed only after it is placed: removed mid-placement, Ray kept its GPUs.
    assert calls[1:] == [("placed?", DEMAND_SETTLE_S), ("removed", group)]
    calls.clear()
    with pytest.raises(GpusMissingError):
        with ask_for([{"GPU": 1.0}], placement_group=placement_group, remove=remove):
            raise GpusMissingError("0 of 1 GPU(s)")
    assert calls[1:] == [("removed", group)]  # pending, never placed: removed at once
