"""`python -m infra render --stack NAME` prints, without any cloud, exactly the objects the
program applies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from infra.__main__ import main
from infra.config import load_stack_config
from infra.cost import estimated_cost_per_hour
from infra.render import rendered_objects

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_render_prints_the_raycluster_and_each_charts_values(capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert main(["render", "--stack", "us-west-2"]) == 0
    out = capsys.readouterr().out
    docs = list(YAML(typ="safe").load_all(out))
    expected = rendered_objects(load_stack_config("us-west-2", REPO_ROOT), stack="us-west-2")
    assert docs[0] == expected["raycluster"]
    assert docs[1:] == [release["values"] for release in expected["helm"].values()]
    for chart, release in expected["helm"].items():
        assert f"# Helm values of {chart} {release['version']}" in out


def test_render_of_a_missing_stack_exits_2_with_one_line(capsys, tmp_path):
    assert main(["render", "--stack", "nowhere", "--project-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Pulumi.nowhere.yaml" in err and "\n" not in err


def test_render_of_a_bad_value_names_the_key(capsys, tmp_path):
    text = (REPO_ROOT / "Pulumi.us-west-2.yaml").read_text().replace(
        "gpuNodeCount: 2", "gpuNodeCount: 0")
    (tmp_path / "Pulumi.bad.yaml").write_text(text)
    assert main(["render", "--stack", "bad", "--project-dir", str(tmp_path)]) == 2
    assert "ray-eks:gpuNodeCount = 0: must be at least 1" in capsys.readouterr().err


def test_render_runs_as_a_module_without_pulumi_or_a_cloud():
    env = {"PATH": "/usr/bin:/bin", "AWS_CONFIG_FILE": "/nonexistent",
           "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    done = subprocess.run([sys.executable, "-m", "infra", "render", "--stack", "us-west-2"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "kind: RayCluster" in done.stdout


def test_render_starts_with_the_stacks_cost_per_hour(capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert main(["render", "--stack", "us-west-2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    cost = estimated_cost_per_hour(load_stack_config("us-west-2", REPO_ROOT))
    assert first.startswith(f"# estimated cost while it runs: about ${cost:.2f}/hour (2x g6.12xlarge $9.20, ")
    assert "us-east-1 On-Demand list prices of 2025-06-05" in first


def test_help_shows_the_whole_description(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "without any cloud call." in capsys.readouterr().out


def test_every_problem_is_one_error_line(capsys, tmp_path):
    (tmp_path / "Pulumi.bad.yaml").write_text(
        "config:\n  aws:region: us-west-2\n  ray-eks:gpuAvailabilityZone: us-west-2a\n"
        "  ray-eks:gpuAvailabilityZoneId: usw2-az1\n  ray-eks:gpuNodeCount: 0\n"
        "  ray-eks:rayNamespace: X_\n")
    assert main(["render", "--stack", "bad", "--project-dir", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines)
    assert "Pulumi.bad.yaml:5: ray-eks:gpuNodeCount = 0" in lines[0]
    assert "Pulumi.bad.yaml:6: ray-eks:rayNamespace = 'X_'" in lines[1]
