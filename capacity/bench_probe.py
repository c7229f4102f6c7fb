"""Time a probe of every region against a local moto server: concurrent versus one region at a time.

    python -m capacity.bench_probe [--repeats N] [--nodes N] [--instance-type T]

Starts `python -m moto.server` on a free 127.0.0.1 port (a separate process, so the server does not
share the probe's interpreter), points boto3 at it with fake credentials, and runs both modes in the
same run, alternating, so they see the same machine state. Needs the dev extras (moto[server]).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
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

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_SESSION_TOKEN": "testing", "AWS_REGION": "us-east-1",
                    "AWS_EC2_METADATA_DISABLED": "true",
                    # moto answers GetAWSDefaultServiceQuota for EC2 with HTTP 500 (not
                    # implemented); without this, botocore's retry backoff on that one call would
                    # dominate both timings.
                    "AWS_MAX_ATTEMPTS": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def moto_server_process(*, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """A moto server in its own process; yields its endpoint URL and stops it afterwards."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
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
    args = parser.parse_args(argv)
    os.environ.update(FAKE_CREDENTIALS)
    with moto_server_process() as url:
        os.environ["AWS_ENDPOINT_URL"] = url
        session = boto3.Session()
        regions = tuple(AwsApi(session=session).enabled_regions(region="us-east-1"))
        request = ProbeRequest(instance_type=args.instance_type, node_count=args.nodes,
                               regions=regions)
        times: dict[str, list[float]] = {"concurrent": [], "one at a time": []}
        for _ in range(args.repeats):
            # A fresh AwsApi per run, so both modes pay for creating their clients.
            times["concurrent"].append(_time_probe(AwsApi(session=boto3.Session()), request,
                                                   concurrent=True))
            times["one at a time"].append(_time_probe(AwsApi(session=boto3.Session()), request,
                                                      concurrent=False))
    print(f"probe of {len(regions)} regions for {args.nodes} x {args.instance_type} against moto "
          f"({args.repeats} runs each, alternating)")
    for mode, runs in times.items():
        print(f"  {mode:14s} median {statistics.median(runs):6.2f} s   runs: "
              + ", ".join(f"{t:.2f}" for t in runs))
    speedup = statistics.median(times["one at a time"]) / statistics.median(times["concurrent"])
    print(f"  speedup        {speedup:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
