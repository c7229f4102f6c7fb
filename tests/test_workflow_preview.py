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


WORKFLOWS = sorted((REPO_ROOT / ".github" / "workflows").glob("*.y*ml"))
USES_LINE = re.compile(r"^\s*(?:-\s+)?uses:\s*(?P<ref>\S+)(?P<comment>.*)$")
PINNED_BY_SHA = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
VERSION_COMMENT = re.compile(r"^\s+#\s*v\d+(\.\d+)*\s*$")


def _uses_in(document) -> list[str]:
    """Every `uses:` value of a parsed workflow: of its steps, and of jobs that call a reusable workflow."""
    found = []
    for job in (document.get("jobs") or {}).values():
        if "uses" in job:
            found.append(job["uses"])
        found += [step["uses"] for step in job.get("steps", []) if "uses" in step]
    return found


def unpinned_uses(text: str) -> list[str]:
    """The `uses:` lines of a workflow that do not name their action by a full commit SHA followed by
    the release's tag in a comment (`uses: owner/repo@<40 hex> # vX.Y.Z`). A tag can be moved to other
    code by whoever controls the action's repository; a commit cannot. Actions of this repository
    (`./...`) are its own code and need no pin."""
    lines = [m for m in map(USES_LINE.match, text.splitlines()) if m]
    parsed = _uses_in(YAML(typ="safe").load(text))
    assert sorted(m["ref"] for m in lines) == sorted(parsed), "a `uses:` this check does not read line by line"
    return [m.group(0).strip() for m in lines if not m["ref"].startswith("./") and not (
        PINNED_BY_SHA.match(m["ref"]) and VERSION_COMMENT.match(m["comment"]))]


def test_every_action_of_every_workflow_is_pinned_by_commit_sha_with_its_version_in_a_comment():
    assert WORKFLOW in WORKFLOWS
    for path in WORKFLOWS:
        text = path.read_text()
        assert _uses_in(YAML(typ="safe").load(text)), path
        assert unpinned_uses(text) == [], path


@pytest.mark.parametrize("line", [
    "uses: actions/checkout@v4.2.2",
    "uses: actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683",  # no version to read
    "uses: actions/checkout@11bd719 # v4.2.2",  # a short SHA is as movable as a tag
    "uses: actions/checkout@main # v4.2.2",
    "uses: actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # the one we use",
])
def test_a_workflow_step_pinned_any_other_way_is_found(line):
    text = f"on: push\njobs:\n  j:\n    runs-on: ubuntu-24.04\n    steps:\n      - {line}\n"
    assert unpinned_uses(text) == [f"- {line}"]
    reusable = f"on: push\njobs:\n  j:\n    {line}\n"
    assert unpinned_uses(reusable) == [line]
    pinned = "uses: actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2"
    assert unpinned_uses(text.replace(line, pinned)) == []


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

