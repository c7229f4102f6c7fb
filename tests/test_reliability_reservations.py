"""No reservation is ever leaked: SIGINT and SIGTERM are delivered at every point between the
probe's first reservation call and its last cancel, and the ledger of what EC2 holds is checked
after each.

In process, the real `AwsApi` and `capacity.reserve` run over a fake EC2 client (the session seam):
it keeps a ledger of every reservation and raises a real signal (`signal.raise_signal`) before a
call reaches EC2, after EC2 acted but before the answer is read, or during a sleep. The points are
not listed by hand: each scenario runs once to record its trace of calls, then once per point.

End to end, `python -m capacity probe --reserve` runs as a subprocess against a moto server on
127.0.0.1. moto has no capacity reservations, so a small proxy in front of it answers the three
reservation calls from its own ledger (and holds a chosen call open) and forwards the rest to moto.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator
from urllib.parse import parse_qs

import pytest
from botocore.exceptions import ClientError
from interrupts import sigint_at_default
from moto.server import ThreadedMotoServer

from capacity.aws import AwsApi
from capacity.bench_probe import free_port
from capacity.probe import AttemptOutcome, Candidate, Evidence
from capacity.reserve import CANCEL_TRIES, SAFETY_LIFETIME, TAG_KEY, prove_capacity

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
REGION = "us-west-2"
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
_API_NAMES = {"create_capacity_reservation": "CreateCapacityReservation",
              "cancel_capacity_reservation": "CancelCapacityReservation",
              "describe_capacity_reservations": "DescribeCapacityReservations"}


# --- an in-memory EC2 that keeps the ledger ------------------------------------------------------

@dataclass
class Entry:
    """One reservation as EC2 holds it."""

    reservation_id: str
    zone: str
    state: str
    end_date: datetime
    end_date_type: str
    tags: dict[str, str]
    polls_left: int = 0
    """Describes by ID still answering `pending` before it turns active."""


@dataclass
class Behaviour:
    """What EC2 does in one scenario."""

    pending_polls: int = 0
    """Describes that answer `pending` after the create."""
    cancel_failures: int = 0
    """Cancels (not DryRun) that fail with InternalError before one succeeds."""
    no_capacity_zones: frozenset[str] = frozenset()
    """Zones whose create fails with InsufficientInstanceCapacity."""
    leftovers: tuple[str, ...] = ()
    """Active reservations an earlier run tagged and never cancelled."""


Hook = Callable[[int, str, str], None]
"""hook(call index, operation, phase): phase is before, after or sleep."""


def _error(operation: str, code: str, message: str = "", status: int = 400) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, _API_NAMES[operation])


@dataclass
class FakeEc2:
    """The reservation calls `capacity.aws.AwsApi` makes, answered from a ledger. `hook` runs at
    each call before the ledger changes and after it changed (the answer not yet returned)."""

    behaviour: Behaviour
    hook: Hook
    ledger: dict[str, Entry] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)
    slept: list[float] = field(default_factory=list)
    meta: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(
        method_to_api_mapping=dict(_API_NAMES)))
    _tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, rid in enumerate(self.behaviour.leftovers):
            self.ledger[rid] = Entry(reservation_id=rid, zone=f"{REGION}c", state="active",
                                     end_date=NOW + SAFETY_LIFETIME, end_date_type="limited",
                                     tags={TAG_KEY: f"earlier-run-{i}"})

    def _enter(self, operation: str) -> int:
        self.trace.append(operation)
        index = len(self.trace) - 1
        self.hook(index, operation, "before")
        return index

    def create_capacity_reservation(self, **kw) -> dict:
        op = "create_capacity_reservation"
        if kw["DryRun"]:
            index = self._enter("create_dry_run")
            self.hook(index, "create_dry_run", "after")
            raise _error(op, "DryRunOperation", "Request would have succeeded", 412)
        index = self._enter("create")
        if kw["AvailabilityZone"] in self.behaviour.no_capacity_zones:
            self.hook(index, "create", "after")
            raise _error(op, "InsufficientInstanceCapacity", "no capacity", 500)
        rid = self._tokens.get(kw["ClientToken"])
        if rid is None:  # the client token makes a repeated create return the same reservation
            rid = f"cr-{len(self.ledger):017x}"
            self._tokens[kw["ClientToken"]] = rid
            tags = {t["Key"]: t["Value"] for t in kw["TagSpecifications"][0]["Tags"]}
            polls = self.behaviour.pending_polls
            self.ledger[rid] = Entry(reservation_id=rid, zone=kw["AvailabilityZone"],
                                     state="pending" if polls else "active",
                                     end_date=kw["EndDate"], end_date_type=kw["EndDateType"],
                                     tags=tags, polls_left=polls)
        self.hook(index, "create", "after")
        return {"CapacityReservation": self._shape(self.ledger[rid])}

    def describe_capacity_reservations(self, **kw) -> dict:
        index = self._enter("describe")
        if "CapacityReservationIds" in kw:
            found = [self.ledger[rid] for rid in kw["CapacityReservationIds"]]
            for entry in found:
                if entry.state == "pending":
                    entry.polls_left -= 1
                    entry.state = "pending" if entry.polls_left > 0 else "active"
        else:
            found = [e for e in self.ledger.values() if _matches(e, kw["Filters"])]
        shapes = [self._shape(e) for e in found]
        self.hook(index, "describe", "after")
        return {"CapacityReservations": shapes}

    def cancel_capacity_reservation(self, **kw) -> dict:
        op = "cancel_capacity_reservation"
        if kw["DryRun"]:
            index = self._enter("cancel_dry_run")
            self.hook(index, "cancel_dry_run", "after")
            raise _error(op, "DryRunOperation", "Request would have succeeded", 412)
        failing = self.behaviour.cancel_failures > 0
        index = self._enter("cancel_failing" if failing else "cancel")
        entry = self.ledger.get(kw["CapacityReservationId"])
        if failing:
            self.behaviour.cancel_failures -= 1
            self.hook(index, "cancel_failing", "after")
            raise _error(op, "InternalError", "An internal error has occurred", 500)
        if entry is None:
            self.hook(index, "cancel", "after")
            raise _error(op, "InvalidCapacityReservationId.NotFound", "not found")
        entry.state = "cancelled"
        self.hook(index, "cancel", "after")
        return {"Return": True}

    @staticmethod
    def _shape(entry: Entry) -> dict:
        return {"CapacityReservationId": entry.reservation_id, "State": entry.state,
                "AvailabilityZone": entry.zone}

    def active(self) -> list[Entry]:
        return [e for e in self.ledger.values() if e.state in ("active", "pending")]


def _matches(entry: Entry, filters: list[dict]) -> bool:
    for f in filters:
        name, values = f["Name"], f["Values"]
        if name == "tag-key" and not set(values) & set(entry.tags):
            return False
        if name.startswith("tag:") and entry.tags.get(name[4:]) not in values:
            return False
        if name == "state" and entry.state not in values:
            return False
    return True


# --- scenarios and their interrupt points --------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    """A probe run: which AZs are tried and how EC2 behaves."""

    zones: tuple[str, ...]
    behaviour: Callable[[], Behaviour]
    cancel_always_fails: bool = False


SCENARIOS = {
    "pending-then-active": Scenario(zones=("a",), behaviour=lambda: Behaviour(pending_polls=2)),
    "first-cancel-fails": Scenario(zones=("a",), behaviour=lambda: Behaviour(cancel_failures=1)),
    "no-capacity-then-next-az": Scenario(
        zones=("a", "b"), behaviour=lambda: Behaviour(no_capacity_zones=frozenset({f"{REGION}a"}))),
    "leftover-swept-first": Scenario(zones=("a",),
                                     behaviour=lambda: Behaviour(leftovers=("cr-earlier",))),
    "cancel-always-fails": Scenario(zones=("a",),
                                    behaviour=lambda: Behaviour(cancel_failures=10 ** 6),
                                    cancel_always_fails=True),
}


class Sleeper:
    """api.sleep: records and reports each sleep to the hook (index in the shared trace)."""

    def __init__(self, ec2: FakeEc2) -> None:
        self.ec2 = ec2

    def __call__(self, seconds: float) -> None:
        self.ec2.slept.append(seconds)
        self.ec2.trace.append("sleep")
        self.ec2.hook(len(self.ec2.trace) - 1, "sleep", "sleep")


def make_api(ec2: FakeEc2) -> AwsApi:
    session = SimpleNamespace(client=lambda service, region_name, config: ec2)
    return AwsApi(session=session, sleep=Sleeper(ec2), now=lambda: NOW)  # type: ignore[arg-type]


def candidates(scenario: Scenario) -> tuple[Candidate, ...]:
    return tuple(Candidate(region=REGION, zone=f"{REGION}{z}", zone_id=f"usw2-az{i + 1}",
                           evidence=Evidence.QUOTA_OK) for i, z in enumerate(scenario.zones))


def run_probe(scenario: Scenario, ec2: FakeEc2):
    return prove_capacity(make_api(ec2), candidates=candidates(scenario),
                          instance_type="g6.12xlarge", count=2)


def interrupt_points(scenario: Scenario) -> list[tuple[int, str, str]]:
    """Every (call index, operation, phase) of the scenario's uninterrupted run."""
    ec2 = FakeEc2(behaviour=scenario.behaviour(), hook=lambda *_: None)
    run_probe(scenario, ec2)
    phases = {"sleep": ("sleep",)}
    return [(i, op, phase) for i, op in enumerate(ec2.trace)
            for phase in phases.get(op, ("before", "after"))]


POINTS = [(name, sig, point) for name, scenario in SCENARIOS.items()
          for point in interrupt_points(scenario) for sig in SIGNALS]


class SignalEscaped(Exception):
    """SIGTERM reached the test's own handler: the probe's handler was not installed."""


@pytest.fixture
def guarded_handlers() -> Iterator[dict]:
    """SIGINT as in any Python process (KeyboardInterrupt); SIGTERM, whose default would end the
    test process, fails the test instead when the probe has not installed its own handler."""
    def escaped(signum: int, _frame: object) -> None:
        raise SignalEscaped(signal.Signals(signum).name)

    before = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
              signal.SIGTERM: signal.signal(signal.SIGTERM, escaped)}
    installed = {s: signal.getsignal(s) for s in SIGNALS.values()}
    yield installed
    for s, handler in before.items():
        signal.signal(s, handler)


def assert_nothing_of_this_run_left_active(ec2: FakeEc2, scenario: Scenario) -> None:
    mine = [e for e in ec2.active() if not e.tags[TAG_KEY].startswith("earlier-run")]
    if not scenario.cancel_always_fails:
        assert mine == [], f"left active: {[e.reservation_id for e in mine]}"
    # Whatever is still active (a cancel AWS kept refusing) ends by itself shortly.
    for entry in ec2.active():
        assert entry.end_date_type == "limited" and entry.end_date <= NOW + SAFETY_LIFETIME


def assert_next_run_sweeps_everything(ec2: FakeEc2, scenario: Scenario) -> tuple[str, ...]:
    """A later probe, with EC2 cancelling again, finds and cancels whatever was left."""
    ec2.behaviour.cancel_failures = 0
    ec2.hook = lambda *_: None
    left = {e.reservation_id for e in ec2.active()}
    run = run_probe(scenario, ec2)
    assert set(run.swept) == left and run.leaked == ()
    assert ec2.active() == []
    return run.swept


@pytest.mark.parametrize(("scenario_name", "sig", "point"), POINTS,
                         ids=[f"{n}-{s}-{i}:{op}:{ph}" for n, s, (i, op, ph) in POINTS])
def test_a_signal_at_any_point_leaves_no_reservation_active(scenario_name, sig, point,
                                                            guarded_handlers):
    scenario = SCENARIOS[scenario_name]
    index, operation, phase = point

    def hook(i: int, op: str, ph: str) -> None:
        if (i, op, ph) == (index, operation, phase):
            signal.raise_signal(SIGNALS[sig])

    ec2 = FakeEc2(behaviour=scenario.behaviour(), hook=hook)
    with pytest.raises(KeyboardInterrupt):
        run_probe(scenario, ec2)
    assert {s: signal.getsignal(s) for s in SIGNALS.values()} == guarded_handlers
    assert_nothing_of_this_run_left_active(ec2, scenario)
    assert_next_run_sweeps_everything(ec2, scenario)


_LAST_CALL = {name: max(i for i, _, _ in interrupt_points(s)) for name, s in SCENARIOS.items()}
SECOND_SIGNAL_AFTER = [(name, sig, point) for name, sig, point in POINTS
                       if point[1] in ("create", "cancel_failing", "sleep")
                       and point[0] < _LAST_CALL[name]]


@pytest.mark.parametrize(("scenario_name", "sig", "first"), SECOND_SIGNAL_AFTER,
                         ids=[f"{n}-{s}-{i}:{op}:{ph}"
                              for n, s, (i, op, ph) in SECOND_SIGNAL_AFTER])
def test_a_second_signal_during_the_cleanup_changes_nothing(scenario_name, sig, first,
                                                            guarded_handlers):
    """Ctrl-C pressed again (or SIGTERM after SIGINT) while the interrupted probe looks the
    reservation up by its tag or cancels it: at every call of that cleanup."""
    scenario = SCENARIOS[scenario_name]
    other = signal.SIGTERM if SIGNALS[sig] == signal.SIGINT else signal.SIGINT

    def run_with(second: tuple[int, str, str] | None) -> FakeEc2:
        def hook(i: int, op: str, ph: str) -> None:
            if (i, op, ph) == first:
                signal.raise_signal(SIGNALS[sig])
            elif (i, op, ph) == second:
                signal.raise_signal(other)

        ec2 = FakeEc2(behaviour=scenario.behaviour(), hook=hook)
        with pytest.raises(KeyboardInterrupt):
            run_probe(scenario, ec2)
        return ec2

    cleanup = run_with(None).trace[first[0] + 1:]
    assert cleanup, "the interrupted probe made no call to clean up"
    offset = first[0] + 1
    for j, op in enumerate(cleanup):
        for phase in ("sleep",) if op == "sleep" else ("before", "after"):
            ec2 = run_with((offset + j, op, phase))
            assert {s: signal.getsignal(s) for s in SIGNALS.values()} == guarded_handlers
            assert_nothing_of_this_run_left_active(ec2, scenario)
            assert_next_run_sweeps_everything(ec2, scenario)


def test_every_kind_of_point_is_covered():
    kinds = {(op, phase) for _, _, (_, op, phase) in POINTS}
    assert {("create", "before"), ("create", "after"), ("describe", "after"), ("sleep", "sleep"),
            ("cancel", "before"), ("cancel", "after"), ("cancel_failing", "before"),
            ("cancel_failing", "after"), ("create_dry_run", "after"),
            ("cancel_dry_run", "after")} <= kinds
    assert len(POINTS) >= 100


def test_a_cancel_that_keeps_failing_names_the_reservation_and_relies_on_its_end_date():
    scenario = SCENARIOS["cancel-always-fails"]
    ec2 = FakeEc2(behaviour=scenario.behaviour(), hook=lambda *_: None)
    run = run_probe(scenario, ec2)
    (attempt,) = run.attempts
    (entry,) = ec2.active()
    assert ec2.trace.count("cancel_failing") == CANCEL_TRIES and ec2.slept == [2.0, 4.0, 8.0]
    assert run.leaked == (entry.reservation_id,) == (attempt.reservation_id,)
    assert not attempt.cancelled and attempt.outcome is AttemptOutcome.PROVEN
    assert entry.reservation_id in attempt.detail and "ends by itself" in attempt.detail
    assert (entry.end_date_type, entry.end_date) == ("limited", NOW + timedelta(minutes=30))
    assert entry.tags[TAG_KEY] != "preflight"
    assert assert_next_run_sweeps_everything(ec2, scenario) == (entry.reservation_id,)


# --- the real CLI, interrupted as a process ------------------------------------------------------

_EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"


class ReservationProxy:
    """An endpoint for the CLI: the reservation calls answered from a ledger, the rest forwarded to
    moto. `hold` names the call ("create" or "cancel") kept open until `release` is set."""

    def __init__(self, moto_url: str) -> None:
        self.moto = moto_url.removeprefix("http://")
        self.ledger: dict[str, dict[str, str]] = {}
        self.hold = ""
        self.held = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.forward(b"")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                form = {k: v[0] for k, v in parse_qs(body.decode(errors="replace")).items()}
                answer = proxy.answer(form) if "CapacityReservation" in form.get("Action", "") \
                    else None
                if answer is None:
                    self.forward(body)
                    return
                status, xml = answer
                self.send_response(status)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                try:
                    self.wfile.write(xml)
                except OSError:  # the client went away while the call was held
                    pass

            def forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(proxy.moto, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length",
                                         "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self, *, hold: str) -> None:
        self.ledger.clear()
        self.hold = hold
        self.held.clear()
        self.release.clear()

    def active(self) -> list[str]:
        return [rid for rid, r in self.ledger.items() if r["state"] == "active"]

    def _wait_if_held(self, call: str) -> None:
        if self.hold == call:
            self.held.set()
            self.release.wait(timeout=60)

    def answer(self, form: dict[str, str]) -> tuple[int, bytes] | None:
        action, dry_run = form["Action"], form.get("DryRun") == "true"
        if dry_run:
            return 412, _ec2_error("DryRunOperation", "Request would have succeeded")
        if action == "CreateCapacityReservation":
            tags = {form[k]: form[k.replace(".Key", ".Value")] for k in form
                    if k.startswith("TagSpecifications.1.Tag.") and k.endswith(".Key")}
            with self.lock:
                rid = f"cr-{len(self.ledger):017x}"
                self.ledger[rid] = {"state": "active", "zone": form["AvailabilityZone"],
                                    "token": tags.get(TAG_KEY, ""),
                                    "end_date_type": form.get("EndDateType", "")}
            self._wait_if_held("create")
            return 200, _ec2_body("CreateCapacityReservation",
                                  f"<capacityReservation>{_item(rid, self.ledger[rid])}"
                                  f"</capacityReservation>")
        if action == "DescribeCapacityReservations":
            wanted = _tag_filter(form)
            found = [(rid, r) for rid, r in self.ledger.items() if r["state"] == "active"
                     and (wanted is None or r["token"] == wanted)]
            items = "".join(f"<item>{_item(rid, r)}</item>" for rid, r in found)
            return 200, _ec2_body("DescribeCapacityReservations",
                                  f"<capacityReservationSet>{items}</capacityReservationSet>")
        if action == "CancelCapacityReservation":
            self._wait_if_held("cancel")
            entry = self.ledger.get(form["CapacityReservationId"])
            if entry is None:
                return 400, _ec2_error("InvalidCapacityReservationId.NotFound", "not found")
            entry["state"] = "cancelled"
            return 200, _ec2_body("CancelCapacityReservation", "<return>true</return>")
        return None


def _tag_filter(form: dict[str, str]) -> str | None:
    """The value of a `tag:<TAG_KEY>` filter, None when the call asks for any tag value."""
    for key, name in form.items():
        if key.startswith("Filter.") and key.endswith(".Name") and name == f"tag:{TAG_KEY}":
            return form[key.replace(".Name", ".Value.1")]
    return None


def _item(rid: str, entry: dict[str, str]) -> str:
    return (f"<capacityReservationId>{rid}</capacityReservationId><state>{entry['state']}</state>"
            f"<availabilityZone>{entry['zone']}</availabilityZone>")


def _ec2_body(action: str, inner: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><{action}Response xmlns="{_EC2_NS}">'
            f"<requestId>r-1</requestId>{inner}</{action}Response>").encode()


def _ec2_error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error></Errors><RequestID>r-1</RequestID>"
            f"</Response>").encode()


@pytest.fixture(scope="module")
def proxy() -> Iterator[ReservationProxy]:
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    front = ReservationProxy(f"http://127.0.0.1:{port}")
    yield front
    front.release.set()
    front.server.shutdown()
    moto.stop()


def _signal_delivered(pid: int) -> bool:
    """Linux: no signal is pending for the process any more (its handler has taken it)."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = [line.split()[1] for line in status.splitlines()
               if line.startswith(("SigPnd:", "ShdPnd:"))]
    return all(int(mask, 16) == 0 for mask in pending)


@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("held", ["create", "cancel"])
def test_the_cli_interrupted_mid_reservation_exits_130_and_leaves_nothing(proxy, held, sig,
                                                                         repo_root, tmp_path):
    """held=create: the signal arrives after EC2 created the reservation but before the CLI read
    the answer, so the CLI must find it by its tag. held=cancel: the signal arrives during the
    cancel, which must finish first."""
    proxy.reset(hold=held)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "AWS_MAX_ATTEMPTS": "1", "AWS_ENDPOINT_URL": proxy.url, "PYTHONPATH": str(repo_root)}
    # Started as from a terminal, whatever SIGINT disposition the suite inherited (tests/interrupts.py).
    shutil.copy(repo_root / "Pulumi.yaml", tmp_path / "Pulumi.yaml")
    proc = subprocess.Popen([sys.executable, "-m", "capacity", "probe", "--regions", REGION,
                             "--reserve", "--dry-run"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_at_default)
    try:
        assert proxy.held.wait(timeout=60), "the CLI never reached the reservation call"
        proc.send_signal(SIGNALS[sig])
        deadline = time.monotonic() + 10
        while not _signal_delivered(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        proxy.release.set()
        out, err = proc.communicate(timeout=60)
    finally:
        proxy.release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert len(proxy.ledger) == 1 and proxy.active() == []
    (entry,) = proxy.ledger.values()
    assert entry["end_date_type"] == "limited"


@pytest.mark.parametrize("sig", sorted(SIGNALS))
def test_an_interrupt_names_a_reservation_it_could_not_cancel(sig, guarded_handlers):
    """Interrupted right after the create, with every cancel refused: the interrupt carries the
    reservation's id (the CLI prints it), and the reservation still ends by its end date."""
    scenario = SCENARIOS["cancel-always-fails"]
    (create_at,) = [i for i, op, ph in interrupt_points(scenario) if (op, ph) == ("create", "after")]

    def hook(i: int, op: str, ph: str) -> None:
        if (i, op, ph) == (create_at, "create", "after"):
            signal.raise_signal(SIGNALS[sig])

    ec2 = FakeEc2(behaviour=scenario.behaviour(), hook=hook)
    with pytest.raises(KeyboardInterrupt) as caught:
        run_probe(scenario, ec2)
    (entry,) = ec2.active()
    assert caught.value.__notes__ == [
        f"reservation {entry.reservation_id} in {REGION} could not be cancelled; it ends by itself "
        "within 0:30:00"]
    assert (entry.end_date_type, entry.end_date) == ("limited", NOW + timedelta(minutes=30))
