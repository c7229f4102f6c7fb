"""`submit --dry-run`: every check `submit` makes before it reaches the cluster (the stack file, the
config and its data, the fit, the hub's commits, the tools and the AWS credentials the stack's
cluster is reached with) and nothing after: no port-forward, no upload, no job."""

from __future__ import annotations

import os
import stat

import pytest
from moto import mock_aws

from workloads.client import revisions, submit

TOOLS = ("pulumi", "kubectl", "aws")


def _stub_tools(folder, names=TOOLS) -> str:
    """Programs of these names on a PATH of their own, which fail if run: the dry run must only find them."""
    folder.mkdir()
    for name in names:
        path = folder / name
        path.write_text("#!/bin/sh\necho called >&2\nexit 99\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(folder)


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setattr(revisions, "ask_the_hub", lambda repo, **kw: "e5" * 20)


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_a_dry_run_on_a_stack_checks_everything_before_the_cluster_and_stops(monkeypatch, tmp_path, capsys, hub,
                                                                              aws_env):
    monkeypatch.setenv("PATH", _stub_tools(tmp_path / "bin"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setattr(submit, "connect", lambda **kw: pytest.fail("the dry run reached for the cluster"))
    with mock_aws():
        code = submit.main("submit", ["--stack", "us-west-2", "--dry-run"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert "preset qwen2.5-1.5b-24gb" in out and "fit predicted" in out and "on 2 x g6.12xlarge" in out
    assert "hub model Qwen/Qwen2.5-1.5B pinned at commit" in out  # the commits the run would read
    assert "tools pulumi, kubectl and aws are on PATH" in out
    assert "credentials AWS account 123456789012" in out
    assert out.endswith("dry run: every check passed; nothing was submitted (submit without --dry-run starts it)")


def test_a_dry_run_fails_as_submit_would(monkeypatch, tmp_path, capsys, hub, aws_env):
    monkeypatch.setenv("PATH", _stub_tools(tmp_path / "bin", names=("pulumi", "aws")))
    assert submit.main("submit", ["--stack", "us-west-2", "--dry-run"]) == submit.EXIT_UNREACHABLE
    assert "kubectl is not on PATH" in capsys.readouterr().err
    monkeypatch.setenv("PATH", _stub_tools(tmp_path / "all"))
    assert submit.main("submit", ["--stack", "us-west-2", "--dry-run"]) == submit.EXIT_UNREACHABLE
    assert "AWS credentials problem calling sts:GetCallerIdentity: NoCredentialsError" in capsys.readouterr().err
    assert submit.main("submit", ["--stack", "us-west-2", "--dry-run", "--set", "data.path=missing.jsonl"]) == 2
    assert "data.path 'missing.jsonl' is not a file or folder here" in capsys.readouterr().err


def test_a_dry_run_at_an_address_checks_the_config_and_never_connects(monkeypatch, capsys):
    code = submit.main("submit", ["--address", "http://127.0.0.1:9", "--preset", "demo-cpu", "--storage-path",
                                  "/tmp/runs", "--dry-run"])
    out = capsys.readouterr()
    assert code == 0 and "no Ray Jobs API" not in out.err
    assert "dry run: every check passed" in out.out
