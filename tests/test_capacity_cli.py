"""`python -m capacity probe` end to end: a subprocess against a real moto server on 127.0.0.1,
reached through AWS_ENDPOINT_URL with fake credentials."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from capacity.bench_probe import free_port
from infra.config import parse_stack_config, read_stack_values

FAKE_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            # moto answers the EC2 default-quota call with HTTP 500 (not implemented); one attempt
            # keeps botocore's retry backoff out of the test time.
            "AWS_MAX_ATTEMPTS": "1"}
PLACEMENT_KEYS = ("aws:region:", "ray-eks:gpuAvailabilityZone:", "ray-eks:gpuAvailabilityZoneId:",
                  "ray-eks:gpuInstanceType:", "ray-eks:gpuNodeCount:")


@pytest.fixture(scope="module")
def moto_url() -> str:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def probe(moto_url: str, repo_root: Path, tmp_path: Path):
    """`python -m capacity probe ARGS` run in tmp_path, a project folder (it holds a Pulumi.yaml)."""
    shutil.copy(repo_root / "Pulumi.yaml", tmp_path / "Pulumi.yaml")

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        full_env = {**base, **FAKE_ENV, "AWS_ENDPOINT_URL": moto_url,
                    "PYTHONPATH": str(repo_root), **(env or {})}
        return subprocess.run([sys.executable, "-m", "capacity", "probe", *args], cwd=tmp_path,
                              env={k: v for k, v in full_env.items() if v is not None},
                              capture_output=True, text=True, timeout=120)
    return run


def moto_ec2(moto_url: str, region: str):
    return boto3.client("ec2", region_name=region, endpoint_url=moto_url,
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def other_lines(text: str) -> list[str]:
    return [line for line in text.splitlines(keepends=True)
            if not line.strip().startswith(PLACEMENT_KEYS)]


def test_done_when_probe_writes_a_us_west_2_az_and_keeps_the_rest(probe, moto_url, repo_root,
                                                                 tmp_path):
    original = (repo_root / "Pulumi.us-west-2.yaml").read_text()
    stack = tmp_path / "Pulumi.us-west-2.yaml"
    stack.write_text(original)
    proc = probe("--regions", "us-west-2,eu-west-1", "--nodes", "2", "--stack", "us-west-2")
    assert proc.returncode == 0, proc.stderr
    cfg = parse_stack_config(read_stack_values(stack))
    ec2 = moto_ec2(moto_url, "us-west-2")
    offered = {o["Location"] for o in ec2.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": ["g6.12xlarge"]}])["InstanceTypeOfferings"]}
    zone_ids = {z["ZoneName"]: z["ZoneId"]
                for z in ec2.describe_availability_zones()["AvailabilityZones"]}
    assert cfg.region == "us-west-2" and cfg.gpu_availability_zone in offered
    assert cfg.gpu_availability_zone_id == zone_ids[cfg.gpu_availability_zone]
    assert (cfg.gpu_instance_type, cfg.gpu_node_count) == ("g6.12xlarge", 2)
    # The stack's AZ ID (usw2-az1) is still offered, so the node group stays in that zone.
    assert cfg.gpu_availability_zone_id == "usw2-az1"
    assert other_lines(stack.read_text()) == other_lines(original)
    assert "eu-west-1" in proc.stdout and "not offered" in proc.stdout
    assert "the GPU nodes cost about $9.20/hour (us-east-1 On-Demand list prices" in proc.stdout
    assert "quota not checked" in proc.stdout  # moto has no EC2 quotas: said, not hidden


def test_json_is_pure_json_and_dry_run_writes_nothing(probe, tmp_path):
    proc = probe("--regions", "eu-west-1,us-east-2", "--nodes", "3", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["placement"]["region"] == "us-east-2" and doc["placement"]["node_count"] == 3
    assert doc["stack"] == "us-east-2" and doc["written"] is False and doc["changed"] is True
    assert "+  ray-eks:gpuNodeCount: 3" in doc["diff"]
    assert doc["reasons"] == ["eu-west-1: g6.12xlarge not offered in any AZ"]
    quota = doc["regions"][1]["quota"]
    assert quota["verdict"] == "unknown" and "L-DB2E81BA" in quota["problem"]
    assert not list(tmp_path.glob("Pulumi.*.yaml"))


def test_stack_region_is_probed_when_no_regions_are_given(probe, tmp_path):
    stack = tmp_path / "Pulumi.dev.yaml"
    stack.write_text("config:\n  aws:region: us-east-2\n  ray-eks:rayNamespace: ray\n")
    proc = probe("--stack", "dev", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["request"]["regions"] == ["us-east-2"]
    cfg = parse_stack_config(read_stack_values(stack))
    assert cfg.region == "us-east-2" and cfg.gpu_availability_zone.startswith("us-east-2")


def test_no_placement_exits_1_with_a_reason_per_location(probe, tmp_path):
    proc = probe("--regions", "eu-west-1", "--instance-type", "p5.48xlarge")
    assert proc.returncode == 1, proc.stderr
    assert "eu-west-1: " in proc.stdout and "No placement" in proc.stdout
    assert not list(tmp_path.glob("Pulumi.*.yaml"))


MALFORMED = "config:\n  aws:region: [unclosed\n"


@pytest.mark.parametrize(("args", "message"), [
    (("--regions", "us-west-9"), "unknown region 'us-west-9'"),
    (("--regions", "us-west-2", "--nodes", "0"), "--nodes must be a whole number of at least 1"),
    (("--regions", "us-west-2", "--instance-type", "t3.micro"), "t3.micro is not an EFA-capable"),
    (("--stack", "broken"), "is not valid YAML"),
    (("--regions", "us-west-2", "--all-regions"), "not allowed with argument"),
])
def test_bad_input_exits_2_with_one_line_and_touches_nothing(probe, tmp_path, args, message):
    (tmp_path / "Pulumi.broken.yaml").write_text(MALFORMED)
    proc = probe(*args)
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert (tmp_path / "Pulumi.broken.yaml").read_text() == MALFORMED
    assert [p.name for p in tmp_path.glob("Pulumi.*.yaml")] == ["Pulumi.broken.yaml"]


def test_a_stack_name_that_is_no_stack_file_and_no_region_is_refused_as_a_typo(probe, tmp_path):
    proc = probe("--stack", "us-wset-2", "--regions", "us-west-2", "--nodes", "2")
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line == ("capacity probe: error: --stack 'us-wset-2' is neither a stack file here nor an AWS "
                    "region; did you mean --stack us-west-2? Or add --new-stack to create "
                    "Pulumi.us-wset-2.yaml")
    assert not list(tmp_path.glob("Pulumi.*.yaml"))
    # The closest existing stack file is named too, and --new-stack is the way to a new name.
    (tmp_path / "Pulumi.gpu-dev.yaml").write_text("config:\n  aws:region: us-west-2\n")
    assert "did you mean --stack gpu-dev?" in probe("--stack", "gpu-deb").stderr
    proc = probe("--stack", "my-stack", "--new-stack", "--regions", "us-west-2")
    assert proc.returncode == 0, proc.stderr
    assert parse_stack_config(read_stack_values(tmp_path / "Pulumi.my-stack.yaml")).region == "us-west-2"


def test_run_from_another_folder_it_says_to_run_from_the_projects_root(probe, repo_root, tmp_path):
    (tmp_path / "Pulumi.yaml").unlink()  # a folder that is not the project's
    proc = probe("--stack", "us-west-2", "--regions", "us-west-2")
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line == (f"capacity probe: error: there is no Pulumi.yaml in {tmp_path}: the capacity commands "
                    f"read and write Pulumi.<stack>.yaml in the project's root ({repo_root}); run them "
                    "from there")
    assert not list(tmp_path.glob("Pulumi.*"))  # no stray stack file


def test_with_json_a_failure_is_a_json_document_on_stdout(probe):
    proc = probe("--all-regions", "--dry-run", "--json",
                 env={"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None})
    assert proc.returncode == 3
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == 3
    (error,) = doc["error"]
    assert error.startswith("AWS credentials problem calling sts:GetCallerIdentity: NoCredentialsError")
    assert f"capacity probe: error: {error}" in proc.stderr  # stderr says it as before
    bad = probe("--nodes", "0", "--json")
    assert bad.returncode == 2 and json.loads(bad.stdout) == {
        "exit_code": 2, "error": ["--nodes must be a whole number of at least 1, got '0'"]}


def test_missing_credentials_exit_3(probe):
    proc = probe("--regions", "us-west-2",
                 env={"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None})
    assert proc.returncode == 3
    assert "credentials" in proc.stderr.lower() and "Traceback" not in proc.stderr


def test_all_regions_probes_every_enabled_region_stack_region_first(probe, moto_url, tmp_path):
    stack = tmp_path / "Pulumi.dev.yaml"
    stack.write_text("config:\n  aws:region: us-east-2\n")
    proc = probe("--all-regions", "--stack", "dev", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    listed = moto_ec2(moto_url, "us-east-1").describe_regions()["Regions"]
    enabled = {r["RegionName"] for r in listed}
    assert set(doc["request"]["regions"]) == enabled
    assert doc["request"]["regions"][:3] == ["us-east-2", "us-west-2", "us-east-1"]
    assert doc["placement"]["region"] == "us-east-2" and doc["written"] is False
    assert all(r["failure"] is None for r in doc["regions"])
    assert stack.read_text() == "config:\n  aws:region: us-east-2\n"


def test_a_profile_that_does_not_exist_exits_3_and_says_how_to_list_profiles(monkeypatch, capsys):
    from capacity.cli import main

    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_PROFILE", "nonexistent")
    assert main(["probe", "--regions", "us-west-2"]) == 3
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "ProfileNotFound" in line and "aws configure list-profiles" in line


@pytest.mark.parametrize(("code", "advice"), [
    ("NoCredentialsError", "aws sso login --profile NAME"),
    ("TokenRetrievalError", "aws sso login"),
    ("ExpiredToken", "has expired"),
    ("InvalidClientTokenId", "aws sts get-caller-identity"),
])
def test_every_credentials_failure_says_what_to_do(code, advice):
    from capacity.aws import AwsFailure, FailureKind

    failure = AwsFailure(kind=FailureKind.CREDENTIALS, code=code, message="m",
                         action="sts:GetCallerIdentity")
    assert failure.summary.startswith(f"AWS credentials problem calling sts:GetCallerIdentity: {code}")
    assert advice in failure.summary


def test_no_region_answering_exits_4_not_1(monkeypatch, fake_aws_session, tmp_path, capsys):
    """Every region failing to connect says nothing about capacity: its own exit code."""
    from rich.console import Console

    from capacity.aws import AwsApi
    from capacity.cli import EXIT_UNREACHABLE, parse_options, run_probe

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    opts = parse_options(["probe", "--regions", "us-west-2,eu-west-1", "--dry-run"],
                         project_dir=tmp_path, known=frozenset({"us-west-2", "eu-west-1"}))
    api = AwsApi(session=fake_aws_session, sleep=lambda s: None, call_timeout_s=2)
    out, err = Console(file=io.StringIO()), Console(stderr=True)
    assert run_probe(opts, api=api, home_region="us-west-2", out=out, err=err) == EXIT_UNREACHABLE
    assert "cannot reach AWS" in out.file.getvalue()
    assert "a connection problem, not an answer about capacity" in capsys.readouterr().err
