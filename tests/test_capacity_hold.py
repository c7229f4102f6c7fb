"""`probe --hold`: the proving reservation is kept for the stack (end date moved out, tag marked
`held:<stack>`, stack file written) or, if anything stops that, cancelled like any other.

botocore Stubber with service-model-valid responses for the calls in order (moto has no capacity
reservations); the in-memory EC2 ledger of test_reliability_reservations for a signal at every
point of a held run.
"""

from __future__ import annotations

import io
import json
import signal
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from botocore.stub import ANY
from rich.console import Console

from capacity import stackfile
from capacity.hold import HeldLog, stack_keeper
from capacity.probe import (AttemptOutcome, Candidate, Evidence, ProbeRequest, RegionReport,
                            ReservationAttempt, ZoneOffer, choose_placement)
from capacity.report import ProbeResult, as_json, print_human
from capacity.reserve import (HELD_PREFIX, SAFETY_LIFETIME, TAG_KEY, ReservationRun,
                              prove_capacity, sweep_leftovers)
from infra.config import GpuReservation, format_utc, parse_stack_config, read_stack_values
from test_capacity_reserve import (DENIED_MESSAGE, NOW, Ec2Stubs, api, create_params,  # noqa: F401
                                   ec2, sleep, stub_cancel)
from test_capacity_probe import G6, QUOTA_OK
from test_reliability_reservations import (_API_NAMES, REGION, SIGNALS, Behaviour, FakeEc2,
                                           guarded_handlers, make_api)  # noqa: F401

HOURS = 8.0
HELD, DENIED, UNWRITTEN = "cr-0a1000000000000a1", "cr-0a2000000000000a2", "cr-0a3000000000000a3"
COMMITTED = """# kept comment
config:
  aws:region: us-west-2
  ray-eks:gpuAvailabilityZone: us-west-2c
  ray-eks:gpuAvailabilityZoneId: usw2-az3
  ray-eks:gpuInstanceType: g6.12xlarge
  ray-eks:gpuNodeCount: 2
  ray-eks:rayNamespace: ray
"""


def cand(zone: str = "us-west-2a", zone_id: str = "usw2-az2") -> Candidate:
    return Candidate(region="us-west-2", zone=zone, zone_id=zone_id, evidence=Evidence.QUOTA_OK,
                     instance_type="g6.12xlarge")


def shape(rid: str, state: str = "active", tags: dict | None = None) -> dict:
    out = {"CapacityReservationId": rid, "State": state, "AvailabilityZone": "us-west-2a",
           "InstanceType": "g6.12xlarge", "TotalInstanceCount": 2}
    if tags is not None:
        out["Tags"] = [{"Key": k, "Value": v} for k, v in tags.items()]
    return out


def stub_hold_preflight(stub: Ec2Stubs, *, leftovers: tuple[dict, ...] = ()) -> None:
    stub.add_client_error("create_capacity_reservation", "DryRunOperation", "", 412,
                          expected_params={**create_params("us-west-2a"), "DryRun": True})
    stub.add_client_error("cancel_capacity_reservation", "DryRunOperation", "", 412,
                          expected_params={"CapacityReservationId": ANY, "DryRun": True})
    stub.add_client_error("modify_capacity_reservation", "DryRunOperation", "", 412,
                          expected_params={"CapacityReservationId": ANY, "EndDateType": "limited",
                                           "EndDate": ANY, "DryRun": True})
    stub.add_client_error("create_tags", "DryRunOperation", "", 412,
                          expected_params={"Resources": ANY, "Tags": ANY, "DryRun": True})
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": list(leftovers)},
                      expected_params={"Filters": ANY})


def stack_path(tmp_path: Path) -> Path:
    path = tmp_path / "Pulumi.us-west-2.yaml"
    path.write_text(COMMITTED)
    return path


def test_held_reservation_is_extended_marked_and_written_to_the_stack_file(api, ec2, tmp_path):
    path = stack_path(tmp_path)
    stub_hold_preflight(ec2)
    ec2.add_response("create_capacity_reservation", {"CapacityReservation": shape(HELD)},
                     expected_params=create_params("us-west-2a"))
    ec2.add_response("modify_capacity_reservation", {"Return": True}, expected_params={
        "CapacityReservationId": HELD, "EndDateType": "limited",
        "EndDate": NOW + timedelta(hours=HOURS), "DryRun": False})
    ec2.add_response("create_tags", {}, expected_params={
        "Resources": [HELD], "DryRun": False,
        "Tags": [{"Key": TAG_KEY, "Value": f"{HELD_PREFIX}us-west-2"}, {"Key": "Purpose",
                                                                         "Value": ANY}]})
    log = HeldLog()
    keep = stack_keeper(api, stack="us-west-2", project_dir=tmp_path, node_count=2, hours=HOURS,
                        log=log)
    run = prove_capacity(api, candidates=(cand(),), instance_type="g6.12xlarge", count=2,
                         keep=keep)
    (attempt,) = run.attempts
    assert attempt.outcome is AttemptOutcome.PROVEN and attempt.held and not attempt.cancelled
    assert run.leaked == ()
    cfg = parse_stack_config(read_stack_values(path))
    assert (cfg.gpu_availability_zone, cfg.gpu_availability_zone_id) == ("us-west-2a", "usw2-az2")
    assert cfg.gpu_reservation_id == HELD and cfg.gpu_reservation_type == "on-demand"
    assert cfg.gpu_reservation_end == format_utc(NOW + timedelta(hours=HOURS))
    assert path.read_text().startswith("# kept comment\n")
    assert "ray-eks:rayNamespace: ray\n" in path.read_text()
    assert log.reservation.reservation_id == HELD and log.update.path == path


def test_a_hold_that_cannot_be_extended_is_cancelled_and_nothing_is_written(api, ec2, tmp_path):
    path = stack_path(tmp_path)
    stub_hold_preflight(ec2)
    ec2.add_response("create_capacity_reservation", {"CapacityReservation": shape(DENIED)},
                     expected_params=create_params("us-west-2a"))
    ec2.add_client_error("modify_capacity_reservation", "UnauthorizedOperation",
                         DENIED_MESSAGE.replace("CreateCapacityReservation",
                                                "ModifyCapacityReservation"), 403)
    stub_cancel(ec2, DENIED)
    keep = stack_keeper(api, stack="us-west-2", project_dir=tmp_path, node_count=2, hours=HOURS,
                        log=HeldLog())
    run = prove_capacity(api, candidates=(cand(), cand("us-west-2b", "usw2-az1")),
                         instance_type="g6.12xlarge", count=2, keep=keep)
    (attempt,) = run.attempts  # a permission problem stops: it would fail everywhere
    assert attempt.outcome is AttemptOutcome.DENIED and attempt.cancelled and not attempt.held
    assert f"holding {DENIED} failed" in attempt.detail
    assert "ec2:ModifyCapacityReservation" in attempt.detail
    assert path.read_text() == COMMITTED


def test_a_stack_file_that_cannot_take_the_hold_stops_it_before_ec2_is_told(api, ec2, tmp_path):
    path = tmp_path / "Pulumi.us-west-2.yaml"
    path.write_text("config:\n  aws:region: us-west-2\n  ray-eks:gpuAvailabilityZone: "
                    "us-west-2c   # trailing\n  ray-eks:rayNamespace:    ray\n")
    before = path.read_text()
    stub_hold_preflight(ec2)
    ec2.add_response("create_capacity_reservation", {"CapacityReservation": shape(UNWRITTEN)},
                     expected_params=create_params("us-west-2a"))
    stub_cancel(ec2, UNWRITTEN)
    keep = stack_keeper(api, stack="us-west-2", project_dir=tmp_path, node_count=2, hours=HOURS,
                        log=HeldLog())
    with pytest.raises(Exception, match="left untouched"):
        prove_capacity(api, candidates=(cand(),), instance_type="g6.12xlarge", count=2,
                       keep=keep)
    assert path.read_text() == before  # and no modify/tag call: the stubs would have failed


def test_sweep_cancels_leftovers_but_leaves_held_reservations_alone(api, ec2):
    ec2.add_response("describe_capacity_reservations", {"CapacityReservations": [
        shape("cr-old", tags={TAG_KEY: "0f1e-token"}),
        shape("cr-held", tags={TAG_KEY: f"{HELD_PREFIX}us-west-2", "Purpose": "held"})]},
        expected_params={"Filters": [{"Name": "tag-key", "Values": [TAG_KEY]},
                                     {"Name": "state", "Values": ["active", "pending"]}]})
    stub_cancel(ec2, "cr-old")
    assert sweep_leftovers(api, region="us-west-2") == (("cr-old",), ())


# --- a signal at every point of a held run -------------------------------------------------------

_HOLD_API_NAMES = {**_API_NAMES, "modify_capacity_reservation": "ModifyCapacityReservation",
                   "create_tags": "CreateTags"}


@dataclass
class HoldingEc2(FakeEc2):
    """The ledger EC2, also answering the end-date move and the tagging a hold makes, and
    reporting tags (as EC2 does) so the sweep can tell a held reservation from a leftover."""

    meta: object = field(default_factory=lambda: type("Meta", (), {
        "method_to_api_mapping": dict(_HOLD_API_NAMES)})())

    def modify_capacity_reservation(self, **kw) -> dict:
        name = "modify_dry_run" if kw["DryRun"] else "modify"
        index = self._enter(name)
        if kw["DryRun"]:
            self.hook(index, name, "after")
            raise _client_error("ModifyCapacityReservation", "DryRunOperation")
        entry = self.ledger[kw["CapacityReservationId"]]
        entry.end_date, entry.end_date_type = kw["EndDate"], kw["EndDateType"]
        self.hook(index, name, "after")
        return {"Return": True}

    def create_tags(self, **kw) -> dict:
        name = "tag_dry_run" if kw["DryRun"] else "tag"
        index = self._enter(name)
        if kw["DryRun"]:
            self.hook(index, name, "after")
            raise _client_error("CreateTags", "DryRunOperation")
        for rid in kw["Resources"]:
            self.ledger[rid].tags.update({t["Key"]: t["Value"] for t in kw["Tags"]})
        self.hook(index, name, "after")
        return {}

    @staticmethod
    def _shape(entry) -> dict:
        return {"CapacityReservationId": entry.reservation_id, "State": entry.state,
                "AvailabilityZone": entry.zone,
                "Tags": [{"Key": k, "Value": v} for k, v in entry.tags.items()]}


def _client_error(operation: str, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": ""},
                        "ResponseMetadata": {"HTTPStatusCode": 412}}, operation)


def held_run(ec2: HoldingEc2, tmp_path: Path) -> HeldLog:
    """A held run; the stack-file write is a point of the trace too (the commit point)."""
    log = HeldLog()
    keep = stack_keeper(make_api(ec2), stack="us-west-2", project_dir=tmp_path, node_count=2,
                        hours=HOURS, log=log)
    candidates = (Candidate(region=REGION, zone=f"{REGION}a", zone_id="usw2-az1",
                            evidence=Evidence.QUOTA_OK, instance_type="g6.12xlarge"),)
    real_write = stackfile.write

    def write(update) -> None:
        index = ec2._enter("write")
        real_write(update)
        ec2.hook(index, "write", "after")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stackfile, "write", write)
        prove_capacity(make_api(ec2), candidates=candidates, instance_type="g6.12xlarge",
                       count=2, keep=keep)
    return log


def hold_points(tmp_path: Path) -> list[tuple[int, str, str]]:
    ec2 = HoldingEc2(behaviour=Behaviour(pending_polls=1, leftovers=("cr-earlier",)),
                     hook=lambda *_: None)
    stack_path(tmp_path)
    log = held_run(ec2, tmp_path)
    assert log.reservation is not None  # uninterrupted, the run holds
    return [(i, op, phase) for i, op in enumerate(ec2.trace)
            for phase in (("sleep",) if op == "sleep" else ("before", "after"))]


def test_a_signal_at_any_point_of_a_hold_leaves_it_held_and_written_or_cancelled(
        tmp_path_factory, guarded_handlers):
    points = hold_points(tmp_path_factory.mktemp("trace"))
    assert {"modify", "tag", "write", "create", "describe", "sleep", "cancel"} <= {
        op for _, op, _ in points}
    for sig in SIGNALS.values():
        for point in points:
            tmp_path = tmp_path_factory.mktemp("hold")
            path = stack_path(tmp_path)

            def hook(i: int, op: str, ph: str, point=point, sig=sig) -> None:
                if (i, op, ph) == point:
                    signal.raise_signal(sig)

            ec2 = HoldingEc2(behaviour=Behaviour(pending_polls=1, leftovers=("cr-earlier",)),
                             hook=hook)
            with pytest.raises(KeyboardInterrupt) as caught:
                held_run(ec2, tmp_path)
            assert {s: signal.getsignal(s) for s in SIGNALS.values()} == guarded_handlers
            mine = [e for e in ec2.active() if e.reservation_id != "cr-earlier"]
            written = parse_stack_config(read_stack_values(path)).gpu_reservation
            if written is None:
                assert path.read_text() == COMMITTED, point
                assert mine == [], (point, [e.reservation_id for e in mine])
            else:
                (entry,) = mine
                assert written.reservation_id == entry.reservation_id, point
                assert entry.end_date == NOW + timedelta(hours=HOURS)
                assert entry.tags[TAG_KEY] == f"{HELD_PREFIX}us-west-2"
                assert any("is held and written to the stack file" in note
                           for note in getattr(caught.value, "__notes__", [])), point
            # Whatever else is active ends by itself soon, unless it is the held one.
            for entry in ec2.active():
                if entry.tags.get(TAG_KEY, "").startswith(HELD_PREFIX):
                    continue
                assert entry.end_date <= NOW + SAFETY_LIFETIME


def test_the_report_names_the_held_reservation_its_idle_cost_and_the_way_out(tmp_path):
    request = ProbeRequest(instance_type="g6.12xlarge", node_count=2, regions=("us-west-2",),
                           reserve=True, hold_hours=HOURS)
    report = RegionReport(region="us-west-2", facts=G6, quota=QUOTA_OK,
                          instance_type="g6.12xlarge",
                          zones=(ZoneOffer(name="us-west-2a", zone_id="usw2-az2", offered=True),))
    attempt = ReservationAttempt(region="us-west-2", zone="us-west-2a", zone_id="usw2-az2",
                                 outcome=AttemptOutcome.PROVEN, reservation_id=HELD,
                                 instance_type="g6.12xlarge", held=True)
    held = GpuReservation(reservation_id=HELD, kind="on-demand", instance_type="g6.12xlarge",
                          availability_zone="us-west-2a", instance_count=2, start=NOW,
                          end=NOW + timedelta(hours=HOURS))
    placement = choose_placement((), (attempt,), request=request)
    result = ProbeResult(request=request, reports=(report,), candidates=(),
                         reservations=ReservationRun(attempts=(attempt,)), placement=placement,
                         reasons=(), exit_code=0, stack="us-west-2", held=held)
    out = io.StringIO()
    print_human(result, out=Console(file=out, width=250), err=Console(file=io.StringIO()))
    text = out.getvalue()
    assert f"proven ({HELD}, held)" in text
    assert f"Held On-Demand Capacity Reservation {HELD} until 2026-01-01T20:00:00Z" in text
    assert "about 9.20 USD/hour" in text and "capacity release --stack us-west-2" in text
    doc = json.loads(as_json(result))
    assert doc["held"] == {"reservation_id": HELD, "end": "2026-01-01T20:00:00Z"}


def test_a_denied_tagging_permission_stops_the_hold_before_anything_is_created(api, ec2,
                                                                                tmp_path):
    path = stack_path(tmp_path)
    ec2.add_client_error("create_capacity_reservation", "DryRunOperation", "", 412,
                         expected_params={**create_params("us-west-2a"), "DryRun": True})
    ec2.add_client_error("cancel_capacity_reservation", "DryRunOperation", "", 412,
                         expected_params={"CapacityReservationId": ANY, "DryRun": True})
    ec2.add_client_error("modify_capacity_reservation",
                         "InvalidCapacityReservationId.NotFound", "no such reservation", 400)
    ec2.add_client_error("create_tags", "UnauthorizedOperation",
                         DENIED_MESSAGE.replace("CreateCapacityReservation", "CreateTags"), 403)
    keep = stack_keeper(api, stack="us-west-2", project_dir=tmp_path, node_count=2, hours=HOURS,
                        log=HeldLog())
    run = prove_capacity(api, candidates=(cand(),), instance_type="g6.12xlarge", count=2,
                         keep=keep)
    (attempt,) = run.attempts
    assert attempt.outcome is AttemptOutcome.DENIED and attempt.reservation_id == ""
    assert "ec2:CreateTags" in attempt.detail and "DryRun preflight" in attempt.detail
    assert path.read_text() == COMMITTED
