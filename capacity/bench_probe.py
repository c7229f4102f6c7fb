"""Time a probe of every region against a local moto server: concurrent versus one region at a time.

    python -m capacity.bench_probe [--repeats N] [--nodes N] [--instance-type T]
                                   [--added-latency-ms MS]

Starts `python -m moto.server` on a free 127.0.0.1 port (a separate process, so the server does not
share the probe's interpreter), points boto3 at it with fake credentials, and runs both modes in the
same run, alternating, so they see the same machine state. Needs the dev extras (moto[server]).

moto answers on loopback in about a millisecond and spends CPU on every call, so the server, not
the network, bounds a local run. `--added-latency-ms` delays every request by a fixed time before it
is sent, standing in for the round trip to a distant region (simulated, and labelled so).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator

import boto3

from capacity.aws import AwsApi
from capacity.probe import ProbeRequest
from capacity.regions import probe_regions
from workloads.client.cluster import free_port

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_SESSION_TOKEN": "testing", "AWS_REGION": "us-east-1",
                    "AWS_EC2_METADATA_DISABLED": "true",
                    # moto answers GetAWSDefaultServiceQuota for EC2 with HTTP 500 (not
                    # implemented); without this, botocore's retry backoff on that one call would
                    # dominate both timings.
                    "AWS_MAX_ATTEMPTS": "1"}


@contextlib.contextmanager
def moto_server_process(*, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """A moto server in its own process; yields its endpoint URL and stops it afterwards."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {url}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _session(latency_s: float) -> boto3.Session:
    session = boto3.Session()
    if latency_s > 0:
        session.events.register("before-send", lambda **_: time.sleep(latency_s))
    return session


def _time_probe(api: AwsApi, request: ProbeRequest, *, concurrent: bool) -> float:
    start = time.perf_counter()
    reports = probe_regions(api, request=request, timeout_s=300, concurrent=concurrent)
    elapsed = time.perf_counter() - start
    failed = [r.region for r in reports if r.failure is not None]
    if failed:
        raise RuntimeError(f"regions failed during the benchmark: {', '.join(failed)}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m capacity.bench_probe", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--instance-type", default="g6.12xlarge")
    parser.add_argument("--added-latency-ms", type=float, default=0.0,
                        help="simulated round-trip time added to every request")
    args = parser.parse_args(argv)
    os.environ.update(FAKE_CREDENTIALS)
    load_at_start = os.getloadavg()[0]
    with moto_server_process() as url:
        os.environ["AWS_ENDPOINT_URL"] = url
        session = boto3.Session()
        regions = tuple(AwsApi(session=session).enabled_regions(region="us-east-1"))
        request = ProbeRequest(instance_type=args.instance_type, node_count=args.nodes,
                               regions=regions)
        times: dict[str, list[float]] = {"concurrent": [], "one at a time": []}
        for _ in range(args.repeats):
            # A fresh AwsApi per run, so both modes pay for creating their clients.
            for mode, concurrent in (("concurrent", True), ("one at a time", False)):
                api = AwsApi(session=_session(args.added_latency_ms / 1000))
                times[mode].append(_time_probe(api, request, concurrent=concurrent))
    latency = (f", {args.added_latency_ms:g} ms simulated latency per request"
               if args.added_latency_ms else "")
    print(f"probe of {len(regions)} regions for {args.nodes} x {args.instance_type} against moto "
          f"({args.repeats} runs each, alternating{latency}; {os.cpu_count()} CPUs, load average "
          f"{load_at_start:.1f} at start)")
    for mode, runs in times.items():
        print(f"  {mode:14s} median {statistics.median(runs):6.2f} s   runs: "
              + ", ".join(f"{t:.2f}" for t in runs))
    speedup = statistics.median(times["one at a time"]) / statistics.median(times["concurrent"])
    print(f"  speedup        {speedup:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
