"""Writing the placement into Pulumi.<stack>.yaml changes the placement keys and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from capacity.probe import Evidence, Placement
from capacity.stackfile import (
    StackFileError,
    placement_values,
    plan_update,
    precheck,
    write,
)
from infra.config import ConfigError, parse_stack_config, read_stack_values

PLACEMENT = Placement(region="us-west-2", zone="us-west-2c", zone_id="usw2-az3",
                      instance_type="g6.12xlarge", node_count=4, evidence=Evidence.QUOTA_OK)
VALUES = placement_values(PLACEMENT)

RICH_FILE = """\
# Team stack. Keep the comments!
encryptionsalt: v1:abc:def==
config:
  aws:profile: ml-platform   # trailing comment on an unrelated key
  aws:region: us-west-2
  # placement (rewritten by the probe)
  ray-eks:gpuAvailabilityZone: us-west-2a
  ray-eks:gpuAvailabilityZoneId: "usw2-az1"
  ray-eks:gpuInstanceType: g6.12xlarge
  ray-eks:gpuNodeCount: 2   # two nodes for now

  ray-eks:apiAccessCidrs:
    - 203.0.113.0/24   # office
    - 198.51.100.0/24
  ray-eks:adminPrincipalArns: ['arn:aws:iam::123456789012:role/Admin']
  ray-eks:rayNamespace: 'ray'
  secrets:token:
    secure: v1:AAAABBBBCCCC
  pulumi:tags: {team: ml, cost-center: "42"}
# end of file
"""


def other_lines(text: str) -> list[str]:
    keys = ("aws:region:", "ray-eks:gpuAvailabilityZone:", "ray-eks:gpuAvailabilityZoneId:",
            "ray-eks:gpuInstanceType:", "ray-eks:gpuNodeCount:")
    return [line for line in text.splitlines(keepends=True) if not line.strip().startswith(keys)]


def test_existing_file_keeps_every_other_byte(tmp_path: Path):
    path = tmp_path / "Pulumi.team.yaml"
    path.write_text(RICH_FILE)
    update = plan_update(path, VALUES)
    assert other_lines(update.after) == other_lines(RICH_FILE)
    assert len(update.after.splitlines()) == len(RICH_FILE.splitlines())
    assert "  ray-eks:gpuAvailabilityZone: us-west-2c\n" in update.after
    assert '  ray-eks:gpuAvailabilityZoneId: "usw2-az3"\n' in update.after
    assert "  ray-eks:gpuNodeCount: 4   # two nodes for now\n" in update.after
    assert path.read_text() == RICH_FILE  # planning writes nothing
    write(update)
    assert path.read_text() == update.after
    values = read_stack_values(path)
    assert values["aws:profile"] == "ml-platform" and values["pulumi:tags"]["team"] == "ml"


def test_committed_stack_file_still_parses_after_the_write(repo_root: Path, tmp_path: Path):
    original = (repo_root / "Pulumi.us-west-2.yaml").read_text()
    path = tmp_path / "Pulumi.us-west-2.yaml"
    path.write_text(original)
    update = plan_update(path, VALUES)
    write(update)
    assert other_lines(path.read_text()) == other_lines(original)
    cfg = parse_stack_config(read_stack_values(path))
    assert (cfg.gpu_availability_zone, cfg.gpu_availability_zone_id, cfg.gpu_node_count) == (
        "us-west-2c", "usw2-az3", 4)
    assert cfg.api_access_cidrs == ()


def test_missing_keys_are_inserted_next_to_the_placement_keys(tmp_path: Path):
    path = tmp_path / "Pulumi.x.yaml"
    before = ("config:\n  aws:region: us-west-2\n  ray-eks:rayNamespace: ray   # ns\n"
              "  ray-eks:apiAccessCidrs:\n  - 10.0.0.0/8\n")
    path.write_text(before)
    after = plan_update(path, VALUES).after
    assert after == ("config:\n  aws:region: us-west-2\n"
                     "  ray-eks:gpuAvailabilityZone: us-west-2c\n"
                     "  ray-eks:gpuAvailabilityZoneId: usw2-az3\n"
                     "  ray-eks:gpuInstanceType: g6.12xlarge\n"
                     "  ray-eks:gpuNodeCount: 4\n"
                     "  ray-eks:rayNamespace: ray   # ns\n"
                     "  ray-eks:apiAccessCidrs:\n  - 10.0.0.0/8\n")


def test_missing_file_is_created_and_parses(tmp_path: Path):
    path = tmp_path / "Pulumi.us-west-2.yaml"
    update = plan_update(path, VALUES)
    assert update.before is None and update.changed and "/dev/null" in update.diff()
    write(update)
    cfg = parse_stack_config(read_stack_values(path))
    assert (cfg.region, cfg.gpu_availability_zone, cfg.gpu_instance_type) == (
        "us-west-2", "us-west-2c", "g6.12xlarge")


@pytest.mark.parametrize("before", ["", "# just a comment\n", "# no newline"])
def test_empty_or_comment_only_file_gets_a_config_block(tmp_path: Path, before: str):
    path = tmp_path / "Pulumi.x.yaml"
    path.write_text(before)
    after = plan_update(path, VALUES).after
    assert after.startswith(before) and "config:\n  aws:region: us-west-2\n" in after
    assert read_stack_values(path) == {}


def test_same_placement_is_no_change(tmp_path: Path):
    path = tmp_path / "Pulumi.x.yaml"
    write(plan_update(path, VALUES))
    again = plan_update(path, VALUES)
    assert not again.changed and again.diff() == ""


@pytest.mark.parametrize("text", [
    "config:\n  aws:region: [unclosed\n",
    "- just\n- a list\n",
    "config: [1, 2]\n",
])
def test_malformed_file_is_refused_and_untouched(tmp_path: Path, text: str):
    path = tmp_path / "Pulumi.x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        precheck(path)
    with pytest.raises(ConfigError):
        plan_update(path, VALUES)
    assert path.read_text() == text


def test_a_layout_no_round_trip_reproduces_is_left_untouched(tmp_path: Path):
    path = tmp_path / "Pulumi.x.yaml"
    text = "config:\n   aws:region: us-west-2\n   ray-eks:gpuNodeCount: 2\n"  # 3-space indent
    path.write_text(text)
    with pytest.raises(StackFileError, match="left untouched"):
        precheck(path)
    assert path.read_text() == text



def test_precheck_refuses_a_bad_kept_value_before_any_cloud_call(tmp_path):
    """A bad value in a key the probe keeps (here the Ray namespace) fails the precheck, which the
    CLI runs before its first AWS call; the placement keys it rewrites are not judged there."""
    from capacity.stackfile import precheck

    path = tmp_path / "Pulumi.us-west-2.yaml"
    path.write_text("config:\n  aws:region: us-west-2\n  ray-eks:gpuNodeCount: 0\n"
                    "  ray-eks:rayNamespace: Not_A_Label\n")
    with pytest.raises(ConfigError, match="ray-eks:rayNamespace"):
        precheck(path)
    path.write_text("config:\n  aws:region: us-west-2\n  ray-eks:gpuNodeCount: 0\n")
    precheck(path)  # gpuNodeCount is the probe's to rewrite
