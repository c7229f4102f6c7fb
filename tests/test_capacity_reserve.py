"""Capacity reservations: create-and-cancel never leaks, errors are classified (botocore Stubber;
moto does not implement capacity reservations)."""

from __future__ import annotations

import os
import signal
from datetime import datetime, timezone

import pytest
from botocore.stub import ANY, Stubber

from capacity.aws import AwsApi
from capacity.probe import AttemptOutcome, Candidate, Evidence
from capacity.reserve import SAFETY_LIFETIME, TAG_KEY, prove_capacity, reserve_and_cancel

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
DENIED_MESSAGE = ("You are not authorized to perform this operation. User: "
                  "arn:aws:iam::123456789012:user/dev is not authorized to perform: "
                  "ec2:CreateCapacityReservation on resource: arn:aws:ec2:us-west-2:123456789012:"
                  "capacity-reservation/*")


class Recorder:
    def __init__(self) -> None:
        self.sleeps: list[float] = []
        self.on_sleep = lambda seconds: None

    def __call__(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.on_sleep(seconds)


@pytest.fixture
def sleep() -> Recorder:
    return Recorder()


@pytest.fixture
def api(sleep: Recorder, fake_aws_session) -> AwsApi:
    return AwsApi(session=fake_aws_session, sleep=sleep, now=lambda: NOW)


class Ec2Stubs:
    """Creates go through the client that never retries; every other call through the other."""

    def __init__(self, api: AwsApi, region: str = "us-west-2"):
        self.calls = Stubber(api.client("ec2", region))
        self.creates = Stubber(api.client("ec2", region, retry=False))

    def _pick(self, method: str) -> Stubber:
        return self.creates if method == "create_capacity_reservation" else self.calls

    def add_response(self, method: str, *args, **kwargs) -> None:
        self._pick(method).add_response(method, *args, **kwargs)

    def add_client_error(self, method: str, *args, **kwargs) -> None:
        self._pick(method).add_client_error(method, *args, **kwargs)

    def __enter__(self) -> "Ec2Stubs":
        self.calls.activate()
        self.creates.activate()
        return self

    def __exit__(self, *exc) -> None:
        self.calls.deactivate()
        self.creates.deactivate()

    def assert_no_pending_responses(self) -> None:
        self.calls.assert_no_pending_responses()
        self.creates.assert_no_pending_responses()


@pytest.fixture
def ec2(api: AwsApi):
    with Ec2Stubs(api) as stubs:
        yield stubs
        stubs.assert_no_pending_responses()


def cand(zone: str, zone_id: str, region: str = "us-west-2") -> Candidate:
    return Candidate(region=region, zone=zone, zone_id=zone_id, evidence=Evidence.QUOTA_OK)


def reservation(rid: str, zone: str, state: str = "active") -> dict:
    return {"CapacityReservationId": rid, "State": state, "AvailabilityZone": zone}


def stub_preflight_ok(stub: Ec2Stubs, *, leftovers: tuple[dict, ...] = ()) -> None:
    stub.add_client_error("create_capacity_reservation", "DryRunOperation",
                          "Request would have succeeded, but DryRun flag is set.", 412,
                          expected_params={**create_params("us-west-2a"), "DryRun": True})
    stub.add_client_error("cancel_capacity_reservation", "DryRunOperation", "", 412,
                          expected_params={"CapacityReservationId": ANY, "DryRun": True})
    stub.add_response("describe_capacity_reservations",
                      {"CapacityReservations": list(leftovers)},
                      expected_params={"Filters": [{"Name": "tag-key", "Values": [TAG_KEY]},
                                                   {"Name": "state",
                                                    "Values": ["active", "pending"]}]})


def create_params(zone: str, count: int = 2) -> dict:
    return {"ClientToken": ANY, "InstanceType": "g6.12xlarge", "InstancePlatform": "Linux/UNIX",
            "AvailabilityZone": zone, "InstanceCount": count, "Tenancy": "default",
            "InstanceMatchCriteria": "targeted", "EndDateType": "limited",
            "EndDate": NOW + SAFETY_LIFETIME, "TagSpecifications": ANY, "DryRun": False}


def stub_cancel(stub: Ec2Stubs, rid: str) -> None:
    stub.add_response("cancel_capacity_reservation", {"Return": True},
                      expected_params={"CapacityReservationId": rid, "DryRun": False})


def test_no_capacity_in_first_az_then_success_in_next(api, ec2):
    stub_preflight_ok(ec2)
    ec2.add_client_error("create_capacity_reservation", "InsufficientInstanceCapacity",
                         "We currently do not have sufficient g6.12xlarge capacity in the "
                         "Availability Zone you requested (us-west-2a).", 500,
                         expected_params=create_params("us-west-2a"))
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-0b", "us-west-2b")},
                     expected_params=create_params("us-west-2b"))
    stub_cancel(ec2, "cr-0b")
    run = prove_capacity(api, candidates=(cand("us-west-2a", "usw2-az2"),
                                          cand("us-west-2b", "usw2-az1")),
                         instance_type="g6.12xlarge", count=2)
    first, second = run.attempts
    assert first.outcome is AttemptOutcome.NO_CAPACITY
    assert "InsufficientInstanceCapacity" in first.detail and first.reservation_id == ""
    assert second.outcome is AttemptOutcome.PROVEN
    assert (second.zone, second.reservation_id, second.cancelled) == ("us-west-2b", "cr-0b", True)
    assert run.leaked == ()


def test_reservation_is_tagged_with_a_limited_end_date_and_a_client_token(api, ec2):
    sent: list[dict] = []
    api.client("ec2", "us-west-2", retry=False).meta.events.register(
        "provide-client-params.ec2.CreateCapacityReservation",
        lambda params, **_: sent.append(dict(params)))
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-1", "us-west-2a")},
                     expected_params=create_params("us-west-2a"))
    stub_cancel(ec2, "cr-1")
    attempt = reserve_and_cancel(api, candidate=cand("us-west-2a", "usw2-az2"),
                                 instance_type="g6.12xlarge", count=2)
    assert attempt.outcome is AttemptOutcome.PROVEN and attempt.cancelled
    (params,) = sent
    assert params["EndDateType"] == "limited" and params["EndDate"] == NOW + SAFETY_LIFETIME
    tags = {t["Key"]: t["Value"] for t in params["TagSpecifications"][0]["Tags"]}
    assert params["TagSpecifications"][0]["ResourceType"] == "capacity-reservation"
    assert tags[TAG_KEY] == params["ClientToken"] and len(params["ClientToken"]) == 36


def test_cancel_failing_is_retried_then_reported_as_leaked(api, ec2, sleep):
    stub_preflight_ok(ec2)
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-2", "us-west-2a")},
                     expected_params=create_params("us-west-2a"))
    for _ in range(4):
        ec2.add_client_error("cancel_capacity_reservation", "InternalError", "try again", 400,
                             expected_params={"CapacityReservationId": "cr-2", "DryRun": False})
    run = prove_capacity(api, candidates=(cand("us-west-2a", "usw2-az2"),),
                         instance_type="g6.12xlarge", count=2)
    (attempt,) = run.attempts
    assert attempt.outcome is AttemptOutcome.PROVEN and not attempt.cancelled
    assert run.leaked == ("cr-2",)
    assert "cancel failed" in attempt.detail and "ends by itself" in attempt.detail
    assert sleep.sleeps == [2.0, 4.0, 8.0]


def test_interrupt_while_waiting_for_a_pending_reservation_still_cancels(api, ec2, sleep):
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-3", "us-west-2a", "pending")},
                     expected_params=create_params("us-west-2a"))
    stub_cancel(ec2, "cr-3")

    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    sleep.on_sleep = interrupt
    with pytest.raises(KeyboardInterrupt):
        reserve_and_cancel(api, candidate=cand("us-west-2a", "usw2-az2"),
                           instance_type="g6.12xlarge", count=2)


def test_sigterm_between_create_and_cancel_still_cancels(api, ec2, sleep):
    stub_preflight_ok(ec2)
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-4", "us-west-2a", "pending")},
                     expected_params=create_params("us-west-2a"))
    stub_cancel(ec2, "cr-4")
    sleep.on_sleep = lambda _: os.kill(os.getpid(), signal.SIGTERM)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        prove_capacity(api, candidates=(cand("us-west-2a", "usw2-az2"),),
                       instance_type="g6.12xlarge", count=2)
    assert signal.getsignal(signal.SIGTERM) is before


def test_interrupt_before_the_create_answer_arrives_finds_the_reservation_by_tag(api, ec2):
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-5", "us-west-2a")},
                     expected_params=create_params("us-west-2a"))
    ec2.add_response("describe_capacity_reservations",
                     {"CapacityReservations": [reservation("cr-5", "us-west-2a")]},
                     expected_params={"Filters": [{"Name": f"tag:{TAG_KEY}", "Values": ANY},
                                                  {"Name": "state",
                                                   "Values": ["active", "pending"]}]})
    stub_cancel(ec2, "cr-5")

    def interrupt(**_):
        raise KeyboardInterrupt

    api.client("ec2", "us-west-2", retry=False).meta.events.register(
        "after-call.ec2.CreateCapacityReservation", interrupt)
    with pytest.raises(KeyboardInterrupt):
        reserve_and_cancel(api, candidate=cand("us-west-2a", "usw2-az2"),
                           instance_type="g6.12xlarge", count=2)


def test_a_signal_during_the_cancel_is_held_until_the_cancel_is_done(api, ec2):
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-6", "us-west-2a")},
                     expected_params=create_params("us-west-2a"))
    stub_cancel(ec2, "cr-6")
    cancelled: list[bool] = []

    def sigint_then_note(**_):
        os.kill(os.getpid(), signal.SIGINT)
        cancelled.append(True)

    api.client("ec2", "us-west-2").meta.events.register(
        "after-call.ec2.CancelCapacityReservation", sigint_then_note)
    with pytest.raises(KeyboardInterrupt):
        reserve_and_cancel(api, candidate=cand("us-west-2a", "usw2-az2"),
                           instance_type="g6.12xlarge", count=2)
    assert cancelled == [True]


def test_permission_denied_in_the_dry_run_names_the_iam_action_and_creates_nothing(api, ec2):
    ec2.add_client_error("create_capacity_reservation", "UnauthorizedOperation", DENIED_MESSAGE,
                         403, expected_params={**create_params("us-west-2a"), "DryRun": True})
    run = prove_capacity(api, candidates=(cand("us-west-2a", "usw2-az2"),
                                          cand("us-west-2b", "usw2-az1")),
                         instance_type="g6.12xlarge", count=2)
    (attempt,) = run.attempts
    assert attempt.outcome is AttemptOutcome.DENIED
    assert "ec2:CreateCapacityReservation" in attempt.detail and "DryRun" in attempt.detail


def test_denied_cancel_permission_stops_before_creating(api, ec2):
    ec2.add_client_error("create_capacity_reservation", "DryRunOperation", "", 412,
                         expected_params={**create_params("us-west-2a"), "DryRun": True})
    # An encoded authorization message does not name the action: the called operation does.
    ec2.add_client_error("cancel_capacity_reservation", "UnauthorizedOperation",
                         "You are not authorized to perform this operation. Encoded "
                         "authorization failure message: AbC123", 403,
                         expected_params={"CapacityReservationId": ANY, "DryRun": True})
    run = prove_capacity(api, candidates=(cand("us-west-2a", "usw2-az2"),),
                         instance_type="g6.12xlarge", count=2)
    (attempt,) = run.attempts
    assert attempt.outcome is AttemptOutcome.DENIED
    assert "ec2:CancelCapacityReservation" in attempt.detail


def test_leftovers_of_earlier_runs_are_swept_first(api, ec2):
    stub_preflight_ok(ec2, leftovers=(reservation("cr-old", "us-west-2c"),))
    stub_cancel(ec2, "cr-old")
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-7", "us-west-2a")},
                     expected_params=create_params("us-west-2a"))
    stub_cancel(ec2, "cr-7")
    run = prove_capacity(api, candidates=(cand("us-west-2a", "usw2-az2"),),
                         instance_type="g6.12xlarge", count=2)
    assert run.swept == ("cr-old",)
    assert run.attempts[0].outcome is AttemptOutcome.PROVEN


def test_quota_exceeded_skips_the_rest_of_the_region(api, ec2):
    stub_preflight_ok(ec2)
    ec2.add_client_error("create_capacity_reservation", "InstanceLimitExceeded",
                         "You have requested more vCPU capacity than your current vCPU limit",
                         400, expected_params=create_params("us-west-2a"))
    with Ec2Stubs(api, "us-east-1") as east_stub:
        east_stub.add_client_error("create_capacity_reservation", "DryRunOperation", "", 412,
                                   expected_params={**create_params("us-east-1a"), "DryRun": True})
        east_stub.add_client_error("cancel_capacity_reservation", "DryRunOperation", "", 412,
                                   expected_params={"CapacityReservationId": ANY, "DryRun": True})
        east_stub.add_response("describe_capacity_reservations", {"CapacityReservations": []},
                               expected_params={"Filters": ANY})
        east_stub.add_response("create_capacity_reservation",
                               {"CapacityReservation": reservation("cr-8", "us-east-1a")},
                               expected_params=create_params("us-east-1a"))
        east_stub.add_response("cancel_capacity_reservation", {"Return": True},
                               expected_params={"CapacityReservationId": "cr-8", "DryRun": False})
        run = prove_capacity(api, candidates=(cand("us-west-2a", "usw2-az2"),
                                              cand("us-west-2b", "usw2-az1"),
                                              cand("us-east-1a", "use1-az1", "us-east-1")),
                             instance_type="g6.12xlarge", count=2)
        east_stub.assert_no_pending_responses()
    assert [a.outcome for a in run.attempts] == [AttemptOutcome.QUOTA, AttemptOutcome.SKIPPED,
                                                 AttemptOutcome.PROVEN]


def test_pending_reservation_that_turns_active_is_proven(api, ec2, sleep):
    ec2.add_response("create_capacity_reservation",
                     {"CapacityReservation": reservation("cr-9", "us-west-2a", "pending")},
                     expected_params=create_params("us-west-2a"))
    ec2.add_response("describe_capacity_reservations",
                     {"CapacityReservations": [reservation("cr-9", "us-west-2a")]},
                     expected_params={"CapacityReservationIds": ["cr-9"]})
    stub_cancel(ec2, "cr-9")
    attempt = reserve_and_cancel(api, candidate=cand("us-west-2a", "usw2-az2"),
                                 instance_type="g6.12xlarge", count=2)
    assert attempt.outcome is AttemptOutcome.PROVEN and attempt.cancelled
    assert sleep.sleeps == [2.0]


def test_a_cancel_permission_that_cannot_be_confirmed_creates_nothing_in_that_region(api, ec2):
    ec2.add_client_error("create_capacity_reservation", "DryRunOperation", "", 412,
                         expected_params={**create_params("us-west-2a"), "DryRun": True})
    ec2.add_client_error("cancel_capacity_reservation", "InternalError", "boom", 500,
                         expected_params={"CapacityReservationId": ANY, "DryRun": True})
    run = prove_capacity(api, candidates=(cand("us-west-2a", "usw2-az2"),
                                          cand("us-west-2b", "usw2-az1")),
                         instance_type="g6.12xlarge", count=2)
    assert [a.outcome for a in run.attempts] == [AttemptOutcome.FAILED, AttemptOutcome.FAILED]
    assert all("DryRun preflight: InternalError" in a.detail for a in run.attempts)


def test_the_create_is_sent_once_so_no_capacity_moves_on_at_once(api):
    # EC2 answers InsufficientInstanceCapacity with a 5xx, which standard retries would repeat.
    create_client = api.client("ec2", "us-west-2", retry=False)
    assert create_client.meta.config.retries["total_max_attempts"] == 1
    assert "total_max_attempts" not in api.client("ec2", "us-west-2").meta.config.retries
