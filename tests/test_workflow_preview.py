"""The PR preview workflow: valid under actionlint (which is shown to fail on a broken copy), and
shaped as the README describes: OIDC, pinned actions, one job per committed stack file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = REPO_ROOT / ".github" / "workflows" / "preview.yml"
ACTIONLINT = Path(sys.executable).parent / "actionlint"
PINNED = re.compile(r"^[\w.-]+/[\w.-]+@(v\d+\.\d+\.\d+|[0-9a-f]{40})$")


def _actionlint(path: Path) -> subprocess.CompletedProcess:
    assert ACTIONLINT.is_file(), f"{ACTIONLINT} missing: run `make venv`"
    return subprocess.run([str(ACTIONLINT), "-no-color", str(path)], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def workflow() -> dict:
    return YAML(typ="safe").load(WORKFLOW.read_text())


def _steps(workflow: dict, job: str) -> list[dict]:
    return workflow["jobs"][job]["steps"]


def test_actionlint_accepts_the_workflow():
    done = _actionlint(WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("broken", "complaint"), [
    ("needs: stacks", "needs: stack-list"),
    ("${{ matrix.stack }}\n          pulumi-version", "${{ matrix.stak }}\n          pulumi-version"),
    ("id-token: write", "id-token: writ"),
])
def test_actionlint_fails_on_a_broken_copy(tmp_path, broken, complaint):
    text = WORKFLOW.read_text()
    assert broken in text
    bad = tmp_path / "preview.yml"
    bad.write_text(text.replace(broken, complaint, 1))
    done = _actionlint(bad)
    assert done.returncode == 1
    assert "preview.yml:" in done.stdout


def test_runs_on_pull_requests_with_least_permissions(workflow):
    assert "pull_request" in workflow["on"]
    assert workflow["permissions"] == {"id-token": "write", "contents": "read",
                                       "pull-requests": "write"}


def test_every_action_is_pinned_to_an_exact_version(workflow):
    uses = [s["uses"] for job in workflow["jobs"] for s in _steps(workflow, job) if "uses" in s]
    assert uses and all(PINNED.match(u) for u in uses), uses


def test_one_preview_job_per_committed_stack_file(workflow, tmp_path):
    listing = next(s for s in _steps(workflow, "stacks") if s.get("id") == "list")["run"]
    for name in ("Pulumi.us-west-2.yaml", "Pulumi.eu-west-1.yaml", "Pulumi.yaml"):
        (tmp_path / name).write_text("config: {}\n")
    out = tmp_path / "out"
    subprocess.run(["bash", "-euo", "pipefail", "-c", listing], cwd=tmp_path, check=True,
                   env={"PATH": "/usr/bin:/bin", "GITHUB_OUTPUT": str(out)}, timeout=30)
    assert out.read_text() == 'stacks=["eu-west-1","us-west-2"]\n'
    matrix = workflow["jobs"]["preview"]["strategy"]["matrix"]
    assert matrix["stack"] == "${{ fromJSON(needs.stacks.outputs.stacks) }}"


def test_preview_uses_the_makefile_oidc_and_comments_on_the_pr(workflow):
    steps = _steps(workflow, "preview")
    runs = [s.get("run", "") for s in steps]
    assert "make venv" in runs
    aws = next(s for s in steps if s.get("uses", "").startswith("aws-actions/configure-aws-"))
    assert "role-to-assume" in aws["with"] and "aws-access-key-id" not in aws["with"]
    assert aws["with"]["aws-region"] == "${{ steps.stack.outputs.region }}"
    pulumi = next(s for s in steps if s.get("uses", "").startswith("pulumi/actions@"))
    assert pulumi["with"]["command"] == "preview"
    assert pulumi["with"]["comment-on-pr"] is True
    assert pulumi["with"]["stack-name"] == "${{ matrix.stack }}"
    assert pulumi["with"]["policyPacks"] == "policy"
    assert any("policy/venv/bin/pip install" in r and "policy/requirements.txt" in r
               for r in runs)
    assert steps.index(aws) < steps.index(pulumi)


def test_pulumi_cloud_is_reached_with_a_short_lived_team_token_through_oidc_and_no_stored_token(workflow):
    steps = _steps(workflow, "preview")
    auth = next(s for s in steps if s.get("uses", "").startswith("pulumi/auth-actions@"))
    pulumi = next(s for s in steps if s.get("uses", "").startswith("pulumi/actions@"))
    # A team token: the team's access is to these stacks only, not the organization's.
    assert auth["with"]["requested-token-type"] == "urn:pulumi:token-type:access_token:team"
    assert auth["with"]["scope"] == "team:${{ vars.PULUMI_PREVIEW_TEAM }}"
    assert auth["with"]["organization"] == "${{ vars.PULUMI_ORGANIZATION }}"
    assert int(auth["with"]["token-expiration"]) <= 3600
    assert steps.index(auth) < steps.index(pulumi)
    assert "PULUMI_ACCESS_TOKEN" not in pulumi.get("env", {})
    assert "secrets.PULUMI_ACCESS_TOKEN" not in WORKFLOW.read_text()
    assert workflow["permissions"]["id-token"] == "write"


def test_previews_skip_the_cluster_the_read_only_role_cannot_reach(workflow):
    steps = _steps(workflow, "preview")
    pulumi = next(s for s in steps if s.get("uses", "").startswith("pulumi/actions@"))
    assert pulumi["env"]["PULUMI_K8S_SKIP_UPDATE_UNREACHABLE"] == "true"
    # Only the preview does: `pulumi up` elsewhere must fail on an unreachable cluster.
    assert "PULUMI_K8S_SKIP_UPDATE_UNREACHABLE" not in workflow.get("env", {})
    assert pulumi["with"]["command"] == "preview"


def test_the_job_summary_shows_the_in_cluster_objects(workflow, tmp_path):
    steps = _steps(workflow, "preview")
    render = next(s for s in steps if "infra render" in s.get("run", ""))
    pulumi = next(s for s in steps if s.get("uses", "").startswith("pulumi/actions@"))
    assert steps.index(render) < steps.index(pulumi)
    assert render["env"]["STACK"] == "${{ matrix.stack }}"
    summary = tmp_path / "summary.md"
    subprocess.run(["bash", "-euo", "pipefail", "-c", render["run"]], cwd=REPO_ROOT, check=True,
                   env={"PATH": "/usr/bin:/bin", "STACK": "us-west-2",
                        "GITHUB_STEP_SUMMARY": str(summary)}, timeout=120)
    text = summary.read_text()
    assert text.startswith("### In-cluster objects of stack us-west-2\n```yaml\n")
    assert "kind: RayCluster" in text and text.endswith("```\n")

