"""Prove capacity by creating an On-Demand Capacity Reservation and cancelling it at once.

A reservation bills from the moment it exists, so this module must never leak one:
- a DryRun preflight checks the create and cancel permissions for free, so a reservation is never
  created that the caller could not cancel;
- the cancel runs in `finally`, with SIGINT/SIGTERM deferred until it is done; SIGTERM is turned
  into an interrupt while the reservation is being made, so it reaches the `finally` too;
- when the create was interrupted before its answer arrived, the reservation is found by its tag;
- every reservation ends by itself (EndDateType=limited) shortly after, should all of that fail;
- reservations tagged by earlier runs that are still active are swept (cancelled) first;
- a client token makes a retried create idempotent.

With `--hold` (a `keep` callback), the proven reservation is kept instead: only then is its end
date moved out to the hold, its tag marked `held:<stack>` (which the sweep leaves alone) and the
stack file written, all with SIGINT/SIGTERM held back. The stack file is the commit point: a
reservation that did not get there is cancelled like any other, and one that did is named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterator

from capacity.aws import AwsApi, AwsFailure, FailureKind
from capacity.probe import AttemptOutcome, Candidate, ReservationAttempt

TAG_KEY = "ray-eks:capacity-probe"
"""Tag on every reservation the probe creates; its value is the attempt's client token, or
`held:<stack>` once `--hold` kept it for a stack."""
HELD_PREFIX = "held:"
PURPOSE_TAG = ("Purpose", "capacity probe; cancelled at once; safe to cancel")
SAFETY_LIFETIME = timedelta(minutes=30)
"""EndDate of every reservation: AWS ends it by itself even if every cancel failed."""
PENDING_POLLS = 10
POLL_INTERVAL_S = 2.0
CANCEL_TRIES = 4
_PLACEHOLDER_ID = "cr-00000000000000000"
_NO_PERMISSION = (FailureKind.DENIED, FailureKind.CREDENTIALS)

_OUTCOME = {
    FailureKind.NO_CAPACITY: AttemptOutcome.NO_CAPACITY,
    FailureKind.QUOTA: AttemptOutcome.QUOTA,
    FailureKind.UNSUPPORTED: AttemptOutcome.UNSUPPORTED,
    FailureKind.DENIED: AttemptOutcome.DENIED,
    FailureKind.CREDENTIALS: AttemptOutcome.DENIED,
}


@dataclass(frozen=True, kw_only=True)
class ReservationRun:
    """The attempts in rank order and the leftovers swept before them."""

    attempts: tuple[ReservationAttempt, ...]
    """One per AZ tried or skipped, in order."""
    swept: tuple[str, ...] = ()
    """IDs of reservations from earlier runs that were cancelled."""
    leaked: tuple[str, ...] = ()
    """IDs whose cancel failed: they end by themselves at their EndDate, or cancel them by hand."""
    sweep_errors: tuple[str, ...] = ()
    """Regions where looking for leftovers failed, with the reason."""


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt (as SIGINT does), so `finally` blocks run."""
    if not _in_main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block (a cancel) is done, then raise KeyboardInterrupt."""
    if not _in_main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        raise KeyboardInterrupt(f"signal {received[0]}")


def preflight(api: AwsApi, *, candidate: Candidate, instance_type: str, count: int,
              hold: bool = False) -> AwsFailure | None:
    """DryRun the create and the cancel (with `hold`, also the end-date change and the tagging
    that keep a reservation); None when all are allowed. A create that fails for another reason
    than permissions passes (the real create will say why); a cancel that cannot be confirmed
    fails, so nothing is created that might not be cancellable. (Describe is checked by the sweep
    of leftovers that follows.)"""
    try:
        api.create_reservation(
            region=candidate.region, availability_zone=candidate.zone, instance_type=instance_type,
            count=count, end_date=api.now() + SAFETY_LIFETIME, tags={TAG_KEY: "preflight"},
            client_token=str(uuid.uuid4()), dry_run=True)
    except AwsFailure as failure:
        if failure.kind in _NO_PERMISSION:
            return failure
    try:
        api.cancel_reservation(region=candidate.region, reservation_id=_PLACEHOLDER_ID,
                               dry_run=True)
    except AwsFailure as failure:
        # The placeholder ID not being found still means the call was authorized.
        if failure.kind is not FailureKind.NOT_FOUND:
            return failure
    if not hold:
        return None
    # Holding only needs to be allowed: should it fail otherwise, the reservation is cancelled.
    for check in (
            lambda: api.extend_reservation(region=candidate.region, reservation_id=_PLACEHOLDER_ID,
                                           end_date=api.now() + SAFETY_LIFETIME, dry_run=True),
            lambda: api.tag_reservation(region=candidate.region, reservation_id=_PLACEHOLDER_ID,
                                        tags={TAG_KEY: "preflight"}, dry_run=True)):
        try:
            check()
        except AwsFailure as failure:
            if failure.kind in _NO_PERMISSION:
                return failure
    return None


def cancel(api: AwsApi, *, region: str, reservation_id: str) -> bool:
    """Cancel, retrying transient failures; True when the reservation is gone."""
    for attempt in range(CANCEL_TRIES):
        try:
            api.cancel_reservation(region=region, reservation_id=reservation_id)
            return True
        except AwsFailure as failure:
            if failure.kind is FailureKind.NOT_FOUND:
                return True
            if failure.kind in _NO_PERMISSION:
                return False
            if attempt + 1 < CANCEL_TRIES:
                api.sleep(POLL_INTERVAL_S * 2 ** attempt)
    return False


def sweep_leftovers(api: AwsApi, *, region: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Cancel active reservations an earlier run tagged and did not hold for a stack;
    (cancelled IDs, IDs that would not)."""
    leftovers = [r for r in api.reservations_tagged(region=region, tag_key=TAG_KEY)
                 if not r.tags.get(TAG_KEY, "").startswith(HELD_PREFIX)]
    done, stuck = [], []
    for res in leftovers:
        (done if cancel(api, region=region, reservation_id=res.reservation_id) else stuck).append(
            res.reservation_id)
    return tuple(done), tuple(stuck)


Keep = Callable[[Candidate, str], None]
"""keep(candidate, reservation_id): hold a proven reservation (extend it, mark it, write the stack
file); it returns once the reservation is recorded, or raises and the reservation is cancelled."""


def reserve_and_cancel(api: AwsApi, *, candidate: Candidate, instance_type: str, count: int,
                       keep: Keep | None = None) -> ReservationAttempt:
    """Create a targeted reservation for all nodes in the candidate AZ, then cancel it, or with
    `keep`, hold it."""
    token = str(uuid.uuid4())
    instance_type = candidate.instance_type or instance_type
    created_id, may_exist = "", False
    outcome, detail = AttemptOutcome.FAILED, ""
    where = {"region": candidate.region, "zone": candidate.zone, "zone_id": candidate.zone_id,
             "instance_type": instance_type}
    cancelled, stuck, kept, holding = False, (), False, False
    try:
        try:
            may_exist = True
            res = api.create_reservation(
                region=candidate.region, availability_zone=candidate.zone,
                instance_type=instance_type, count=count, end_date=api.now() + SAFETY_LIFETIME,
                tags={TAG_KEY: token, PURPOSE_TAG[0]: PURPOSE_TAG[1]}, client_token=token)
            created_id = res.reservation_id
            state = res.state
            for _ in range(PENDING_POLLS):
                if state != "pending":
                    break
                api.sleep(POLL_INTERVAL_S)
                state = api.reservation(region=candidate.region, reservation_id=created_id).state
            if state == "active":
                outcome = AttemptOutcome.PROVEN
            else:
                detail = f"reservation {created_id} ended {state}"
            if outcome is AttemptOutcome.PROVEN and keep is not None:
                holding = True
                with signals_deferred():
                    keep(dataclasses.replace(candidate, instance_type=instance_type), created_id)
                    kept = True
        except AwsFailure as failure:
            may_exist = bool(created_id)
            outcome = _OUTCOME.get(failure.kind, AttemptOutcome.FAILED)
            detail = (f"holding {created_id} failed: " if holding else "") + failure.summary
        finally:
            if not kept:
                with signals_deferred():
                    cancelled, stuck = _cancel_attempt(api, region=candidate.region,
                                                       created_id=created_id, token=token,
                                                       may_exist=may_exist)
    except KeyboardInterrupt as interrupt:
        # The interrupt (or one held back during the cancel) ends the probe here: name what
        # could not be cancelled or what is held, or the caller could only say "a reservation".
        for reservation_id in stuck:
            interrupt.add_note(f"reservation {reservation_id} in {candidate.region} could not be "
                               f"cancelled; it ends by itself within {SAFETY_LIFETIME}")
        if kept:
            interrupt.add_note(f"reservation {created_id} in {candidate.region} is held and "
                               f"written to the stack file")
        raise
    if kept:
        return ReservationAttempt(**where, outcome=outcome, reservation_id=created_id, held=True)
    if created_id and not cancelled:
        detail = (f"{detail + '; ' if detail else ''}cancel failed: {created_id} ends by itself "
                  f"within {SAFETY_LIFETIME}")
    return ReservationAttempt(**where, outcome=outcome, detail=detail, reservation_id=created_id,
                              cancelled=cancelled)


def _cancel_attempt(api: AwsApi, *, region: str, created_id: str, token: str,
                    may_exist: bool) -> tuple[bool, tuple[str, ...]]:
    """(whether the attempt's reservation is cancelled, the ids that could not be cancelled)."""
    if created_id:
        cancelled = cancel(api, region=region, reservation_id=created_id)
        return cancelled, () if cancelled else (created_id,)
    if not may_exist:
        return False, ()
    # Interrupted after the request left but before its answer: find it by the attempt's tag.
    found = api.reservations_tagged(region=region, tag_key=TAG_KEY, tag_value=token)
    stuck = tuple(r.reservation_id for r in found
                  if not cancel(api, region=region, reservation_id=r.reservation_id))
    return not stuck, stuck


def _prepare_region(api: AwsApi, *, candidate: Candidate, instance_type: str, count: int,
                    run: _RunLog, hold: bool) -> tuple[AttemptOutcome, str] | None:
    """Preflight, then sweep leftovers, once per region; why the region cannot be tried, if so."""
    refused = preflight(api, candidate=candidate, instance_type=instance_type, count=count,
                        hold=hold)
    if refused is not None:
        outcome = (AttemptOutcome.DENIED if refused.kind in _NO_PERMISSION
                   else AttemptOutcome.FAILED)
        return outcome, f"DryRun preflight: {refused.summary}"
    try:
        done, stuck = sweep_leftovers(api, region=candidate.region)
    except AwsFailure as failure:
        if failure.kind in _NO_PERMISSION:
            return AttemptOutcome.DENIED, f"sweep of leftovers: {failure.summary}"
        run.sweep_errors.append(f"{candidate.region}: {failure.summary}")
        return None
    run.swept.extend(done)
    run.leaked.extend(stuck)
    return None


@dataclass
class _RunLog:
    attempts: list[ReservationAttempt] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    sweep_errors: list[str] = field(default_factory=list)


def prove_capacity(api: AwsApi, *, candidates: tuple[Candidate, ...], instance_type: str,
                   count: int,
                   on_attempt: Callable[[ReservationAttempt], None] = lambda _: None,
                   keep: Keep | None = None) -> ReservationRun:
    """Try candidates in rank order until one reservation succeeds (and, with `keep`, is held).
    No capacity or an unsupported AZ moves on to the next AZ; a quota failure skips the rest of
    that region; a permission failure stops everything (it would fail everywhere)."""
    run = _RunLog()
    blocked: dict[str, tuple[AttemptOutcome, str]] = {}
    prepared: set[str] = set()

    def record(attempt: ReservationAttempt) -> None:
        run.attempts.append(attempt)
        on_attempt(attempt)

    with sigterm_interrupts():
        for cand in candidates:
            where = {"region": cand.region, "zone": cand.zone, "zone_id": cand.zone_id,
                     "instance_type": cand.instance_type or instance_type}
            if cand.region not in prepared:
                prepared.add(cand.region)
                problem = _prepare_region(api, candidate=cand,
                                          instance_type=cand.instance_type or instance_type,
                                          count=count, run=run, hold=keep is not None)
                if problem is not None:
                    blocked[cand.region] = problem
            if cand.region in blocked:
                outcome, detail = blocked[cand.region]
                record(ReservationAttempt(**where, outcome=outcome, detail=detail))
                if outcome is AttemptOutcome.DENIED:
                    break
                continue
            attempt = reserve_and_cancel(api, candidate=cand, instance_type=instance_type,
                                         count=count, keep=keep)
            record(attempt)
            if attempt.reservation_id and not (attempt.cancelled or attempt.held):
                run.leaked.append(attempt.reservation_id)
            if attempt.outcome in (AttemptOutcome.PROVEN, AttemptOutcome.DENIED):
                break
            if attempt.outcome is AttemptOutcome.QUOTA:
                blocked[cand.region] = (AttemptOutcome.SKIPPED, "the region's quota was exceeded")
    return ReservationRun(attempts=tuple(run.attempts), swept=tuple(run.swept),
                          leaked=tuple(run.leaked), sweep_errors=tuple(run.sweep_errors))
