"""Credentials inside the pods: the storage write check, run as a worker runs it, with pyarrow's S3
filesystem getting its credentials from a stand-in of the EKS Pod Identity agent, in front of a moto
S3 server that enforces IAM.

The agent stand-in is what a pod sees: `AWS_CONTAINER_CREDENTIALS_FULL_URI` names an HTTP endpoint
that answers only when the `Authorization` header carries the token from the file named by
`AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`. No other credential source is set. Each check runs in a
subprocess, as in a fresh worker, so that pyarrow's AWS SDK reads that environment from scratch.
"""

from __future__ import annotations

import datetime
import http.server
import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from workloads.client.cluster import free_port
from workloads.launch.storage import MARKER_DIR, resolve_storage, role_of

BUCKET = "ray-checkpoints"
TOKEN = "eks-pod-identity-token-for-ray-train"
REPO = Path(__file__).resolve().parent.parent


@dataclass
class PodIdentityAgent:
    """Serves one set of credentials to callers that present the token; records every call."""

    credentials: dict
    calls: list[str] = field(default_factory=list)

    def serve(self) -> http.server.ThreadingHTTPServer:
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                agent.calls.append(self.headers.get("Authorization", ""))
                if self.path != "/v1/credentials" or self.headers.get("Authorization") != TOKEN:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps(agent.credentials).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@pytest.fixture(scope="module")
def iam_s3(iam_enforced):
    """A moto server with the bucket, a writer and a reader IAM role, and IAM enforced from then on."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    admin = dict(endpoint_url=endpoint, aws_access_key_id="admin", aws_secret_access_key="admin",
                 region_name="us-east-1")
    iam = boto3.client("iam", **admin)
    boto3.client("s3", **admin).create_bucket(Bucket=BUCKET)
    keys = {}
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                     "Principal": {"Service": "pods.eks.amazonaws.com"}}]}
    for role, actions in {"ray-train-writer": ["s3:*"], "ray-train-reader": ["s3:GetObject", "s3:ListBucket"]}.items():
        # The roles a Pod Identity association would name; the agent hands out their session
        # credentials, as the real one does.
        iam.create_role(RoleName=role, AssumeRolePolicyDocument=json.dumps(trust))
        iam.put_role_policy(RoleName=role, PolicyName="checkpoints", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": actions + ["sts:GetCallerIdentity"], "Resource": "*"}]}))
        assumed = boto3.client("sts", **admin).assume_role(
            RoleArn=f"arn:aws:iam::123456789012:role/{role}", RoleSessionName="eks-ray-train-pod")["Credentials"]
        keys[role] = {"AccessKeyId": assumed["AccessKeyId"], "SecretAccessKey": assumed["SecretAccessKey"],
                      "Token": assumed["SessionToken"]}
    try:
        # From here on every request must be signed by a known key and allowed by its policy.
        with iam_enforced(endpoint):
            yield endpoint, keys
    finally:
        server.stop()


def _pod_env(endpoint: str, agent_port: int, token_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONTAINER_CREDENTIALS_FULL_URI=f"http://127.0.0.1:{agent_port}/v1/credentials",
        AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE=str(token_file),
        AWS_ENDPOINT_URL=endpoint, AWS_REGION="us-east-1", AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        HOME=str(token_file.parent),  # no ~/.aws
    )
    return env


def _check(env: dict[str, str], uri: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workloads.launch.storage", uri], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _expires() -> str:
    return (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(("user", "token", "exit_code", "cause"), [
    ("ray-train-writer", TOKEN, 0, None),
    ("ray-train-reader", TOKEN, 1, "role ray-train-reader may not write to bucket ray-checkpoints (AccessDenied)"),
    ("ray-train-writer", "a-stale-token", 1, "no AWS credentials reach this process: the EKS Pod Identity agent "
                                             "gave none"),
], ids=["writer", "reader", "refused-token"])
def test_the_write_check_reads_pod_identity_credentials_and_names_the_cause(
        iam_s3, tmp_path, user, token, exit_code, cause):
    endpoint, keys = iam_s3
    agent = PodIdentityAgent({**keys[user], "AccountId": "123456789012", "Expiration": _expires()})
    server = agent.serve()
    token_file = tmp_path / "eks-pod-identity-token"
    token_file.write_text(token)
    try:
        result = _check(_pod_env(endpoint, server.server_port, token_file), f"s3://{BUCKET}/runs/{user}")
    finally:
        server.shutdown()
    assert result.returncode == exit_code, result.stderr
    # pyarrow (and, on failure, boto3's diagnosis) went through the agent with the file's token.
    assert agent.calls and set(agent.calls) == {token}
    if cause is None:
        assert result.stdout.startswith(f"s3://{BUCKET}/runs/{user}: writable from ")
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=keys[user]["AccessKeyId"],
                          aws_secret_access_key=keys[user]["SecretAccessKey"], aws_session_token=keys[user]["Token"])
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{user}/{MARKER_DIR}/").get("Contents", [])
        assert [o["Key"] for o in listed if not o["Key"].endswith("/")] == []  # the marker was deleted
    else:
        assert f"cannot write checkpoints to s3://{BUCKET}/runs/{user}" in result.stderr
        assert cause in result.stderr, result.stderr


def test_a_pyarrow_that_cannot_read_pod_identity_is_told_apart_from_a_missing_permission(monkeypatch):
    """boto3 writes where pyarrow could not: the cause is pyarrow's AWS SDK, not the role."""
    from workloads.launch import storage

    class FakeS3:
        def put_object(self, **kwargs):
            pass

        def delete_object(self, **kwargs):
            pass

    class FakeSts:
        def get_caller_identity(self):
            return {"Arn": "arn:aws:sts::123456789012:assumed-role/ray-eks-checkpoints/eks-ray-train-abc"}

    class FakeSession:
        def __init__(self, region_name=None):
            pass

        def client(self, name, config=None):
            return FakeS3() if name == "s3" else FakeSts()

    monkeypatch.setattr(boto3.session, "Session", FakeSession)
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://169.254.170.23/v1/credentials")
    cause = storage.diagnose("s3://ray-checkpoints/runs", "AWS Error ACCESS_DENIED")
    assert "boto3 writes to bucket ray-checkpoints as role ray-eks-checkpoints, pyarrow" in cause
    assert "predates EKS Pod Identity support (1.11.263)" in cause


def test_role_of_reads_assumed_roles_and_users():
    assert role_of("arn:aws:sts::123456789012:assumed-role/ray-eks-checkpoints/eks-ray-x") == "ray-eks-checkpoints"
    assert role_of("arn:aws:iam::123456789012:user/ray-train-writer") == "ray-train-writer"


def test_an_s3_storage_path_reaches_the_endpoint_of_the_standard_aws_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic.invalid:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    filesystem, path = resolve_storage("s3://checkpoints/runs")
    assert path == "checkpoints/runs"
    # What Ray Train pickles to the controller and every worker carries the endpoint with it.
    assert filesystem.__reduce__()[1][0]["endpoint_override"] == "http://127.0.0.1:9000"
    assert resolve_storage("/mnt/checkpoints") == (None, "/mnt/checkpoints")
    with pytest.raises(ValueError, match="Unrecognized filesystem type"):
        resolve_storage("nosuch://bucket/prefix")
