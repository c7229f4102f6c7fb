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
