"""Pure pieces of the program: AZ choice, subnet plan, pod sizing, cost, the checkpoint policy,
and that nothing in infra/ assumes a region."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest

from infra.config import load_stack_config
from infra.cost import estimated_cost_per_hour
from infra.instance_types import GPU_INSTANCE_TYPES, INSTANCE_TYPES
from infra.network import Zone, choose_zones, gpu_zone_by_id, plan_subnets, s3_service_name
from infra.sizing import kube_reserved_cpu, worker_pod_size
from infra.storage import checkpoint_policy

REPO_ROOT = Path(__file__).resolve().parent.parent
ZONES = [Zone(name=f"us-east-1{s}", zone_id=f"use1-az{i}") for s, i in zip("abcdef", (6, 1, 2, 4, 3, 5))]


def test_the_gpu_zone_is_found_by_its_id_whatever_this_account_calls_it():
    assert gpu_zone_by_id(zone_id="use1-az4", available=ZONES) == Zone(name="us-east-1d",
                                                                       zone_id="use1-az4")


def test_gpu_zone_comes_first_then_another_zone():
    chosen = choose_zones(gpu_zone=gpu_zone_by_id(zone_id="use1-az4", available=ZONES),
                          available=ZONES)
    assert [z.name for z in chosen] == ["us-east-1d", "us-east-1a"]


def test_a_zone_without_eks_control_plane_support_gets_two_companions():
    chosen = choose_zones(gpu_zone=gpu_zone_by_id(zone_id="use1-az3", available=ZONES),
                          available=ZONES)
    assert [z.name for z in chosen] == ["us-east-1e", "us-east-1a", "us-east-1b"]


def test_an_unknown_gpu_zone_id_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"use1-az9 is not available to this account \(available: "
                                         r"use1-az1 \(us-east-1b\), .*capacity probe"):
        gpu_zone_by_id(zone_id="use1-az9", available=ZONES)


def test_a_region_with_one_usable_zone_is_refused():
    with pytest.raises(ValueError, match="two availability zones"):
        choose_zones(gpu_zone=ZONES[0], available=ZONES[:1])


@pytest.mark.parametrize(("region", "service"), [
    ("eu-west-1", "com.amazonaws.eu-west-1.s3"), ("cn-north-1", "cn.com.amazonaws.cn-north-1.s3")])
def test_the_s3_gateway_endpoint_service_name(region, service):
    assert s3_service_name(region) == service


def test_subnet_plan_is_disjoint_and_inside_the_vpc():
    plan = plan_subnets(vpc_cidr="10.0.0.0/16", zones=ZONES[:3])
    nets = [ipaddress.ip_network(c) for p in plan for c in (p.public_cidr, p.private_cidr)]
    vpc = ipaddress.ip_network("10.0.0.0/16")
    assert all(n.subnet_of(vpc) for n in nets)
    assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])
    assert all(ipaddress.ip_network(p.private_cidr).num_addresses == 8192 for p in plan)


def test_kube_reserved_cpu_follows_the_eks_formula():
    assert kube_reserved_cpu(INSTANCE_TYPES["m7i.xlarge"]) == pytest.approx(0.08)
    assert kube_reserved_cpu(INSTANCE_TYPES["g6.12xlarge"]) == pytest.approx(0.19)


@pytest.mark.parametrize("name", GPU_INSTANCE_TYPES)
def test_worker_size_takes_every_gpu_and_efa_interface(name):
    size = worker_pod_size(INSTANCE_TYPES[name], hugepages_mib=0)
    assert (size.gpus, size.efa_interfaces) == (INSTANCE_TYPES[name].gpus,
                                                INSTANCE_TYPES[name].efa_interfaces)


def test_cost_adds_nodes_volumes_control_plane_and_nat():
    cfg = load_stack_config("us-west-2", REPO_ROOT)
    assert cfg.system_node_count == 2
    expected = (2 * 4.6016 + 2 * 0.2016 + (2 * 200 + 2 * 100) * 0.08 / 730 + 0.10 + 0.045)
    assert estimated_cost_per_hour(cfg) == round(expected, 2)


def test_checkpoint_policy_is_scoped_to_prefix_and_service_account():
    policy = checkpoint_policy(bucket_arn="arn:aws:s3:::b", key_prefix="ray-train",
                               cluster_name="c", namespace="ray", service_account="sa")
    objects, listing = policy["Statement"]
    assert objects["Resource"] == "arn:aws:s3:::b/ray-train/*"
    assert listing == {"Sid": "List", "Effect": "Allow", "Action": ["s3:ListBucket"],
                       "Resource": "arn:aws:s3:::b", "Condition": objects["Condition"]}
    assert objects["Condition"]["StringEquals"] == {
        "aws:PrincipalTag/eks-cluster-name": "c", "aws:PrincipalTag/kubernetes-namespace": "ray",
        "aws:PrincipalTag/kubernetes-service-account": "sa"}


REGION_LITERAL = re.compile(r"\b[a-z]{2}(?:-gov)?-(?:north|south|east|west|central|northeast|"
                            r"southeast|northwest|southwest)-\d(?!\d)")
# The price tables quote regions' list prices and say which; they are data, not an assumption.
ALLOWED = {"infra/instance_types.py": {"us-east-1"},
           "infra/prices.py": {"us-east-1", "us-east-2", "us-west-2", "eu-west-1", "eu-central-1", "ap-northeast-1"}}


def test_the_region_pattern_finds_a_region():
    assert REGION_LITERAL.findall('zone = "us-west-2a"; x = "ap-southeast-4"') == [
        "us-west-2", "ap-southeast-4"]


def test_no_region_literal_in_infra_code():
    found = {str(p.relative_to(REPO_ROOT)): REGION_LITERAL.findall(p.read_text())
             for p in [REPO_ROOT / "__main__.py", *(REPO_ROOT / "infra").rglob("*.py")]}
    assert {p: set(hits) for p, hits in found.items() if hits} == ALLOWED



def test_docs_list_every_output_and_setting():
    from dataclasses import fields

    from infra import outputs
    from infra.config import StackConfig, config_key
    docs = (REPO_ROOT / "docs" / "INFRA.md").read_text()
    assert [name for name in outputs.ALL + outputs.TRACKING if f"`{name}`" not in docs] == []
    assert [f.name for f in fields(StackConfig) if f"`{config_key(f.name)}`" not in docs] == []
