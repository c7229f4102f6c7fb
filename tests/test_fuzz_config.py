"""The stack-config model under generated input (hypothesis): every valid config is accepted, in
the forms a stack file (YAML types) and Pulumi's config (strings, JSON lists) hold it; one bad value
in any key, of a wrong type or out of range or malformed, is refused by a one-line ConfigError that
starts with that key; unknown keys in this program's namespace are refused by name."""

from __future__ import annotations

import ipaddress
import json
import string
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.config import (KNOWN_KEYS, ConfigError, StackConfig, SUPPORTED_KUBERNETES_MINORS,
                          az_id_prefix, config_key, format_utc, parse_stack_config)
from infra.instance_types import GPU_INSTANCE_TYPES, SYSTEM_INSTANCE_TYPES, sells_capacity_blocks

EXAMPLES_VALID = 200
EXAMPLES_PER_BAD_KEY = 40
EXAMPLES_UNKNOWN_KEY = 100
_FUZZ = settings(deadline=None)

REGIONS = ("us-west-2", "us-east-1", "eu-west-1", "eu-central-1", "ap-northeast-1",
           "ap-southeast-2", "us-gov-west-1", "sa-east-1")


def regex(pattern: str) -> st.SearchStrategy[str]:
    return st.from_regex(pattern, fullmatch=True)


def as_int_or_string(ints: st.SearchStrategy[int]) -> st.SearchStrategy:
    """An int as YAML holds it, or as the string Pulumi's config hands the program."""
    return st.one_of(ints, ints.map(str))


def as_list_or_string(items: st.SearchStrategy[list[str]]) -> st.SearchStrategy:
    """A list as YAML holds it, or as JSON (`pulumi config set --path`). A scalar (`a,b`) is
    refused: see `bad_values`."""
    return st.one_of(items, items.map(json.dumps))


valid_cidrs = st.builds(lambda ip, prefix: str(ipaddress.IPv4Network(f"{ip}/{prefix}",
                                                                    strict=False)),
                        st.ip_addresses(v=4), st.integers(10, 32))
"""Four of them open at most a /8's worth; wider lists only with apiOpenToInternet."""
wide_cidrs = st.builds(lambda ip, prefix: str(ipaddress.IPv4Network(f"{ip}/{prefix}", strict=False)),
                       st.ip_addresses(v=4), st.integers(1, 7))
"""Each opens more than a /8's worth of addresses."""
valid_arns = regex(r"arn:aws(-us-gov|-cn)?:iam::\d{12}:(role|user)/"
                   r"[A-Za-z0-9+=.@_-]{1,20}(/[A-Za-z0-9_-]{1,10})?")
valid_versions = regex(r"(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})\.(0|[1-9]\d{0,2})")
valid_images = st.one_of(
    st.builds(lambda repo, tag: f"{repo}:{tag}",
              regex(r"[a-z0-9]+(\.[a-z0-9]+){0,2}(/[a-z0-9-]+){1,3}"),
              st.one_of(regex(r"v?\d{1,3}(\.\d{1,3}){1,3}"),
                        regex(r"[a-z]+(-[a-z]+){0,3}-v\d{1,2}\.\d{1,2}"))),
    st.builds(lambda repo, digest: f"{repo}@sha256:{digest}",
              regex(r"[a-z0-9]+(\.[a-z0-9]+){0,2}(/[a-z0-9-]+){1,3}"),
              regex(r"[0-9a-f]{64}")))


@st.composite
def valid_configs(draw) -> dict:
    """A whole valid `config:` mapping: required keys, any subset of the rest, other namespaces."""
    region = draw(st.sampled_from(REGIONS))
    values = {
        "aws:region": region,
        "ray-eks:gpuAvailabilityZone": region + draw(st.sampled_from("abcdef")),
        "ray-eks:gpuAvailabilityZoneId": f"{az_id_prefix(region)}-az{draw(st.integers(1, 12))}",
    }
    optional = {
        "ray-eks:gpuInstanceType": st.sampled_from(GPU_INSTANCE_TYPES),
        "ray-eks:gpuNodeCount": as_int_or_string(st.integers(1, 64)),
        "ray-eks:systemInstanceType": st.sampled_from(SYSTEM_INSTANCE_TYPES),
        "ray-eks:kubernetesVersion": st.sampled_from([f"1.{m}" for m in
                                                      SUPPORTED_KUBERNETES_MINORS]),
        "ray-eks:rayImage": valid_images,
        "ray-eks:allowUnpinnedImages": st.booleans(),
        "ray-eks:rayVersion": valid_versions,
        "ray-eks:nvidiaDevicePluginChartVersion": valid_versions,
        "ray-eks:efaDevicePluginChartVersion": valid_versions.map(lambda v: "v" + v),
        "ray-eks:kuberayOperatorChartVersion": valid_versions,
        "ray-eks:clusterAutoscalerChartVersion": valid_versions,
        "ray-eks:nodeTerminationHandlerChartVersion": valid_versions,
        "ray-eks:apiAccessCidrs": as_list_or_string(st.lists(valid_cidrs, max_size=4)),
        "ray-eks:adminPrincipalArns": as_list_or_string(st.lists(valid_arns, max_size=3)),
        "ray-eks:checkpointBucketPrefix": regex(r"[a-z0-9][a-z0-9-]{1,38}"),
        "ray-eks:retainCheckpointsOnDestroy": st.one_of(
            st.booleans(), st.sampled_from(["true", "false", "True", " FALSE "])),
        "ray-eks:rayNamespace": regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"),
        "ray-eks:gpuRootVolumeGib": as_int_or_string(st.integers(100, 16384)),
        "ray-eks:eksImageRegistryAccount": regex(r"\d{12}"),
        "ray-eks:systemNodeCount": as_int_or_string(st.integers(1, 10)),
        "ray-eks:podIdentityAgentVersion": regex(r"v\d{1,2}\.\d{1,2}\.\d{1,2}-eksbuild\.\d{1,2}"),
        "ray-eks:vpcCniVersion": regex(r"v\d{1,2}\.\d{1,2}\.\d{1,2}-eksbuild\.\d{1,2}"),
        "ray-eks:nodeMonitoringAgentVersion": regex(r"v\d{1,2}\.\d{1,2}\.\d{1,2}-eksbuild\.\d{1,2}"),
        "ray-eks:checkpointNoncurrentVersionDays": as_int_or_string(st.integers(0, 3650)),
        "ray-eks:checkpointIncompleteUploadDays": as_int_or_string(st.integers(1, 365)),
        "ray-eks:workersReadyTimeoutMinutes": as_int_or_string(st.integers(0, 180)),
        "ray-eks:gpuIdleMinutes": as_int_or_string(st.integers(0, 1440)),
        # Whole 2 MiB pages, within what the smallest GPU type of the table can offer.
        "ray-eks:gpuHugePagesMib": as_int_or_string(st.integers(0, 5281).map(lambda n: 2 * n)),
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        values[key] = draw(optional[key])
    if draw(st.booleans()):  # a capacity reservation for the placement, as the tools write it
        values.update(draw(valid_reservations(values)))
    elif draw(st.booleans()):
        # On-Demand said outright (a Spot stack is valid only without reservation keys, which the
        # bad-value test adds one at a time: Spot stacks are tests/test_infra_spot.py's)
        values["ray-eks:gpuCapacityType"] = "on-demand"
    if draw(st.booleans()):  # other namespaces are not this program's to judge
        values.update({"aws:profile": "dev", "pulumi:tags": {"team": "ml"}})
    return values


@st.composite
def valid_reservations(draw, placement: dict) -> dict:
    """Reservation keys that agree with `placement` (its type, AZ and node count)."""
    instance_type = placement.setdefault("ray-eks:gpuInstanceType", "g6.12xlarge")
    nodes = int(placement.get("ray-eks:gpuNodeCount", 2))
    kind = "capacity-block" if sells_capacity_blocks(instance_type) and draw(st.booleans()) \
        else "on-demand"
    start = draw(st.datetimes(datetime(2024, 1, 1), datetime(2030, 1, 1),
                              timezones=st.just(timezone.utc)))
    end = start + draw(st.timedeltas(timedelta(minutes=1), timedelta(days=182)))
    return {"ray-eks:gpuReservationId": draw(regex(r"cr-[0-9a-f]{17}")),
            "ray-eks:gpuReservationType": kind,
            "ray-eks:gpuReservationInstanceType": instance_type,
            "ray-eks:gpuReservationAvailabilityZone": placement["ray-eks:gpuAvailabilityZone"],
            "ray-eks:gpuReservationInstanceCount": draw(as_int_or_string(st.integers(nodes, 64))),
            "ray-eks:gpuReservationStart": format_utc(start),
            "ray-eks:gpuReservationEnd": draw(st.sampled_from([format_utc(end), end]))}


# --- bad values, per key -------------------------------------------------------------------------

not_a_scalar = st.one_of(st.none(), st.booleans(), st.lists(st.text(max_size=5), max_size=2),
                         st.just({"secure": "v1:AAAA"}), st.just({"nested": "x"}))
not_a_string_list = st.one_of(
    st.none(), st.booleans(), st.integers(), st.just({"secure": "v1:AAAA"}),
    st.lists(st.one_of(st.integers(), st.none(), st.booleans()), min_size=1, max_size=3),
    st.sampled_from(['{"a": 1}', "5", "null", "[1, 2]"]))
no_digits = st.text(string.ascii_letters + "-_", min_size=1, max_size=12)
bad_versions = st.one_of(
    st.sampled_from(["latest", ">=1.7", "1.7", "1.7.x", "1.7.0-rc1", "1.7.0.1", "", "~1.7.0"]),
    regex(r"\d{1,3}\.\d{1,3}"), no_digits, not_a_scalar)


def not_cidr(value: str) -> bool:
    try:
        ipaddress.IPv4Network(value.strip(), strict=True)
    except ValueError:
        return True
    return False


bad_cidrs = st.one_of(
    st.sampled_from(["10.0.0.1/8", "10.0.0.0/33", "300.0.0.0/8", "::/0", "10.0.0.0/-1",
                     "0.0.0.0/0/0", "  "]),
    st.ip_addresses(v=4).map(str),  # an address without its /32
    st.builds(lambda ip, prefix: f"{ip}/{prefix}", st.ip_addresses(v=4), st.integers(0, 32)
              ).filter(not_cidr),
    st.text(max_size=20).filter(lambda s: "," not in s and not_cidr(s)))

def out_of_range(low: int, high: int) -> st.SearchStrategy:
    """A whole number outside [low, high], or not a whole number at all."""
    return st.one_of(as_int_or_string(st.integers(max_value=low - 1)),
                     as_int_or_string(st.integers(min_value=high + 1)),
                     st.floats(), no_digits, st.booleans(), st.none())


BAD: dict[str, st.SearchStrategy] = {
    "aws:region": st.one_of(
        st.sampled_from(["europe", "us-west", "US-WEST-2", "us_west_2", "uswest2", "",
                         "us-west-2a"]),
        regex(r"[a-z]{2}-[a-z]+-\d{2,3}"), regex(r"[A-Z]{2}-[a-z]+-\d"), not_a_scalar),
    "ray-eks:gpuAvailabilityZone": st.one_of(
        st.sampled_from(["mx-none-9b", "us-west-2", "us-west-2-a", "us-west-2A", "usw2-az1"]),
        regex(r"us-west-2([a-z]{2,3}|\d|-[a-z])"), not_a_scalar),
    "ray-eks:gpuAvailabilityZoneId": st.one_of(
        st.sampled_from(["az1", "usw2-az", "USW2-AZ1", "us-west-2a", "usw2az1"]),
        regex(r"[a-z]{3,4}-az\d"), regex(r"[a-z]{1,2}\d-az\d"), not_a_scalar),
    "ray-eks:gpuInstanceType": st.one_of(
        st.sampled_from([*SYSTEM_INSTANCE_TYPES, "g6.48xlarge", "G6.12XLARGE", ""]),
        st.text(max_size=15).filter(lambda s: s.strip() not in GPU_INSTANCE_TYPES),
        not_a_scalar),
    "ray-eks:gpuNodeCount": st.one_of(
        as_int_or_string(st.integers(max_value=0)), st.floats(allow_nan=True), no_digits,
        st.booleans(), st.none(), st.lists(st.integers(), max_size=2)),
    "ray-eks:systemInstanceType": st.one_of(
        st.sampled_from([*GPU_INSTANCE_TYPES, "m7i.metal", ""]),
        st.text(max_size=15).filter(lambda s: s.strip() not in SYSTEM_INSTANCE_TYPES),
        not_a_scalar),
    "ray-eks:kubernetesVersion": st.one_of(
        st.integers(0, 99).filter(lambda m: m not in SUPPORTED_KUBERNETES_MINORS).map(
            lambda m: f"1.{m}"),
        st.sampled_from(["2.34", "1.34.1", "latest", "v1.34", "1.", ""]), not_a_scalar),
    "ray-eks:rayImage": st.one_of(
        st.builds(lambda repo, tag: f"{repo}:{tag}", regex(r"[a-z0-9]+(/[a-z0-9-]+){1,2}"),
                  st.one_of(st.just("latest"), regex(r"[a-z]+(-[a-z]+)?"), regex(r"\d+"))),
        regex(r"[a-z0-9]+(/[a-z0-9-]+){1,2}"),
        st.builds(lambda repo, digest: f"{repo}@sha256:{digest}",
                  regex(r"[a-z0-9]+(/[a-z0-9-]+){1,2}"), regex(r"[0-9a-f]{1,63}")),
        not_a_scalar),
    "ray-eks:rayVersion": st.one_of(bad_versions, valid_versions.map(lambda v: "v" + v)),
    "ray-eks:nvidiaDevicePluginChartVersion": bad_versions,
    "ray-eks:efaDevicePluginChartVersion": bad_versions,
    "ray-eks:kuberayOperatorChartVersion": bad_versions,
    "ray-eks:clusterAutoscalerChartVersion": bad_versions,
    "ray-eks:nodeTerminationHandlerChartVersion": bad_versions,
    "ray-eks:apiAccessCidrs": st.one_of(
        st.just(["0.0.0.0/0"]), st.just("0.0.0.0/0"), not_a_string_list,
        st.just(["0.0.0.0/1", "128.0.0.0/1"]),
        st.builds(lambda good, wide: good + [wide], st.lists(valid_cidrs, max_size=3), wide_cidrs),
        st.lists(valid_cidrs, min_size=1, max_size=3).map(",".join),  # a scalar, not a list
        st.builds(lambda good, bad, at: good[:at] + [bad] + good[at:],
                  st.lists(valid_cidrs, max_size=3), bad_cidrs, st.integers(0, 3))),
    "ray-eks:adminPrincipalArns": st.one_of(
        not_a_string_list,
        st.lists(st.sampled_from([
            "alice", "arn:aws:iam::12345:role/x", "arn:aws:s3:::bucket",
            "arn:aws:iam::123456789012:group/admins", "arn:aws:iam::123456789012:role/",
            "arn:aws:iam:us-east-1:123456789012:role/x", "arn:azure:iam::123456789012:role/x",
            "arn:aws:sts::123456789012:assumed-role/Admin/alice",
            "arn:aws:sts::123456789012:federated-user/bob"]),
            min_size=1, max_size=2)),
    "ray-eks:checkpointBucketPrefix": st.one_of(
        st.sampled_from(["My_Bucket", "a", "-ckpt", "ckpt.bucket", "x" * 40, ""]),
        regex(r"[a-z0-9][a-z0-9-]{39,50}"), regex(r"[a-z0-9]*[A-Z_.][a-z0-9]*"), not_a_scalar),
    "ray-eks:retainCheckpointsOnDestroy": st.one_of(
        st.sampled_from(["maybe", "yes", "no", "1", "0", "", "on"]), st.integers(), st.none(),
        st.lists(st.booleans(), max_size=1), st.floats()),
    "ray-eks:allowUnpinnedImages": st.one_of(
        st.sampled_from(["maybe", "yes", "sha256", ""]), st.integers(), st.none(), st.floats()),
    "ray-eks:apiOpenToInternet": st.one_of(
        st.sampled_from(["maybe", "yes", "open", "0.0.0.0/0", ""]), st.integers(), st.none(),
        st.lists(st.booleans(), max_size=1), st.floats()),
    "ray-eks:mlflow": st.one_of(
        st.sampled_from(["maybe", "yes", "on", "Small", ""]), st.integers(), st.none(),
        st.lists(st.booleans(), max_size=1), st.floats()),
    "ray-eks:mlflowSize": st.one_of(
        st.sampled_from(["small", "MEDIUM", "XL", "ml.t3.medium", ""]),
        st.text(max_size=12).filter(lambda s: s.strip() not in ("Small", "Medium", "Large")), not_a_scalar),
    "ray-eks:rayNamespace": st.one_of(
        st.sampled_from(["Ray_NS", "-ray", "ray-", "ray.ns", "r" * 64, ""]),
        regex(r"[a-z0-9]*[A-Z_.][a-z0-9]*"), not_a_scalar),
    "ray-eks:gpuRootVolumeGib": st.one_of(
        as_int_or_string(st.integers(max_value=99)),
        as_int_or_string(st.integers(min_value=16385)),
        st.floats(), no_digits, st.booleans(), st.none()),
    "ray-eks:gpuReservationId": st.one_of(
        st.sampled_from(["cr-", "sg-0123456789abcdef0", "CR-0123456789ABCDEF0", "cr-xyz",
                         "cr-0123456789abcdef01234"]), not_a_scalar),
    "ray-eks:gpuReservationType": st.one_of(
        st.sampled_from(["spot", "default", "ondemand", "Capacity-Block"]), not_a_scalar),
    "ray-eks:gpuReservationInstanceType": st.one_of(
        st.sampled_from(["g6.48xlarge", "p5", "G6.12XLARGE"]), not_a_scalar),
    "ray-eks:gpuReservationAvailabilityZone": st.one_of(
        st.sampled_from(["mx-none-9b", "usw2-az1", "us-west"]), not_a_scalar),
    "ray-eks:gpuReservationInstanceCount": st.one_of(
        as_int_or_string(st.integers(max_value=-1)), st.floats(allow_nan=True), no_digits,
        st.booleans(), st.none()),
    "ray-eks:gpuReservationStart": st.one_of(
        st.sampled_from(["tomorrow", "2026-13-01T00:00:00Z", "2026-12-01T10:00:00"]),
        not_a_scalar),
    "ray-eks:gpuReservationEnd": st.one_of(
        st.sampled_from(["next week", "2026-12-01", "2026-12-01T25:00:00Z"]), not_a_scalar),
    "ray-eks:eksImageRegistryAccount": st.one_of(
        regex(r"\d{1,11}"), regex(r"\d{13,15}"), st.sampled_from(["ecr", "60240114345x", ""]),
        not_a_scalar),
    "ray-eks:systemNodeCount": out_of_range(1, 10),
    "ray-eks:podIdentityAgentVersion": st.one_of(
        st.sampled_from(["latest", "v1.3.10", "1.3.10-eksbuild.2", "v1.3-eksbuild.1", "",
                         "v1.3.10-eksbuild"]), no_digits, not_a_scalar),
    "ray-eks:vpcCniVersion": st.one_of(
        st.sampled_from(["latest", "v1.22.3", "1.22.3-eksbuild.1", ""]), no_digits, not_a_scalar),
    "ray-eks:nodeMonitoringAgentVersion": st.one_of(
        st.sampled_from(["latest", "v1.4.0", "1.4.0-eksbuild.2", ""]), no_digits, not_a_scalar),
    "ray-eks:checkpointNoncurrentVersionDays": out_of_range(0, 3650),
    "ray-eks:checkpointIncompleteUploadDays": out_of_range(1, 365),
    "ray-eks:workersReadyTimeoutMinutes": out_of_range(0, 180),
    "ray-eks:gpuIdleMinutes": out_of_range(0, 1440),
    "ray-eks:gpuCapacityType": st.one_of(
        st.sampled_from(["Spot", "SPOT", "ondemand", "on_demand", "capacity-block", ""]), st.integers()),
    "ray-eks:gpuSpotPriceUsdPerHour": st.one_of(
        st.sampled_from(["cheap", "$1.83", "1,83", "-1.5", "1.8.3"]), no_digits),
    "ray-eks:gpuHugePagesMib": st.one_of(
        as_int_or_string(st.integers(max_value=-1)),
        as_int_or_string(st.integers(0, 10**6).map(lambda n: 2 * n + 1)),  # half a page
        as_int_or_string(st.integers(21122, 10**6).map(lambda n: 2 * n)),  # more than any node
        st.floats(), no_digits, st.booleans(), st.none()),
}


def test_every_key_of_the_model_has_a_bad_value_strategy():
    assert set(BAD) == set(KNOWN_KEYS)
    assert set(KNOWN_KEYS) == {config_key(f) for f in StackConfig.__dataclass_fields__}


def assert_rejected_naming(values: dict, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_stack_config(values)
    message = str(caught.value)
    assert caught.value.key == key, message
    assert message.startswith(f"{key} = ") and "Fix: " in message
    assert "\n" not in message


@settings(_FUZZ, max_examples=EXAMPLES_VALID)
@given(values=valid_configs())
def test_valid_configs_are_accepted(values):
    cfg = parse_stack_config(values)
    assert cfg.region == values["aws:region"]
    assert cfg.gpu_availability_zone == values["ray-eks:gpuAvailabilityZone"]


@pytest.mark.parametrize("key", sorted(BAD))
@settings(_FUZZ, max_examples=EXAMPLES_PER_BAD_KEY)
@given(data=st.data())
def test_one_bad_value_is_rejected_naming_its_key(key, data):
    values = data.draw(valid_configs(), label="valid config")
    values[key] = data.draw(BAD[key], label=key)
    assert_rejected_naming(values, key)


@settings(_FUZZ, max_examples=EXAMPLES_UNKNOWN_KEY)
@given(values=valid_configs(), name=regex(r"[a-zA-Z][a-zA-Z0-9]{0,30}"), value=st.text())
def test_unknown_keys_of_this_program_are_rejected_by_name(values, name, value):
    key = f"ray-eks:{name}"
    if key in KNOWN_KEYS:
        return
    values[key] = value
    assert_rejected_naming(values, key)


@pytest.mark.parametrize("key", ["aws:region", "ray-eks:gpuAvailabilityZone",
                                 "ray-eks:gpuAvailabilityZoneId"])
def test_a_missing_required_key_is_named(key):
    values = {"aws:region": "us-west-2", "ray-eks:gpuAvailabilityZone": "us-west-2a",
              "ray-eks:gpuAvailabilityZoneId": "usw2-az1"}
    del values[key]
    assert_rejected_naming(values, key)
