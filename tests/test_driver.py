"""The job driver's pure parts: worker sizing from cluster resources, its arguments, its failure line."""

from __future__ import annotations

import json

import pytest
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from workloads.launch.driver import WorkerPlan, failure_reason, parse_args, parse_driver_line, plan_workers


def test_one_worker_per_gpu_when_the_cluster_has_gpus():
    # Two g6.12xlarge nodes plus a CPU-only head, as ray.cluster_resources() reports them.
    resources = {"CPU": 100.0, "GPU": 8.0, "memory": 1e12, "node:10.0.1.5": 1.0}
    assert plan_workers(resources) == WorkerPlan(num_workers=8, use_gpu=True, cpus_per_worker=1.0)


def test_cpu_workers_fill_the_cpu_slots_when_there_is_no_gpu():
    assert plan_workers({"CPU": 2.0, "memory": 1e9}) == WorkerPlan(num_workers=2, use_gpu=False, cpus_per_worker=1.0)
    assert plan_workers({"CPU": 7.0}, cpus_per_worker=2).num_workers == 3
    assert plan_workers({"CPU": 6.0, "GPU": 0.0}, cpus_per_worker=1.5).num_workers == 4


def test_a_cluster_without_room_for_one_worker_is_a_clear_error():
    with pytest.raises(ValueError, match="no GPU and 0.5 CPUs"):
        plan_workers({"CPU": 0.5})
    with pytest.raises(ValueError, match="positive"):
        plan_workers({"CPU": 4.0}, cpus_per_worker=0)


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


def test_the_failure_line_names_the_first_failing_rank_and_its_error():
    errors = {1: RuntimeError("Traceback...\n  File x\nValueError: boom on 1"),
              0: RuntimeError("\nOSError: no model\n")}
    assert failure_reason(WorkerGroupError("2 workers failed", errors)) == "rank 0: OSError: no model"
    assert failure_reason(ControllerError(RuntimeError("placement\ngroup timed out"))) == "group timed out"


def test_driver_lines_are_found_behind_ray_prefixes():
    record = {"event": "plan", "nodes": 2, "num_workers": 8, "use_gpu": True}
    line = "\x1b[36m(driver pid=1)\x1b[0m [driver] " + json.dumps(record)
    assert parse_driver_line(line) == record
    assert parse_driver_line("[driver] not json") is None
    assert parse_driver_line("[train] {}") is None
