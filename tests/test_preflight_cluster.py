"""A check that fails before step 1 stops the run on a real local Ray cluster, once, without retries.

The head (the job's driver and Ray Train's controller) can write to the S3 bucket (a moto server
that enforces IAM), the worker nodes cannot: their credentials are wrong, as a worker pod's are when
its library cannot read the Pod Identity credentials that the head's boto3 reads. Ray Train's own
storage validation, which runs on the head, passes; the workers' write check must stop the run
before the first step, with the reason, and `--max-failures 3` must not make it try again.
"""

from __future__ import annotations

import json
import logging

import boto3
import pytest
from moto.server import ThreadedMotoServer

from workloads.client import submit
from workloads.client.cluster import free_port
from workloads.local.run import LocalClusterSpec, local_ray_cluster

pytestmark = pytest.mark.slow

BUCKET = "checkpoints"
TINY_RUN = ["--preset", "demo-cpu", "--set", "micro_batch=2", "--set", "seq_len=32", "--set", "steps=4",
            "--set", "checkpoint_every=2", "--set", "log_every=1"]


@pytest.fixture()
def s3_with_iam(monkeypatch, iam_enforced):
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    bootstrap = dict(endpoint_url=endpoint, aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap",
                     region_name="us-east-1")
    iam = boto3.client("iam", **bootstrap)
    iam.create_user(UserName="head")
    iam.put_user_policy(UserName="head", PolicyName="all", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:*", "sts:*"], "Resource": "*"}]}))
    key = iam.create_access_key(UserName="head")["AccessKey"]
    boto3.client("s3", **bootstrap).create_bucket(Bucket=BUCKET)
    for name, value in {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                        "AWS_ENDPOINT_URL_S3": endpoint, "AWS_ENDPOINT_URL_STS": endpoint,
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    try:
        with iam_enforced(endpoint):
            yield endpoint
    finally:
        server.stop()


def test_workers_that_cannot_write_stop_the_run_before_step_1_without_a_retry(s3_with_iam, tmp_path, monkeypatch,
                                                                              capsys):
    wrong = {"AWS_ACCESS_KEY_ID": "AKIAWORKERPOD0000000", "AWS_SECRET_ACCESS_KEY": "not-the-pod-identity-one"}
    spec = LocalClusterSpec(nodes=2, cpus_per_node=1, worker_env=(wrong, wrong))
    with local_ray_cluster(spec, log_dir=tmp_path / "ray") as cluster:
        monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
        code = submit.main("submit", ["--address", cluster.address, *TINY_RUN,
                                      "--storage-path", f"s3://{BUCKET}/runs", "--run-name", "cannot-write",
                                      "--max-failures", "3"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1, out
    assert "error: training failed: stopped before step 1, not retried: 2 of 2 ranks cannot write checkpoints" in out
    assert f"cannot write checkpoints to s3://{BUCKET}/runs/cannot-write" in out
    assert "train step" not in out
    assert "[FailurePolicy]" not in out  # no worker error reached Ray Train's retry policy
