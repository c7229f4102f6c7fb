"""`probe --instance-types a,b,c`: every type is probed, placements of all of them are ranked by
availability, quota and price, the first that places is written, and the job's default preset
follows its GPU memory. Ranking as plain data; the command end to end against a moto server."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from capacity.aws import InstanceFacts
from capacity.cli import InputError, parse_options
from capacity.probe import (AttemptOutcome, Evidence, ProbeRequest, ReservationAttempt,
                            choose_placement, rank_candidates, unplaced_reasons)
from capacity.report import job_preset
from infra.config import parse_stack_config, read_stack_values
from infra.instance_types import INSTANCE_TYPES
from test_capacity_cli import moto_url, probe  # noqa: F401  (fixtures)
from test_capacity_probe import QUOTA_UNKNOWN, region


def facts(name: str) -> InstanceFacts:
    t = INSTANCE_TYPES[name]
    return InstanceFacts(name=name, vcpus=t.vcpus, gpus=t.gpus, gpu_model=t.gpu_model,
                         efa_supported=True, max_efa_interfaces=t.efa_interfaces)


def typed(report, instance_type: str):
    return replace(report, instance_type=instance_type, facts=facts(instance_type))


REQUEST = ProbeRequest(instance_type="g6e.12xlarge", fallback_types=("g6.12xlarge",
                                                                      "p5.48xlarge"),
                       node_count=2, regions=("us-west-2", "us-east-1"))


def test_placements_rank_by_evidence_then_price_then_the_listed_order():
    west = region("us-west-2", ("us-west-2a", "usw2-az2", True))
    east_unchecked = region("us-east-1", ("us-east-1a", "use1-az4", True), quota=QUOTA_UNKNOWN)
    reports = (typed(west, "g6e.12xlarge"), typed(west, "p5.48xlarge"),
               typed(east_unchecked, "g6.12xlarge"), typed(west, "g6.12xlarge"))
    ranked = rank_candidates(reports, request=REQUEST)
    assert [(c.instance_type, c.region, c.evidence) for c in ranked] == [
        ("g6.12xlarge", "us-west-2", Evidence.QUOTA_OK),     # cheapest with quota checked
        ("g6e.12xlarge", "us-west-2", Evidence.QUOTA_OK),
        ("p5.48xlarge", "us-west-2", Evidence.QUOTA_OK),
        ("g6.12xlarge", "us-east-1", Evidence.QUOTA_UNCHECKED)]
    placement = choose_placement(ranked, (), request=REQUEST)
    assert (placement.instance_type, placement.region) == ("g6.12xlarge", "us-west-2")


def test_the_first_type_that_places_is_chosen_when_the_cheaper_ones_cannot():
    blocked = region("us-west-2", ("us-west-2a", "usw2-az2", False))
    west = region("us-west-2", ("us-west-2a", "usw2-az2", True))
    reports = (typed(blocked, "g6e.12xlarge"), typed(blocked, "g6.12xlarge"),
               typed(west, "p5.48xlarge"))
    placement = choose_placement(rank_candidates(reports, request=REQUEST), (), request=REQUEST)
    assert placement.instance_type == "p5.48xlarge"
    assert job_preset(placement.instance_type) == (80, "qwen2.5-1.5b")
    reasons = unplaced_reasons(reports, ())
    assert reasons == ("us-west-2 g6e.12xlarge: g6e.12xlarge not offered in any AZ",
                       "us-west-2 g6.12xlarge: g6.12xlarge not offered in any AZ")


def test_with_reserve_the_proven_attempt_names_the_type():
    proven = ReservationAttempt(region="us-east-1", zone="us-east-1a", zone_id="use1-az4",
                                outcome=AttemptOutcome.PROVEN, instance_type="p5.48xlarge")
    placement = choose_placement((), (proven,), request=replace(REQUEST, reserve=True))
    assert (placement.instance_type, placement.evidence) == ("p5.48xlarge",
                                                             Evidence.CAPACITY_PROVEN)


def test_the_preset_follows_the_gpu_memory():
    assert job_preset("g6.12xlarge") == (24, "qwen2.5-1.5b-24gb")
    assert job_preset("g6e.12xlarge") == (48, "qwen2.5-1.5b-24gb")
    assert job_preset("p5.48xlarge") == (80, "qwen2.5-1.5b")


@pytest.mark.parametrize("args, message", [
    (["--instance-types", "g6.12xlarge,t3.micro"], "t3.micro is not an EFA-capable"),
    (["--instance-types", " , "], "--instance-types is empty"),
    (["--instance-types", "g6.12xlarge", "--instance-type", "g5.12xlarge"], "not allowed with"),
    (["--hold", "0"], "--hold must be a number of hours from 1"),
    (["--hold", "soon"], "--hold must be a number of hours from 1"),
    (["--hold", "4", "--dry-run"], "cannot be combined with --dry-run"),
])
def test_bad_fallback_and_hold_input(tmp_path, args, message):
    with pytest.raises(InputError, match=message):
        parse_options(["probe", "--regions", "us-west-2", *args], project_dir=tmp_path,
                      known=frozenset({"us-west-2"}))


def test_hold_implies_a_reservation_and_types_keep_their_order(tmp_path):
    opts = parse_options(["probe", "--regions", "us-west-2", "--hold", "6", "--instance-types",
                          "g6e.12xlarge,g6.12xlarge,g6e.12xlarge"], project_dir=tmp_path,
                         known=frozenset({"us-west-2"}))
    assert opts.request.reserve and opts.request.hold_hours == 6
    assert opts.request.instance_types == ("g6e.12xlarge", "g6.12xlarge")


def test_fallback_end_to_end_writes_the_type_that_places(probe, tmp_path):  # noqa: F811
    # moto offers neither g6 nor g6e in eu-west-1, and p4d.24xlarge in eu-west-1c only.
    proc = probe("--regions", "eu-west-1", "--instance-types",
                 "g6.12xlarge,g6e.12xlarge,p4d.24xlarge", "--stack", "eu", "--new-stack")
    assert proc.returncode == 0, proc.stderr
    cfg = parse_stack_config(read_stack_values(tmp_path / "Pulumi.eu.yaml"))
    assert (cfg.gpu_instance_type, cfg.gpu_availability_zone) == ("p4d.24xlarge", "eu-west-1c")
    assert "g6.12xlarge not offered in any AZ" in proc.stdout
    assert "g6e.12xlarge not offered in any AZ" in proc.stdout
    assert "p4d.24xlarge GPUs have 40 GiB: `python -m workloads submit` runs preset " \
           "qwen2.5-1.5b-24gb" in proc.stdout


def test_fallback_json_ranks_the_cheaper_type_first(probe, tmp_path):  # noqa: F811
    proc = probe("--regions", "us-east-2", "--instance-types", "p5.48xlarge,g6.12xlarge",
                 "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["placement"]["instance_type"] == "g6.12xlarge"
    assert (doc["gpu_memory_gib"], doc["preset"]) == (24, "qwen2.5-1.5b-24gb")
    assert {c["instance_type"] for c in doc["candidates"]} == {"p5.48xlarge", "g6.12xlarge"}
    assert doc["candidates"][0]["instance_type"] == "g6.12xlarge"
    assert doc["request"]["fallback_types"] == ["g6.12xlarge"]
