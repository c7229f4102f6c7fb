"""`python -m capacity blocks` and `python -m capacity release`: offerings listed, a purchase only
with an offering EC2 still lists and --yes, the price shown first, the block written to the stack
file (also when the purchase's answer was lost, or an interrupt came), and a stack's reservation
released. botocore Stubber with service-model-valid responses: moto implements neither Capacity
Blocks nor capacity reservations. Bad input goes through the real command line."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from botocore.stub import ANY, Stubber
from rich.console import Console

from capacity import blocks_cli
from capacity.aws import AwsApi, AwsFailure, FailureKind
from capacity.blocks import PURCHASE_TAG, check_days, sellable_problem
from capacity.cli import InputError, parse_options
from infra.config import parse_stack_config, read_stack_values

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
REGION = "us-east-2"
START = datetime(2026, 1, 3, 11, 30, tzinfo=timezone.utc)
BLOCK_ID = "cr-0b10c0000000000a1"
STACK = "config:\n  aws:region: us-east-2\n  ray-eks:rayNamespace: ray  # kept\n"


def offering(oid: str, start: datetime, fee: str, zone: str = "us-east-2b") -> dict:
    """An offering as DescribeCapacityBlockOfferings returns it."""
    return {"CapacityBlockOfferingId": oid, "InstanceType": "p5.48xlarge",
            "AvailabilityZone": zone, "InstanceCount": 2, "StartDate": start,
            "EndDate": start + timedelta(days=2), "CapacityBlockDurationHours": 48,
            "UpfrontFee": fee, "CurrencyCode": "USD", "Tenancy": "default"}


OFFERS = [offering("cb-0222222222222222b", START + timedelta(days=1), "4410.00", "us-east-2a"),
          offering("cb-0111111111111111a", START, "4608.00")]


@pytest.fixture
def api(fake_aws_session) -> AwsApi:
    return AwsApi(session=fake_aws_session, sleep=lambda _: None, now=lambda: NOW)


class Stubs:
    """The purchase goes through the client that never retries; the rest through the other."""

    def __init__(self, api: AwsApi):
        self.calls = Stubber(api.client("ec2", REGION))
        self.once = Stubber(api.client("ec2", REGION, retry=False))

    def _pick(self, method: str) -> Stubber:
        return self.once if method == "purchase_capacity_block" else self.calls

    def add_response(self, method: str, *args, **kwargs) -> None:
        self._pick(method).add_response(method, *args, **kwargs)

    def add_client_error(self, method: str, *args, **kwargs) -> None:
        self._pick(method).add_client_error(method, *args, **kwargs)


@pytest.fixture
def ec2(api: AwsApi):
    stubs = Stubs(api)
    with stubs.calls, stubs.once:
        yield stubs
        stubs.calls.assert_no_pending_responses()
        stubs.once.assert_no_pending_responses()


def stub_offers(ec2: Stubs, offers: list[dict] = OFFERS) -> None:
    ec2.add_response("describe_capacity_block_offerings", {"CapacityBlockOfferings": offers},
                     expected_params={"InstanceType": "p5.48xlarge", "InstanceCount": 2,
                                      "CapacityDurationHours": 48})


def bought(state: str = "payment-pending") -> dict:
    """The CapacityReservation PurchaseCapacityBlock answers with."""
    return {"CapacityReservationId": BLOCK_ID, "InstanceType": "p5.48xlarge",
            "AvailabilityZone": "us-east-2b", "AvailabilityZoneId": "use2-az2",
            "TotalInstanceCount": 2, "State": state, "StartDate": START,
            "EndDate": START + timedelta(days=2), "EndDateType": "limited",
            "ReservationType": "capacity-block", "InstancePlatform": "Linux/UNIX",
            "Tags": [{"Key": PURCHASE_TAG, "Value": "token"}]}


def opts(tmp_path: Path, *args: str) -> blocks_cli.BlocksOptions:
    (tmp_path / "Pulumi.gpu.yaml").write_text(STACK)
    parsed = parse_options(["blocks", "--instance-type", "p5.48xlarge", "--nodes", "2",
                            "--days", "2", *args], project_dir=tmp_path,
                           known=frozenset({REGION, "us-west-2"}), default_region="us-west-2")
    assert isinstance(parsed, blocks_cli.BlocksOptions)
    return parsed


def consoles() -> tuple[Console, Console, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Console(file=out, width=250), Console(file=err, width=250), out, err


def test_offerings_are_listed_soonest_first_with_their_price(api, ec2, tmp_path):
    stub_offers(ec2)
    out, err, out_text, _ = consoles()
    code = blocks_cli.run(opts(tmp_path, "--stack", "gpu"), api=api, out=out, err=err)
    text = out_text.getvalue()
    assert code == 0
    assert text.index("cb-0111111111111111a") < text.index("cb-0222222222222222b")
    assert "4,608.00 USD" in text and "48.0000 USD" in text  # 4608 / (48 h x 2)
    assert "--purchase <offering> --yes" in text
    assert (tmp_path / "Pulumi.gpu.yaml").read_text() == STACK


def test_offerings_as_json(api, ec2, tmp_path, capsys):
    stub_offers(ec2)
    out, err, _, _ = consoles()
    assert blocks_cli.run(opts(tmp_path, "--region", REGION, "--json"), api=api, out=out,
                          err=err) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [o["offering_id"] for o in doc["offerings"]] == ["cb-0111111111111111a",
                                                            "cb-0222222222222222b"]
    assert doc["offerings"][0]["upfront_fee"] == "4608.00"
    assert doc["offerings"][0]["start"] == "2026-01-03T11:30:00Z"


def test_no_offering_exits_1(api, ec2, tmp_path):
    stub_offers(ec2, [])
    out, err, out_text, _ = consoles()
    assert blocks_cli.run(opts(tmp_path, "--stack", "gpu"), api=api, out=out, err=err) == 1
    assert "No Capacity Block offering for 2 x p5.48xlarge for 2 days in us-east-2" in \
        out_text.getvalue()


def test_without_yes_the_price_is_shown_and_nothing_is_bought(api, ec2, tmp_path):
    stub_offers(ec2)  # no purchase stubbed: a purchase call would fail the test
    out, err, out_text, _ = consoles()
    code = blocks_cli.run(opts(tmp_path, "--stack", "gpu", "--purchase", "cb-0111111111111111a"),
                          api=api, out=out, err=err)
    assert code == 2
    text = out_text.getvalue()
    assert "upfront 4,608.00 USD" in text and "Not bought: add --yes" in text
    assert (tmp_path / "Pulumi.gpu.yaml").read_text() == STACK


def test_purchase_writes_the_block_and_says_when_it_starts(api, ec2, tmp_path):
    stub_offers(ec2)
    ec2.add_response("purchase_capacity_block", {"CapacityReservation": bought()},
                     expected_params={"CapacityBlockOfferingId": "cb-0111111111111111a",
                                      "InstancePlatform": "Linux/UNIX",
                                      "TagSpecifications": ANY})
    out, err, out_text, _ = consoles()
    code = blocks_cli.run(opts(tmp_path, "--stack", "gpu", "--purchase", "cb-0111111111111111a",
                               "--yes"), api=api, out=out, err=err)
    assert code == 0
    text = out_text.getvalue()
    assert text.index("Buying Capacity Block cb-0111111111111111a") < text.index("Bought")
    assert "starts at 2026-01-03T11:30:00Z (in 47.5 h)" in text and "0 nodes" in text
    assert "reclaims its instances from 2026-01-05T11:00:00Z, 30 minutes before" in text
    path = tmp_path / "Pulumi.gpu.yaml"
    cfg = parse_stack_config(read_stack_values(path))
    assert (cfg.gpu_instance_type, cfg.gpu_availability_zone, cfg.gpu_availability_zone_id,
            cfg.gpu_node_count) == ("p5.48xlarge", "us-east-2b", "use2-az2", 2)
    reservation = cfg.gpu_reservation
    assert (reservation.reservation_id, reservation.kind) == (BLOCK_ID, "capacity-block")
    assert (reservation.start, reservation.end) == (START, START + timedelta(days=2))
    assert "ray-eks:rayNamespace: ray  # kept\n" in path.read_text()


def test_a_purchase_whose_answer_was_lost_is_found_by_its_tag(api, ec2, tmp_path):
    stub_offers(ec2)
    ec2.add_client_error("purchase_capacity_block", "InternalError", "try later", 500)
    ec2.add_response("describe_capacity_reservations", {"CapacityReservations": [bought(
        "scheduled")]}, expected_params={"Filters": [
            {"Name": f"tag:{PURCHASE_TAG}", "Values": ANY},
            {"Name": "state", "Values": ["scheduled", "payment-pending", "active"]}]})
    out, err, out_text, _ = consoles()
    code = blocks_cli.run(opts(tmp_path, "--stack", "gpu", "--purchase", "cb-0111111111111111a",
                               "--yes"), api=api, out=out, err=err)
    assert code == 0 and "found by its tag" in out_text.getvalue()
    assert parse_stack_config(read_stack_values(tmp_path / "Pulumi.gpu.yaml")
                              ).gpu_reservation_id == BLOCK_ID


def test_a_lost_answer_with_no_tagged_block_says_nothing_was_bought(api, ec2, tmp_path):
    stub_offers(ec2)
    ec2.add_client_error("purchase_capacity_block", "ServiceUnavailable", "", 503)
    ec2.add_response("describe_capacity_reservations", {"CapacityReservations": []},
                     expected_params={"Filters": ANY})
    out, err, _, err_text = consoles()
    code = blocks_cli.run(opts(tmp_path, "--stack", "gpu", "--purchase", "cb-0111111111111111a",
                               "--yes"), api=api, out=out, err=err)
    assert code == 1 and "nothing was bought" in err_text.getvalue()
    assert (tmp_path / "Pulumi.gpu.yaml").read_text() == STACK


def test_a_refused_purchase_is_an_aws_failure_and_writes_nothing(api, ec2, tmp_path):
    stub_offers(ec2)
    ec2.add_client_error("purchase_capacity_block", "InsufficientCapacity",
                         "The offering is no longer available", 400)
    out, err, _, _ = consoles()
    with pytest.raises(AwsFailure) as failure:
        blocks_cli.run(opts(tmp_path, "--stack", "gpu", "--purchase", "cb-0111111111111111a",
                            "--yes"), api=api, out=out, err=err)
    assert failure.value.kind is FailureKind.NO_CAPACITY
    assert (tmp_path / "Pulumi.gpu.yaml").read_text() == STACK


def test_an_offering_ec2_no_longer_lists_is_not_bought(api, ec2, tmp_path):
    stub_offers(ec2, OFFERS[:1])
    out, err, _, err_text = consoles()
    code = blocks_cli.run(opts(tmp_path, "--stack", "gpu", "--purchase", "cb-0111111111111111a",
                               "--yes"), api=api, out=out, err=err)
    assert code == 1 and "is not among the 1 EC2 lists now" in err_text.getvalue()


def test_an_interrupt_during_the_purchase_lands_after_the_block_is_recorded(api, ec2, tmp_path):
    stub_offers(ec2)
    ec2.add_response("purchase_capacity_block", {"CapacityReservation": bought()},
                     expected_params={"CapacityBlockOfferingId": "cb-0111111111111111a",
                                      "InstancePlatform": "Linux/UNIX",
                                      "TagSpecifications": ANY})
    api.client("ec2", REGION, retry=False).meta.events.register(
        "after-call.ec2.PurchaseCapacityBlock",
        lambda **_: os.kill(os.getpid(), signal.SIGINT))
    out, err, _, err_text = consoles()
    code = blocks_cli.run(opts(tmp_path, "--stack", "gpu", "--purchase", "cb-0111111111111111a",
                               "--yes"), api=api, out=out, err=err)
    assert code == 130
    assert f"interrupted; Capacity Block {BLOCK_ID} was bought and written to" in \
        err_text.getvalue()
    assert parse_stack_config(read_stack_values(tmp_path / "Pulumi.gpu.yaml")
                              ).gpu_reservation_id == BLOCK_ID


# --- release ---------------------------------------------------------------------------------

def reserved_stack(tmp_path: Path, kind: str) -> Path:
    zone, instance_type = (("us-east-2b", "p5.48xlarge") if kind == "capacity-block"
                           else ("us-east-2b", "g6.12xlarge"))
    path = tmp_path / "Pulumi.gpu.yaml"
    path.write_text(
        f"config:\n  aws:region: us-east-2\n  ray-eks:gpuAvailabilityZone: {zone}\n"
        f"  ray-eks:gpuAvailabilityZoneId: use2-az2\n  ray-eks:gpuInstanceType: {instance_type}\n"
        f"  ray-eks:gpuNodeCount: 2\n  ray-eks:gpuReservationId: {BLOCK_ID}\n"
        f"  ray-eks:gpuReservationType: {kind}\n"
        f"  ray-eks:gpuReservationInstanceType: {instance_type}\n"
        f"  ray-eks:gpuReservationAvailabilityZone: {zone}\n"
        f"  ray-eks:gpuReservationInstanceCount: 2\n"
        f"  ray-eks:gpuReservationStart: '2026-01-01T10:00:00Z'\n"
        f"  ray-eks:gpuReservationEnd: '2026-01-03T10:00:00Z'\n"
        f"  ray-eks:rayNamespace: ray  # kept\n")
    return path


def release_opts(tmp_path: Path) -> blocks_cli.ReleaseOptions:
    parsed = parse_options(["release", "--stack", "gpu"], project_dir=tmp_path,
                           known=frozenset({REGION}))
    assert isinstance(parsed, blocks_cli.ReleaseOptions)
    return parsed


UNRESERVED = ("config:\n  aws:region: us-east-2\n  ray-eks:gpuAvailabilityZone: us-east-2b\n"
              "  ray-eks:gpuAvailabilityZoneId: use2-az2\n")


def test_release_cancels_a_held_odcr_and_removes_the_keys(api, ec2, tmp_path):
    path = reserved_stack(tmp_path, "on-demand")
    ec2.add_response("describe_capacity_reservations", {"CapacityReservations": [{
        **bought("active"), "ReservationType": "default", "InstanceType": "g6.12xlarge"}]},
        expected_params={"CapacityReservationIds": [BLOCK_ID]})
    ec2.add_response("cancel_capacity_reservation", {"Return": True},
                     expected_params={"CapacityReservationId": BLOCK_ID, "DryRun": False})
    out, err, out_text, _ = consoles()
    assert blocks_cli.run(release_opts(tmp_path), api=api, out=out, err=err) == 0
    assert f"Cancelled On-Demand Capacity Reservation {BLOCK_ID}" in out_text.getvalue()
    text = path.read_text()
    assert "gpuReservation" not in text and text.startswith(UNRESERVED)
    assert "ray-eks:rayNamespace: ray  # kept\n" in text
    assert parse_stack_config(read_stack_values(path)).gpu_reservation is None


def test_release_of_a_block_only_stops_targeting_it(api, ec2, tmp_path):
    path = reserved_stack(tmp_path, "capacity-block")
    ec2.add_response("describe_capacity_reservations", {"CapacityReservations": [
        bought("active")]}, expected_params={"CapacityReservationIds": [BLOCK_ID]})
    out, err, out_text, _ = consoles()
    assert blocks_cli.run(release_opts(tmp_path), api=api, out=out, err=err) == 0
    assert "cannot be cancelled: it stays paid and ends at 2026-01-03T10:00:00Z" in \
        out_text.getvalue()
    assert "gpuReservation" not in path.read_text()


def test_release_never_cancels_what_ec2_says_is_a_block(api, ec2, tmp_path):
    path = reserved_stack(tmp_path, "on-demand")  # the file says ODCR; EC2 knows better
    ec2.add_response("describe_capacity_reservations", {"CapacityReservations": [
        bought("active")]}, expected_params={"CapacityReservationIds": [BLOCK_ID]})
    out, err, out_text, _ = consoles()  # no cancel stubbed: a cancel call would fail the test
    assert blocks_cli.run(release_opts(tmp_path), api=api, out=out, err=err) == 0
    assert "cannot be cancelled" in out_text.getvalue()
    assert "gpuReservation" not in path.read_text()


def test_release_that_ec2_refuses_keeps_the_keys(api, ec2, tmp_path):
    path = reserved_stack(tmp_path, "on-demand")
    before = path.read_text()
    ec2.add_response("describe_capacity_reservations", {"CapacityReservations": [{
        **bought("active"), "ReservationType": "default", "InstanceType": "g6.12xlarge"}]},
        expected_params={"CapacityReservationIds": [BLOCK_ID]})
    ec2.add_client_error("cancel_capacity_reservation", "UnauthorizedOperation", "denied", 403)
    out, err, _, _ = consoles()
    with pytest.raises(AwsFailure) as failure:
        blocks_cli.run(release_opts(tmp_path), api=api, out=out, err=err)
    assert failure.value.kind is FailureKind.DENIED
    assert path.read_text() == before


# --- bad input -------------------------------------------------------------------------------

def test_capacity_block_rules():
    assert sellable_problem("p5.48xlarge") is None and sellable_problem("p4d.24xlarge") is None
    assert "EC2 sells no Capacity Blocks for g6.12xlarge" in sellable_problem("g6.12xlarge")
    assert "deploys only the EFA GPU types" in sellable_problem("trn1.32xlarge")
    assert [d for d in range(1, 200) if check_days(d) is None] == [
        *range(1, 15), *range(21, 183, 7)]


@pytest.mark.parametrize("args, message", [
    (["--instance-type", "g6.12xlarge", "--days", "2"], "EC2 sells no Capacity Blocks for g6"),
    (["--instance-type", "p5.48xlarge", "--days", "15"], "a multiple of 7 days"),
    (["--instance-type", "p5.48xlarge", "--days", "2", "--nodes", "0"], "from 1 to 64"),
    (["--instance-type", "p5.48xlarge", "--days", "2", "--purchase", "cb-0111111111111111a"],
     "--purchase needs --stack"),
    (["--instance-type", "p5.48xlarge", "--days", "2", "--yes"], "name the offering"),
    (["--instance-type", "p5.48xlarge", "--days", "2", "--stack", "gpu", "--purchase", "x"],
     "is not a Capacity Block offering ID"),
    (["--instance-type", "p5.48xlarge", "--days", "2", "--start-after", "monday"],
     "--start-after must be an ISO 8601 time"),
])
def test_bad_blocks_input_is_refused_before_any_call(tmp_path, args, message):
    with pytest.raises(InputError, match=message):
        parse_options(["blocks", *args], project_dir=tmp_path, known=frozenset({REGION}),
                      default_region=REGION)


def test_a_stack_that_already_targets_a_reservation_gets_no_second_one(tmp_path):
    reserved_stack(tmp_path, "on-demand")
    with pytest.raises(InputError, match=f"targets on-demand reservation {BLOCK_ID}.*release "
                                         f"--stack gpu"):
        parse_options(["blocks", "--instance-type", "p5.48xlarge", "--days", "2", "--stack",
                       "gpu", "--purchase", "cb-0111111111111111a", "--yes"],
                      project_dir=tmp_path, known=frozenset({REGION}))
    with pytest.raises(InputError, match="release --stack gpu"):
        parse_options(["probe", "--stack", "gpu", "--hold", "4"], project_dir=tmp_path,
                      known=frozenset({REGION}))


def test_the_command_line_exits_2_with_one_line(repo_root, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_REGION=REGION, AWS_CONFIG_FILE=os.devnull,
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, PYTHONPATH=str(repo_root))
    shutil.copy(repo_root / "Pulumi.yaml", tmp_path / "Pulumi.yaml")
    proc = subprocess.run([sys.executable, "-m", "capacity", "blocks", "--instance-type",
                           "g6.12xlarge", "--nodes", "2", "--days", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("capacity blocks: error: EC2 sells no Capacity Blocks for g6.12xlarge")
