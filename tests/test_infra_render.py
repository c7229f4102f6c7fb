"""`python -m infra render --stack NAME` prints, without any cloud, exactly the objects the
program applies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML

from infra.__main__ import main
from infra.config import load_stack_config
from infra.render import rendered_objects

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_render_prints_the_raycluster_and_each_charts_values(capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert main(["render", "--stack", "us-west-2"]) == 0
    out = capsys.readouterr().out
    docs = list(YAML(typ="safe").load_all(out))
    expected = rendered_objects(load_stack_config("us-west-2", REPO_ROOT))
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
