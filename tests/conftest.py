"""Shared fixtures. Read-only reference material (the KubeRay CRD, Helm chart values, real NCCL logs)
lives in the shared folder beside the checkout; SHARED_DIR points elsewhere. CI always has it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DIR = Path(os.environ.get("SHARED_DIR", REPO_ROOT.parent / "shared")).resolve()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED_DIR / "DESIGN.md").is_file():
        pytest.skip(f"reference files not found at {SHARED_DIR}; set SHARED_DIR to the shared folder")
    return SHARED_DIR


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="module")
def botocore_session():
    """One botocore session per module, so the AWS service models load once, not once per test."""
    import botocore.session

    return botocore.session.get_session()


@pytest.fixture
def fake_aws_session(botocore_session):
    """A boto3 session with fake credentials in us-west-2, for moto or a botocore Stubber."""
    import boto3

    return boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name="us-west-2", botocore_session=botocore_session)


@pytest.fixture(scope="module")
def moto_s3():
    """A moto S3 server on 127.0.0.1 and the standard AWS environment pointing at it (so pyarrow,
    boto3 and processes started from the test reach it as they would reach S3); yields a boto3
    client on it. One server per test module."""
    import logging
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
