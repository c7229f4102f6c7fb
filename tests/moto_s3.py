"""A moto S3 server fixture for test modules that import it (`from moto_s3 import moto_s3`)."""

from __future__ import annotations

import logging

import boto3
import pytest
from moto.server import ThreadedMotoServer

from workloads.client.cluster import free_port


@pytest.fixture(scope="module")
def moto_s3():
    """A moto S3 server on 127.0.0.1 and the standard AWS environment pointing at it (so pyarrow,
    boto3 and processes started from the test reach it as they would reach S3); yields a boto3
    client on it. One server per test module."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                            "AWS_ENDPOINT_URL_S3": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}.items():
            env.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            env.delenv(name, raising=False)
        try:
            yield boto3.client("s3", endpoint_url=endpoint)
        finally:
            server.stop()
