"""Probe regions concurrently: offerings by AZ name and ID, instance facts, and quota.

A region that fails or is slow never stops the others: its failure becomes data in its report, and
a region still running at the deadline is reported as timed out while the others' results stand.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable

from capacity.aws import AwsApi, AwsFailure, FailureKind
from capacity.probe import ProbeRequest, RegionFailure, RegionReport, ZoneOffer, table_mismatch
from capacity.quota import check_quota

MAX_THREADS = 32


def probe_region(api: AwsApi, *, region: str, request: ProbeRequest) -> RegionReport:
    """Facts, AZ offerings (names joined to IDs) and, where offered with EFA, the quota check."""
    start = time.monotonic()
    facts = api.instance_facts(region=region, instance_type=request.instance_type)
    if facts is None:
        return RegionReport(region=region, elapsed_s=time.monotonic() - start,
                            instance_type=request.instance_type)
    zone_ids = api.availability_zones(region=region)
    offered = api.offered_zones(region=region, instance_type=request.instance_type)
    zones = tuple(ZoneOffer(name=name, zone_id=zone_ids[name], offered=name in offered)
                  for name in sorted(zone_ids))
    quota, spot_problem = None, ""
    if (any(z.offered for z in zones) and facts.efa_supported and facts.max_efa_interfaces > 0
            and not table_mismatch(facts)):
        quota = check_quota(api, region=region, facts=facts, node_count=request.node_count,
                            spot=request.spot)
        if request.spot:
            zones, spot_problem = with_spot_market(api, region=region, zones=zones,
                                                   instance_type=request.instance_type,
                                                   count=request.node_count)
    return RegionReport(region=region, facts=facts, zones=zones, quota=quota,
                        elapsed_s=time.monotonic() - start, instance_type=request.instance_type,
                        spot_problem=spot_problem)


def with_spot_market(api: AwsApi, *, region: str, zones: tuple[ZoneOffer, ...], instance_type: str,
                     count: int) -> tuple[tuple[ZoneOffer, ...], str]:
    """The zones with their Spot placement score (by AZ ID) and latest Spot price (by AZ name),
    and why either could not be read: the zones are then ranked on what was read."""
    problems, scores, prices = [], {}, {}
    try:
        scores = api.spot_placement_scores(region=region, instance_type=instance_type, count=count)
    except AwsFailure as failure:
        problems.append(f"Spot placement scores unread ({_why(failure)})")
    try:
        prices = {p.zone: p.usd_per_hour
                  for p in api.spot_prices(region=region, instance_type=instance_type)}
    except AwsFailure as failure:
        problems.append(f"Spot prices unread ({_why(failure)})")
    zones = tuple(dataclasses.replace(z, spot_score=scores.get(z.zone_id),
                                      spot_usd_per_hour=prices.get(z.name)) for z in zones)
    return zones, "; ".join(problems)


def _why(failure: AwsFailure) -> str:
    if failure.kind is FailureKind.DENIED:
        return f"missing IAM action {failure.action}"
    return f"{failure.action}: {failure.code}"


def _failed(region: str, failure: RegionFailure, elapsed_s: float,
            instance_type: str = "") -> RegionReport:
    return RegionReport(region=region, failure=failure, elapsed_s=elapsed_s,
                        instance_type=instance_type)


def _probe_safely(api: AwsApi, region: str, request: ProbeRequest) -> RegionReport:
    start = time.monotonic()
    try:
        return probe_region(api, region=region, request=request)
    except AwsFailure as failure:
        return _failed(region, RegionFailure(kind=failure.kind, message=failure.summary,
                                             action=failure.action), time.monotonic() - start,
                       request.instance_type)
    except Exception as exc:  # a bug or an unexpected response must not sink the other regions
        return _failed(region, RegionFailure(kind=FailureKind.OTHER,
                                             message=f"{type(exc).__name__}: {exc}"),
                       time.monotonic() - start, request.instance_type)


def probe_regions(api: AwsApi, *, request: ProbeRequest, timeout_s: float, concurrent: bool = True,
                  on_done: Callable[[RegionReport], None] = lambda _: None
                  ) -> tuple[RegionReport, ...]:
    """Reports in `request.regions` order. Every region gets its own `timeout_s`, counted from when
    its probe starts; with `concurrent`, all regions start at once."""
    workers = min(MAX_THREADS, len(request.regions)) if concurrent else 1
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="probe")
    started: dict[str, float] = {}

    def run(region: str) -> RegionReport:
        started[region] = time.monotonic()
        return _probe_safely(api, region, request)

    futures: dict[Future, str] = {pool.submit(run, region): region for region in request.regions}
    results: dict[str, RegionReport] = {}
    pending = set(futures)

    def record(report: RegionReport) -> None:
        results[report.region] = report
        on_done(report)

    try:
        while pending:
            done, pending = wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
            for fut in done:
                record(fut.result())
            now = time.monotonic()
            for fut in list(pending):
                region = futures[fut]
                if region in started and now - started[region] > timeout_s:
                    pending.discard(fut)
                    record(_failed(region, RegionFailure(
                        kind=FailureKind.TIMEOUT, message=f"no answer within {timeout_s:g}s"),
                        now - started[region], request.instance_type))
    finally:
        # Threads still blocked on a slow region end at the botocore read timeout.
        pool.shutdown(wait=False, cancel_futures=True)
    return tuple(results[r] for r in request.regions)


def probe_instance_types(api: AwsApi, *, request: ProbeRequest, timeout_s: float,
                         on_done: Callable[[RegionReport], None] = lambda _: None
                         ) -> tuple[RegionReport, ...]:
    """`probe_regions` for each of the request's instance types, one type after the other (the
    regions of one type at once): reports per type in the request's type order."""
    reports: list[RegionReport] = []
    for instance_type in request.instance_types:
        one = dataclasses.replace(request, instance_type=instance_type, fallback_types=())
        reports.extend(probe_regions(api, request=one, timeout_s=timeout_s, on_done=on_done))
    return tuple(reports)
