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
    assert "GPU nodes at us-west-2's On-Demand list price of 2026-01-21, the rest at us-east-1 list prices" in first


def _stack_in(region: str, zone: str, zone_id: str, folder: Path) -> Path:
    """A stack file for `region` as the capacity probe writes one."""
    from capacity.stackfile import PLACEMENT_KEYS, plan_update, write

    path = folder / f"Pulumi.{region}.yaml"
    write(plan_update(path, dict(zip(PLACEMENT_KEYS, (region, zone, zone_id, "g6.12xlarge", 2)))))
    return path


def test_render_prices_the_stacks_own_region(capsys, tmp_path):
    """Every stack was priced at us-east-1's list prices of 2025-06-05, whatever its region."""
    _stack_in("eu-central-1", "eu-central-1a", "euc1-az2", tmp_path)
    assert main(["render", "--stack", "eu-central-1", "--project-dir", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "2x g6.12xlarge $11.51" in first  # 2 x 5.75429, against 2 x 4.6016 in us-east-1
    assert "GPU nodes at eu-central-1's On-Demand list price of 2026-01-21" in first
    # A region the table has no price for is priced from us-east-1's, and says so.
    _stack_in("sa-east-1", "sa-east-1a", "sae1-az1", tmp_path)
    assert main(["render", "--stack", "sa-east-1", "--project-dir", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "2x g6.12xlarge $9.20" in first and "the table has no sa-east-1 price for the GPU instance type" in first


def test_the_price_table_covers_the_regions_the_probe_tries(tmp_path):
    from capacity.cli import DEFAULT_REGIONS
    from infra.instance_types import GPU_INSTANCE_TYPES, INSTANCE_TYPES
    from infra.prices import NOT_PRICED_BY_REGION, ON_DEMAND_USD_PER_HOUR, PRICES_DATE, on_demand

    assert set(ON_DEMAND_USD_PER_HOUR) == set(DEFAULT_REGIONS) and PRICES_DATE == "2026-01-21"
    assert all(t in INSTANCE_TYPES for row in ON_DEMAND_USD_PER_HOUR.values() for t in row)
    # Every GPU type of the instance table is priced by region, or the table says it lacks it.
    regional = {t for row in ON_DEMAND_USD_PER_HOUR.values() for t in row}
    assert regional | set(NOT_PRICED_BY_REGION) == set(GPU_INSTANCE_TYPES)
    assert not regional & set(NOT_PRICED_BY_REGION)
    for gpu_type in GPU_INSTANCE_TYPES:
        price = on_demand(gpu_type, "us-west-2")
        assert price.region in ("us-west-2", "us-east-1")
        assert price.usd_per_hour == INSTANCE_TYPES[gpu_type].usd_per_hour if gpu_type in NOT_PRICED_BY_REGION \
            else price.usd_per_hour > 0
    assert on_demand("g6.12xlarge", "ap-northeast-1").usd_per_hour > on_demand("g6.12xlarge", "us-west-2").usd_per_hour


def test_render_prices_the_instance_families_the_regional_table_lacks(capsys, tmp_path):
    """p5en and p6-b200 are priced at their us-east-1 list price, saying so; p5e has no On-Demand
    price, which its line says instead of counting 0 silently."""
    for gpu_type, gpus_line, note in (
            ("p5en.48xlarge", "2x p5en.48xlarge $126.59",
             "us-east-1 list prices of 2025-06-05: the regional table has no price for p5en.48xlarge"),
            ("p5e.48xlarge", "2x p5e.48xlarge (no On-Demand list price: its Capacity Block's fee, paid up front, "
             "is not counted) $0.000", "the rest at us-east-1 list prices of 2025-06-05")):
        from capacity.stackfile import PLACEMENT_KEYS, plan_update, write

        write(plan_update(tmp_path / "Pulumi.us-west-2.yaml", dict(zip(
            PLACEMENT_KEYS, ("us-west-2", "us-west-2a", "usw2-az1", gpu_type, 2)))))
        assert main(["render", "--stack", "us-west-2", "--project-dir", str(tmp_path)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert gpus_line in first and note in first, first
    # A type the table prices elsewhere but not in a region of it was not offered there.
    _stack_in("eu-west-1", "eu-west-1a", "euw1-az1", tmp_path)
    assert main(["render", "--stack", "eu-west-1", "--project-dir", str(tmp_path)]) == 0
    assert "g6.12xlarge was not offered in eu-west-1 on 2026-01-21" in capsys.readouterr().out.splitlines()[0]


def test_render_lists_the_resources_the_program_declares_under_the_tests_mocks(capsys, monkeypatch):
    """`render` showed the in-cluster YAML and no AWS resource; it now runs the program under the mocks
    the program's tests use and prints what it declares, by component, with counts."""
    from test_infra_program import run_program

    from infra.config import read_stack_values
    from infra.resource_tree import tree_lines

    monkeypatch.chdir(REPO_ROOT)
    assert main(["render", "--stack", "us-west-2"]) == 0
    out = capsys.readouterr().out
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2",
                      config=read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml"))
    expected = [f"#   {line}" for line in tree_lines(run)]
    lines = out.splitlines()
    start = lines.index(expected[0])
    assert lines[start:start + len(expected)] == expected
    block = "\n".join(expected)
    subnets = len(run.of_type("aws:ec2/subnet:Subnet"))
    assert subnets >= 2 and f"aws:ec2/subnet:Subnet                                {subnets}" in block
    assert "#   network (ray-eks:infra:Network)" in block
    assert "gpu-nodes (eks:index:ManagedNodeGroup)  (remote: its resources are pulumi-eks's)" in block
    aws = sum(r.typ.startswith("aws:") for r in run.registered())
    assert expected[0].startswith(f"#   {len(run.registered())} resources: {aws} AWS, ")
    assert list(YAML(typ="safe").load_all(out))[0]["kind"] == "RayCluster"  # still valid YAML, comments first


def test_help_shows_the_whole_description(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "without any cloud call or credentials" in " ".join(capsys.readouterr().out.split())


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
