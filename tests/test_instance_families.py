"""Every instance type of infra/instance_types.py, the same way: EC2's facts (moto's
DescribeInstanceTypes data) agree with the table, the probe keeps the stack's type, the quota codes
are the family's and generation's, the node provision limit is the family's, MFU is against the
type's GPU, and the rows per step are the preset's. The worker pods' fit on each type's nodes is
tests/test_infra_sizing.py's and tests/test_infra_raycluster.py's (parametrized over the same
table); a scratch p5.48xlarge stack goes through README's probe and the program under mocks here."""

from __future__ import annotations

import dataclasses
import io
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from moto import mock_aws
from rich.console import Console
from test_infra_program import REPO_ROOT, run_program

from capacity.aws import AwsApi
from capacity.cli import parse_options, run_probe
from capacity.probe import ProbeRequest, same_gpu_memory, table_mismatch
from capacity.quota import quota_group
from capacity.regions import probe_region
from infra import outputs
from infra.config import StackConfig, parse_stack_config, read_stack_values
from infra.instance_types import GPU_INSTANCE_TYPES, INSTANCE_TYPES
from infra.scale_to_zero import cluster_autoscaler_values
from infra.sizing import node_allocatable
from workloads.client.plan import make_plan
from workloads.client.wakeup import WAKE_WAIT_S, wake_wait_s
from workloads.train.config import MODEL_SIZES, PRESETS, ROWS_PER_STEP, preset, preset_for_gpu, with_overrides
from workloads.train.data import reading_of_data
from workloads.train.metrics import device_mfu, device_peak_flops
from workloads.transport.gate import NodeNetwork

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
KNOWN_REGIONS = frozenset({"us-west-2", "us-east-1", "us-east-2", "eu-west-1"})


@pytest.fixture
def api(fake_aws_session):
    with mock_aws():
        api = AwsApi(session=fake_aws_session, sleep=lambda _: None, now=lambda: NOW)
        # moto has no EC2 quotas (tests/test_capacity_quota.py stubs them call by call): an applied
        # quota that fits every type here, so the probe places and writes.
        api.applied_quota = lambda *, region, quota_code: 4096.0
        yield api


def stack_of(tmp_path: Path, instance_type: str, nodes: int) -> Path:
    (tmp_path / "Pulumi.yaml").write_text("name: ray-eks\nruntime: python\n")
    path = tmp_path / "Pulumi.us-west-2.yaml"
    path.write_text(f"config:\n  aws:region: us-west-2\n  ray-eks:gpuInstanceType: {instance_type}\n"
                    f"  ray-eks:gpuNodeCount: {nodes}\n")
    return path


def probe(api: AwsApi, tmp_path: Path, *argv: str) -> tuple[int, str]:
    opts = parse_options(["probe", *argv], project_dir=tmp_path, known=KNOWN_REGIONS)
    out = io.StringIO()
    code = run_probe(opts, api=api, home_region="us-west-2", out=Console(file=out, width=400),
                     err=Console(file=io.StringIO()))
    return code, out.getvalue()


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_the_table_holds_what_ec2_says_of_every_type(api, instance_type):
    facts = api.instance_facts(region="us-west-2", instance_type=instance_type)
    kind = INSTANCE_TYPES[instance_type]
    assert (facts.vcpus, facts.memory_mib, facts.gpus, facts.gpu_model) == (
        kind.vcpus, kind.memory_gib * 1024, kind.gpus, kind.gpu_model)
    assert (facts.max_efa_interfaces, facts.network_cards) == (kind.efa_interfaces, kind.network_cards)
    assert same_gpu_memory(kind.gpu_memory_gib, facts.gpu_memory_mib)
    assert table_mismatch(facts) == ""
    assert kind.gpu is not None and kind.gpu.model == facts.gpu_model


def test_gpu_memory_is_read_as_ec2_writes_it():
    assert same_gpu_memory(24, 22888) and same_gpu_memory(48, 45776)  # GDDR: decimal GB
    assert same_gpu_memory(40, 40960) and same_gpu_memory(141, 144384)  # HBM: GiB
    assert not same_gpu_memory(80, 40960) and not same_gpu_memory(24, 45776)


def test_a_table_that_contradicts_ec2_stops_the_probe_naming_both(api, tmp_path, monkeypatch):
    wrong = dataclasses.replace(INSTANCE_TYPES["p5.48xlarge"], efa_interfaces=16, gpu_memory_gib=141)
    monkeypatch.setitem(INSTANCE_TYPES, "p5.48xlarge", wrong)
    report = probe_region(api, region="us-west-2", request=ProbeRequest(
        instance_type="p5.48xlarge", node_count=2, regions=("us-west-2",)))
    assert report.quota is None  # nothing more is asked of a region once the table is wrong
    assert "EFA interfaces: the table 16, EC2 32" in report.blocker
    assert "memory per GPU: the table 141 GiB, EC2 81920 MiB" in report.blocker
    stack = stack_of(tmp_path, "p5.48xlarge", 2)
    before = stack.read_text()
    code, out = probe(api, tmp_path, "--stack", "us-west-2")
    assert code == 1 and "No placement" in out and "EFA interfaces: the table 16, EC2 32" in out
    assert stack.read_text() == before


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_the_probe_keeps_the_stacks_type_and_node_count(api, tmp_path, instance_type):
    """README's `python -m capacity probe --stack us-west-2` on a stack set to each type."""
    stack = stack_of(tmp_path, instance_type, 3)
    code, out = probe(api, tmp_path, "--stack", "us-west-2")
    assert code == 0, out
    cfg = parse_stack_config(read_stack_values(stack))
    assert (cfg.gpu_instance_type, cfg.gpu_node_count) == (instance_type, 3)
    assert cfg.gpu_availability_zone.startswith("us-west-2")
    assert "Instance type changed" not in out


def test_a_type_on_the_command_line_that_differs_is_written_with_a_line_that_says_so(api, tmp_path, capsys):
    stack = stack_of(tmp_path, "p5.48xlarge", 2)
    code, _ = probe(api, tmp_path, "--stack", "us-west-2", "--instance-type", "g6.12xlarge", "--json")
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["instance_type_change"].startswith(
        "Pulumi.us-west-2.yaml deploys p5.48xlarge: this sets ray-eks:gpuInstanceType to g6.12xlarge")
    assert parse_stack_config(read_stack_values(stack)).gpu_instance_type == "g6.12xlarge"
    stack_of(tmp_path, "p5.48xlarge", 2)
    code, out = probe(api, tmp_path, "--stack", "us-west-2", "--instance-type", "g6.12xlarge")
    assert "Instance type changed: Pulumi.us-west-2.yaml deploys p5.48xlarge" in " ".join(out.split())


def test_without_a_stack_the_region_files_it_may_write_give_the_type(tmp_path):
    stack_of(tmp_path, "p4d.24xlarge", 4)
    opts = parse_options(["probe", "--regions", "us-west-2,us-east-1"], project_dir=tmp_path,
                         known=KNOWN_REGIONS)
    assert (opts.request.instance_type, opts.request.node_count) == ("p4d.24xlarge", 4)
    (tmp_path / "Pulumi.us-east-1.yaml").write_text("config:\n  aws:region: us-east-1\n")
    with pytest.raises(ValueError, match="deploy different GPU instance types .*p4d.24xlarge.*g6.12xlarge"):
        parse_options(["probe", "--regions", "us-west-2,us-east-1"], project_dir=tmp_path, known=KNOWN_REGIONS)
    opts = parse_options(["probe", "--regions", "us-west-2,us-east-1", "--instance-type", "p5.48xlarge",
                          "--nodes", "2"], project_dir=tmp_path, known=KNOWN_REGIONS)
    assert (opts.request.instance_type, opts.request.node_count) == ("p5.48xlarge", 2)


def test_a_stack_set_to_a_type_the_stack_cannot_deploy_is_refused_naming_the_file(tmp_path):
    stack_of(tmp_path, "m7i.xlarge", 2)
    with pytest.raises(ValueError, match="Pulumi.us-west-2.yaml's ray-eks:gpuInstanceType m7i.xlarge has no GPU"):
        parse_options(["probe", "--stack", "us-west-2"], project_dir=tmp_path, known=KNOWN_REGIONS)


SPOT_QUOTAS = {"g": "L-3819A6DF", "p4": "L-7212CCBC", "p5": "L-C4BD4855", "p6": None}
"""EC2's Spot quota list: "All G and VT", "All P4, P3 and P2", "All P5" (P5, P5e, P5en); none for P6."""


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_each_type_counts_against_its_familys_and_generations_quotas(instance_type):
    family = "g" if instance_type.startswith("g") else instance_type[:2]
    assert quota_group(instance_type).quota_code == ("L-DB2E81BA" if family == "g" else "L-417A185B")
    spot = quota_group(instance_type, spot=True)
    assert (spot.quota_code if spot else None) == SPOT_QUOTAS[family]


def test_older_p_generations_keep_their_spot_quota():
    assert [quota_group(t, spot=True).quota_code for t in ("p2.xlarge", "p3dn.24xlarge", "p4de.24xlarge")] == [
        "L-7212CCBC"] * 3
    assert quota_group("trn1.32xlarge", spot=True).quota_code == "L-6B0D517C"


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_the_node_provision_limit_is_the_familys_with_its_source(instance_type):
    """The Cluster Autoscaler's limit and a job's wait for nodes at zero follow the type's family."""
    cfg = StackConfig(region="us-west-2", gpu_availability_zone="us-west-2a", gpu_availability_zone_id="usw2-az2",
                      gpu_instance_type=instance_type, gpu_idle_minutes=30)
    minutes = 15 if instance_type.startswith("g") else 30
    limit = INSTANCE_TYPES[instance_type].provision_limit
    assert limit.minutes == minutes and limit.source
    args = cluster_autoscaler_values(cfg, cluster_name="c")["extraArgs"]
    assert args["max-node-provision-time"] == f"{minutes}m"
    assert wake_wait_s(instance_type) == minutes * 60 + 900  # and 15 minutes for the image
    assert wake_wait_s(None) == WAKE_WAIT_S == wake_wait_s("g6.12xlarge")


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
def test_mfu_is_against_the_peak_of_the_gpu_the_run_is_on(instance_type, monkeypatch):
    """The loop finds its GPU by the CUDA device name: an A100 is not measured against an L4's peak."""
    gpu = INSTANCE_TYPES[instance_type].gpu
    cuda = torch.device("cuda", 0)
    for name in gpu.device_names:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        peak = device_peak_flops(cuda)
        assert peak == gpu.peak_bf16_flops
        mfu = device_mfu(cuda, tokens_per_s=1000.0, flops_per_token=1e10, peak_flops=peak)
        assert mfu == (None if peak is None else round(1e13 / peak, 4))


def test_no_preset_names_a_peak_and_an_unknown_gpu_reports_no_mfu(monkeypatch):
    assert [n for n in PRESETS if preset(n).peak_flops is not None] == []
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")  # not p5's H100
    assert device_peak_flops(cuda) is None
    assert device_mfu(cuda, tokens_per_s=1000.0, flops_per_token=1e10, peak_flops=None) is None
    assert device_peak_flops(cuda, configured=756e12) == 756e12  # a peak the user gives for such a GPU
    assert device_peak_flops(torch.device("cpu"), configured=756e12) is None


@pytest.mark.parametrize("instance_type", GPU_INSTANCE_TYPES)
@pytest.mark.parametrize("model_size", MODEL_SIZES)
def test_the_rows_per_step_are_the_presets_on_every_type_and_node_count(instance_type, model_size, tmp_path):
    """`plan` (what `submit` picks) and the loop's own resolution: 128 rows a step on 4 GPUs or 16."""
    kind = INSTANCE_TYPES[instance_type]
    for nodes in (1, 2):
        name = preset_for_gpu(kind.gpu_memory_gib, model_size=model_size, gpus=nodes * kind.gpus)
        result = make_plan(preset(name), preset_name=name, instance_type=instance_type, nodes=nodes, cwd=tmp_path)
        assert result["rows_per_step"] == ROWS_PER_STEP == preset(name).rows_per_step
        assert result["micro_batch"] * result["grad_accum_steps"] * result["world_size"] == ROWS_PER_STEP
        sized = with_overrides(preset(name), [f"micro_batch={result['micro_batch']}"])
        run = sized.for_world_size(result["world_size"])
        assert (run.micro_batch, run.grad_accum_steps) == (result["micro_batch"], result["grad_accum_steps"])


def test_rows_that_do_not_divide_among_the_ranks_are_refused_naming_the_sizes_that_do():
    cfg = preset("qwen2.5-1.5b-24gb")
    assert cfg.for_world_size(4).grad_accum_steps == 16 and cfg.for_world_size(16).grad_accum_steps == 4
    assert cfg.for_world_size(64).micro_batch == 2 and cfg.for_world_size(128).micro_batch == 1
    with pytest.raises(ValueError, match=r"12 ranks cannot share rows_per_step=128 evenly; world sizes that can: "
                                         r"1, 2, 4, 8, 16, 32, 64, 128"):
        cfg.for_world_size(12)
    # A grad_accum_steps given on the command line is per rank, as without a preset.
    per_rank = with_overrides(cfg, ["grad_accum_steps=3"])
    assert (per_rank.rows_per_step, per_rank.for_world_size(12).grad_accum_steps) == (0, 3)


def test_a_run_that_reads_its_data_more_than_once_says_so():
    twice = reading_of_data({"rows": 6400}, steps=100, rows_per_step=128)
    assert twice["passes"] == 2.0
    assert twice["note"].startswith("100 steps of 128 rows read the 6,400 training rows 2.00 times")
    assert "50 steps make one pass" in twice["note"]
    assert "note" not in reading_of_data({"rows": 12_800}, steps=100, rows_per_step=128)
    assert reading_of_data({"kind": "synthetic"}, steps=100, rows_per_step=128) == {"rows_per_step": 128}


def test_a_scratch_stack_set_to_p5_probes_and_deploys_under_mocks_with_no_other_edit(api, tmp_path, monkeypatch):
    """README's path on a copy of the committed stack file with only gpuInstanceType changed."""
    (tmp_path / "Pulumi.yaml").write_text((REPO_ROOT / "Pulumi.yaml").read_text())
    stack = tmp_path / "Pulumi.us-west-2.yaml"
    stack.write_text((REPO_ROOT / "Pulumi.us-west-2.yaml").read_text().replace(
        "ray-eks:gpuInstanceType: g6.12xlarge", "ray-eks:gpuInstanceType: p5.48xlarge"))
    code, out = probe(api, tmp_path, "--stack", "us-west-2", "--nodes", "2")  # README's probe
    assert code == 0 and "Placement: 2 x p5.48xlarge" in " ".join(out.split())
    config = read_stack_values(stack)
    assert config["ray-eks:gpuInstanceType"] == "p5.48xlarge"
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch)
    gpu = next(g.inputs for g in run.of_type("eks:index:ManagedNodeGroup") if g.inputs.get("enableEfaSupport"))
    assert gpu["instanceTypes"] == ["p5.48xlarge"]
    worker = run.one("kubernetes:ray.io/v1:RayCluster").inputs["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    container = worker["containers"][0]
    limits = container["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"]) == ("8", "32")
    node = node_allocatable(INSTANCE_TYPES["p5.48xlarge"])
    assert int(limits["cpu"]) * 1000 <= node.cpu_millicores and int(limits["memory"][:-2]) * 2**20 <= node.memory_kib
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert NodeNetwork.from_env(env).floor_gbps == 80.0
    assert run.outputs[outputs.GPU_MEMORY_GIB] == 80 and run.outputs[outputs.RAY_WORKER_GPUS] == 16


TESTED_FAMILIES = {"g6": "**whole path under mocks** (the committed stack)",
                   "p5": "**whole path under mocks** (a scratch stack)"}
"""The families whose whole path (stack file, probe, Pulumi program) a test runs beyond the per-type
checks every type gets (this module, the pod fit, the RayCluster's CRD validation)."""
MEASURED_GPUS = {"H200": "the loop measured on its GPU ([PERFORMANCE.md](PERFORMANCE.md))"}


def instance_rows() -> list[str]:
    """docs/INSTANCE_TYPES.md's table, from the code it describes: the default presets on 2 nodes as
    `plan` shows them."""
    rows = []
    for name in GPU_INSTANCE_TYPES:
        kind = INSTANCE_TYPES[name]
        cells = [f"`{name}`", f"{kind.gpus} x {kind.gpu_model}",
                 f"{kind.efa_interfaces} x {kind.network_gbps / kind.efa_interfaces:g} Gbps"]
        for size in MODEL_SIZES:
            preset_name = preset_for_gpu(kind.gpu_memory_gib, model_size=size, gpus=2 * kind.gpus)
            plan = make_plan(preset(preset_name), preset_name=preset_name, instance_type=name, nodes=2, cwd=REPO_ROOT)
            memory = plan["memory"]
            cells += [f"`{preset_name}`: {plan['rows_per_step']} = {plan['micro_batch']} x {plan['grad_accum_steps']}"
                      f" x {plan['world_size']}, {memory['predicted_gib']:.1f} of {memory['gpu_gib']:.1f} GiB"
                      + ("" if memory["fits"] else " (does not fit)")]
        network = NodeNetwork(efa_interfaces=kind.efa_interfaces, line_gbps=kind.network_gbps)
        cells += ["-" if kind.usd_per_hour is None else f"{kind.usd_per_hour:,.2f}",
                  f"{network.floor_gbps:g} GB/s", f"{kind.provision_limit.minutes} min",
                  "; ".join([TESTED_FAMILIES.get(name.split(".")[0], "per-type checks"),
                             *filter(None, [MEASURED_GPUS.get(kind.gpu_model)])])]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def test_the_instance_types_document_is_what_the_code_says():
    """Regenerate with: .venv/bin/python -c 'import sys; sys.path[:0]=["tests"]; import test_instance_families as
    t; print(*t.instance_rows(), sep=chr(10))'"""
    text = (REPO_ROOT / "docs" / "INSTANCE_TYPES.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert table == instance_rows()
