"""The stack configuration: one typed, validated model of `Pulumi.<stack>.yaml`.

Written by `python -m capacity probe`, read by the Pulumi program and by `python -m infra render`.
This module imports no Pulumi so the probe and the tests can use it without a Pulumi engine.
Every bad value is refused naming the key, the value and the fix, before any resource is declared
or any cloud call is made; all of a config's problems are reported at once (`ConfigErrors`), and
read from a stack file, each with its line.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from infra.instance_types import GPU_INSTANCE_TYPES, INSTANCE_TYPES, SYSTEM_INSTANCE_TYPES

_T = TypeVar("_T")

PROJECT = "ray-eks"
"""The Pulumi project name (Pulumi.yaml `name`): the namespace of this program's config keys."""

REGION_KEY = "aws:region"
DEFAULT_RAY_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"

_REGION_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
_AZ_ID_RE = re.compile(r"^[a-z]{3,4}\d-az\d+$")
_K8S_VERSION_RE = re.compile(r"^1\.(\d+)$")
_SEMVER_RE = re.compile(r"^v?\d+\.\d+\.\d+$")
# A pinned image: a tag like v1.1 / 2.58.0 / train-ml-cuda-v1.1 (ends in a version), or a digest.
_PINNED_TAG_RE = re.compile(r"^[\w.-]*v?\d+(\.\d+)+$")
_DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
_ARN_RE = re.compile(r"^arn:aws[\w-]*:(iam|sts)::\d{12}:(role|user|assumed-role)/[\w+=,.@/-]+$")
_BUCKET_PREFIX_RE = re.compile(r"^[a-z0-9][a-z0-9-]{1,38}$")
_ACCOUNT_RE = re.compile(r"^\d{12}$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# EKS gives each minor about 14 months of standard support, then bills extended support at 6x the
# control-plane price. This is the window the program was last checked against; move it with the
# EKS release calendar (a minor that has left standard support is refused, not silently upgraded).
SUPPORTED_KUBERNETES_MINORS = range(32, 36)


class _NoValue:
    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Any = _NoValue()
"""The `value` of a problem with a whole file rather than with one key's value."""


class ConfigError(ValueError):
    """A user mistake in the stack configuration: the key, the value, and how to fix it; `where`
    is the file and line it was read from, when known."""

    def __init__(self, key: str, value: Any, problem: str, fix: str, *, where: str = ""):
        self.key, self.value, self.problem, self.fix, self.where = key, value, problem, fix, where
        subject = key if value is NO_VALUE else f"{key} = {value!r}"
        super().__init__(f"{where + ': ' if where else ''}{subject}: {problem}. Fix: {fix}")


class ConfigErrors(ConfigError):
    """Several problems of one config, each a ConfigError; one line each. The attributes of the
    first are this error's own."""

    def __init__(self, errors: Sequence[ConfigError]):
        self.errors = tuple(errors)
        first = self.errors[0]
        self.key, self.value, self.problem, self.fix, self.where = (
            first.key, first.value, first.problem, first.fix, first.where)
        ValueError.__init__(self, "\n".join(str(e) for e in self.errors))


def _raise_all(errors: Sequence[ConfigError]) -> None:
    """Raise the one problem as it is, several as ConfigErrors, nothing when there is none."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    """What one region's stack deploys. Field names map to camelCase keys under `ray-eks:`."""

    region: str
    """AWS region of the stack (`aws:region`); the stack is usually named after it."""
    gpu_availability_zone: str
    """AZ name of the GPU node group and its cluster placement group (written by the probe)."""
    gpu_availability_zone_id: str
    """AZ ID of the same zone (e.g. usw2-az1): stable across accounts, unlike the name."""
    gpu_instance_type: str = "g6.12xlarge"
    """GPU node instance type; must be in infra/instance_types.py and support EFA."""
    gpu_node_count: int = 2
    """GPU nodes, also the Ray worker replicas (desired = min = max)."""
    system_instance_type: str = "m7i.xlarge"
    """Instance type of the one system node (KubeRay operator, Ray head); no GPU."""
    kubernetes_version: str = "1.34"
    """EKS Kubernetes minor version, in standard support."""
    ray_image: str = DEFAULT_RAY_IMAGE
    """Ray Train image for head and workers, pinned by a version tag or a digest."""
    ray_version: str = "2.58.0"
    """Ray version inside `ray_image` (RayCluster `rayVersion`); the client pins the same."""
    nvidia_device_plugin_chart_version: str = "0.20.0"
    """Helm chart version of nvidia-device-plugin."""
    efa_device_plugin_chart_version: str = "v0.5.30"
    """Helm chart version of aws-efa-k8s-device-plugin."""
    kuberay_operator_chart_version: str = "1.7.0"
    """Helm chart version of kuberay-operator (must match the CRD the RayCluster is built for)."""
    api_access_cidrs: tuple[str, ...] = ("0.0.0.0/0",)
    """CIDRs allowed to reach the public EKS API endpoint (IAM authentication still applies)."""
    admin_principal_arns: tuple[str, ...] = ()
    """IAM roles/users given cluster-admin through EKS access entries (the deployer always is)."""
    checkpoint_bucket_prefix: str = "ray-checkpoints"
    """Name prefix of the checkpoint bucket; Pulumi appends a random suffix."""
    retain_checkpoints_on_destroy: bool = True
    """Keep the checkpoint bucket (and its data) on `pulumi destroy`."""
    ray_namespace: str = "ray"
    """Kubernetes namespace of the RayCluster and its service account."""
    gpu_root_volume_gib: int = 200
    """Root volume of GPU nodes: the DLC image is tens of GB, unpacked."""
    eks_image_registry_account: str = "602401143452"
    """AWS account of the regional ECR registry that serves EKS add-on images (the EFA device
    plugin). Most regions use the default; opt-in regions have their own account, listed in the
    EKS user guide under "Amazon container image registries"."""

    @property
    def gpu_instance(self):
        return INSTANCE_TYPES[self.gpu_instance_type]

    @property
    def system_instance(self):
        return INSTANCE_TYPES[self.system_instance_type]


def config_key(field_name: str) -> str:
    """The stack-file key of a StackConfig field: `region` -> `aws:region`, others camelCase."""
    if field_name == "region":
        return REGION_KEY
    head, *rest = field_name.split("_")
    return f"{PROJECT}:{head}{''.join(p.capitalize() for p in rest)}"


_FIELDS = {config_key(f.name): f for f in fields(StackConfig)}
KNOWN_KEYS = tuple(_FIELDS)


def _fix_cmd(key: str, example: Any) -> str:
    return f"pulumi config set {key} {example}  (or edit it in Pulumi.<stack>.yaml)"


def _as_int(key: str, raw: Any) -> int:
    if isinstance(raw, bool):
        raise ConfigError(key, raw, "must be a whole number", _fix_cmd(key, 2))
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"\s*-?\d+\s*", raw):
        return int(raw)
    raise ConfigError(key, raw, "must be a whole number", _fix_cmd(key, 2))


def _as_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ConfigError(key, raw, "must be true or false", _fix_cmd(key, "true"))


def _as_str(key: str, raw: Any) -> str:
    if isinstance(raw, float):
        default = _FIELDS[key].default
        example = default if isinstance(default, str) else "<value>"
        raise ConfigError(key, raw, "was read as a number, which drops trailing zeros (an unquoted "
                          "1.30 becomes 1.3)", f'quote it in the stack file: {key}: "{example}"')
    if isinstance(raw, (str, int)) and not isinstance(raw, bool):
        return str(raw).strip()
    raise ConfigError(key, raw, "must be a string", _fix_cmd(key, "<value>"))


def _as_str_list(key: str, raw: Any) -> tuple[str, ...]:
    # Pulumi hands structured values to the program as JSON strings; stack files hold YAML lists.
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raw = [s for s in raw.split(",") if s.strip()]
    if not isinstance(raw, (list, tuple)) or not all(isinstance(x, str) for x in raw):
        raise ConfigError(key, raw, "must be a list of strings",
                          f"pulumi config set --path '{key}[0]' <value>")
    return tuple(x.strip() for x in raw)


def _coerce(name: str, key: str, raw: Any) -> Any:
    annotation = str(_FIELDS[key].type)
    if annotation == "int":
        return _as_int(key, raw)
    if annotation == "bool":
        return _as_bool(key, raw)
    if annotation.startswith("tuple"):
        return _as_str_list(key, raw)
    return _as_str(key, raw)


def _problems(cfg: StackConfig, *, placement: bool = True,
              known_bad: Sequence[ConfigError] = ()) -> list[ConfigError]:
    """Every problem of `cfg`, after those already found (`known_bad`), one per key: a key whose
    value is already refused is not judged again."""
    found = list(known_bad)
    checks = (*(_placement_problems(cfg, skip={e.key for e in known_bad}) if placement else ()),
              *_settings_problems(cfg))
    for problem in checks:
        if problem.key not in {e.key for e in found}:
            found.append(problem)
    return found


def az_id_prefix(region: str) -> str:
    """The region part of its AZ IDs (usw2 in usw2-az1): the country code, a letter per part of
    the name (two for northeast and the like), the number; every region follows the scheme."""
    country, *parts, number = region.split("-")
    return country + "".join(_DIRECTION_LETTERS.get(part, part[:1]) for part in parts) + number


_DIRECTION_LETTERS = {"northeast": "ne", "northwest": "nw", "southeast": "se", "southwest": "sw"}


def _placement_problems(cfg: StackConfig, *, skip: set[str]) -> Iterator[ConfigError]:
    k = config_key
    region_ok = k("region") not in skip and bool(_REGION_RE.match(cfg.region))
    if k("region") not in skip and not region_ok:
        yield ConfigError(k("region"), cfg.region, "is not an AWS region name",
                          _fix_cmd(k("region"), "<region>"))
    if region_ok and (not cfg.gpu_availability_zone.startswith(cfg.region) or not re.fullmatch(
            r"[a-z]", cfg.gpu_availability_zone[len(cfg.region):] or "-")):
        yield ConfigError(k("gpu_availability_zone"), cfg.gpu_availability_zone,
                          f"is not an availability zone of {cfg.region}",
                          f"run `python -m capacity probe --stack <stack> --regions {cfg.region}`"
                          " to pick one")
    if not _AZ_ID_RE.match(cfg.gpu_availability_zone_id):
        yield ConfigError(k("gpu_availability_zone_id"), cfg.gpu_availability_zone_id,
                          "is not an AZ ID like usw2-az1",
                          "run `python -m capacity probe` to write the AZ name and ID together")
    elif region_ok and not cfg.gpu_availability_zone_id.startswith(az_id_prefix(cfg.region) + "-"):
        yield ConfigError(k("gpu_availability_zone_id"), cfg.gpu_availability_zone_id,
                          f"is an AZ ID of another region ({cfg.region}'s start with "
                          f"{az_id_prefix(cfg.region)}-)",
                          f"run `python -m capacity probe --stack <stack> --regions {cfg.region}` "
                          "to write the AZ name and ID together")
    if cfg.gpu_instance_type not in GPU_INSTANCE_TYPES:
        yield ConfigError(k("gpu_instance_type"), cfg.gpu_instance_type,
                          "is not a known EFA-capable GPU instance type",
                          f"use one of {', '.join(GPU_INSTANCE_TYPES)} (or add it to "
                          "infra/instance_types.py)")
    if cfg.gpu_node_count < 1:
        yield ConfigError(k("gpu_node_count"), cfg.gpu_node_count, "must be at least 1",
                          _fix_cmd(k("gpu_node_count"), 2))


def _settings_problems(cfg: StackConfig) -> Iterator[ConfigError]:
    k = config_key
    if cfg.system_instance_type not in SYSTEM_INSTANCE_TYPES:
        yield ConfigError(k("system_instance_type"), cfg.system_instance_type,
                          "is not a known non-GPU instance type",
                          f"use one of {', '.join(SYSTEM_INSTANCE_TYPES)}")
    m = _K8S_VERSION_RE.match(cfg.kubernetes_version)
    if not m or int(m.group(1)) not in SUPPORTED_KUBERNETES_MINORS:
        ok = ", ".join(f"1.{v}" for v in SUPPORTED_KUBERNETES_MINORS)
        yield ConfigError(k("kubernetes_version"), cfg.kubernetes_version,
                          f"must be a minor version in EKS standard support ({ok})",
                          _fix_cmd(k("kubernetes_version"), f"1.{SUPPORTED_KUBERNETES_MINORS[-1]}"))
    yield from _image_problems(cfg.ray_image)
    if not _SEMVER_RE.match(cfg.ray_version) or cfg.ray_version.startswith("v"):
        yield ConfigError(k("ray_version"), cfg.ray_version, "must be a Ray release like 2.58.0",
                          _fix_cmd(k("ray_version"), "2.58.0"))
    for name in ("nvidia_device_plugin_chart_version", "efa_device_plugin_chart_version",
                 "kuberay_operator_chart_version"):
        value = getattr(cfg, name)
        if not _SEMVER_RE.match(value):
            yield ConfigError(k(name), value, "must pin an exact chart version (X.Y.Z)",
                              _fix_cmd(k(name), getattr(StackConfig, name, None) or "1.0.0"))
    if not cfg.api_access_cidrs:
        yield ConfigError(k("api_access_cidrs"), list(cfg.api_access_cidrs),
                          "must list at least one CIDR allowed to reach the EKS API",
                          f"pulumi config set --path '{k('api_access_cidrs')}[0]' 203.0.113.0/24")
    for cidr in cfg.api_access_cidrs:
        try:
            ipaddress.IPv4Network(cidr, strict=True)
        except ValueError as exc:
            yield ConfigError(k("api_access_cidrs"), cidr, f"is not an IPv4 CIDR ({exc})",
                              "write it like 203.0.113.0/24")
    for arn in cfg.admin_principal_arns:
        if not _ARN_RE.match(arn):
            yield ConfigError(k("admin_principal_arns"), arn, "is not an IAM role or user ARN",
                              "write it like arn:aws:iam::123456789012:role/Admin")
    if not _BUCKET_PREFIX_RE.match(cfg.checkpoint_bucket_prefix):
        yield ConfigError(k("checkpoint_bucket_prefix"), cfg.checkpoint_bucket_prefix,
                          "must be 2-39 lowercase letters, digits or dashes (S3 naming)",
                          _fix_cmd(k("checkpoint_bucket_prefix"), "ray-checkpoints"))
    if not _DNS_LABEL_RE.match(cfg.ray_namespace):
        yield ConfigError(k("ray_namespace"), cfg.ray_namespace,
                          "must be a Kubernetes namespace name (a DNS label)",
                          _fix_cmd(k("ray_namespace"), "ray"))
    if not 100 <= cfg.gpu_root_volume_gib <= 16384:
        yield ConfigError(k("gpu_root_volume_gib"), cfg.gpu_root_volume_gib,
                          "must be between 100 and 16384 GiB (the DLC image alone is tens of GB)",
                          _fix_cmd(k("gpu_root_volume_gib"), 200))
    if not _ACCOUNT_RE.match(cfg.eks_image_registry_account):
        yield ConfigError(k("eks_image_registry_account"), cfg.eks_image_registry_account,
                          "must be a 12-digit AWS account ID",
                          _fix_cmd(k("eks_image_registry_account"), "602401143452"))


def _image_problems(image: str) -> Iterator[ConfigError]:
    key = config_key("ray_image")
    if _DIGEST_RE.search(image):
        return
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        yield ConfigError(key, image, "has no tag, so it is not pinned",
                          f"pin a version tag or digest, e.g. {DEFAULT_RAY_IMAGE}")
    if tag == "latest" or not _PINNED_TAG_RE.match(tag):
        yield ConfigError(key, image, f"tag {tag!r} is not a version (vX.Y) or a digest",
                          f"pin a version tag or digest, e.g. {DEFAULT_RAY_IMAGE}")


def parse_stack_config(values: Mapping[str, Any]) -> StackConfig:
    """Build a StackConfig from `key -> value` (a stack file's `config:` or Pulumi's config).

    Keys of other namespaces (aws:profile, pulumi:tags, ...) are left alone; unknown keys in this
    program's namespace are refused with the nearest known key as a hint.
    """
    kwargs, errors = _coerce_values(values)
    for f in fields(StackConfig):
        if f.name not in kwargs and f.default is MISSING:  # no default: required
            key = config_key(f.name)
            if key not in {e.key for e in errors}:
                errors.append(ConfigError(key, None, "is required",
                                          "run `python -m capacity probe --stack <stack>` to write it"))
            kwargs[f.name] = ""
    cfg = StackConfig(**kwargs)
    _raise_all(_problems(cfg, known_bad=errors))
    return cfg


PLACEMENT_FIELDS = ("region", "gpu_availability_zone", "gpu_availability_zone_id",
                    "gpu_instance_type", "gpu_node_count")
"""What `python -m capacity probe` writes into a stack file; it keeps every other key."""


def check_settings(values: Mapping[str, Any]) -> None:
    """Validate every key of a stack file except the placement the probe is about to write, so a
    bad value fails before the probe makes any cloud call."""
    values_by_name, errors = _coerce_values(values)
    kwargs = {name: value for name, value in values_by_name.items() if name not in PLACEMENT_FIELDS}
    cfg = StackConfig(region="", gpu_availability_zone="", gpu_availability_zone_id="", **kwargs)
    _raise_all(_problems(cfg, placement=False, known_bad=errors))


def _coerce_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[ConfigError]]:
    """Field name -> typed value for this program's keys, and the problems: values of the wrong
    type, unknown keys of its namespace, and keys that look meant for it under another namespace."""
    kwargs: dict[str, Any] = {}
    errors: list[ConfigError] = []
    for key, raw in values.items():
        try:
            if key in _FIELDS:
                if isinstance(raw, Mapping) and "secure" in raw:
                    raise ConfigError(key, "<secret>", "is not a secret value",
                                      _fix_cmd(key, "<value>") + " without --secret")
                kwargs[_FIELDS[key].name] = _coerce(_FIELDS[key].name, key, raw)
            elif key.startswith(f"{PROJECT}:"):
                hint = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
                raise ConfigError(key, raw, "is not a setting of this program",
                                  f"did you mean {hint[0]}?" if hint else
                                  f"remove it; known keys: {', '.join(KNOWN_KEYS)}")
            elif (meant := _meant_for_this_program(key)) is not None:
                raise ConfigError(key, raw, f"is not read: this program's keys are under "
                                  f"`{PROJECT}:`", f"did you mean {meant}?")
        except ConfigError as exc:
            errors.append(exc)
    return kwargs, errors


_NAMES = {key.split(":", 1)[1].lower(): key for key in KNOWN_KEYS if key.startswith(f"{PROJECT}:")}


def _meant_for_this_program(key: str) -> str | None:
    """The key of this program that `key` (of another namespace, or of none) was probably meant
    as: a namespace spelt close to the project's (`rayeks:`), or a setting's own name under
    another namespace (`aws:gpuNodeCount`). None for genuine keys of other namespaces."""
    namespace, _, name = key.rpartition(":")
    close_namespace = difflib.SequenceMatcher(a=namespace.lower(), b=PROJECT).ratio() >= 0.75
    if name.lower() in _NAMES:
        return _NAMES[name.lower()]
    if close_namespace:
        hint = difflib.get_close_matches(f"{PROJECT}:{name}", KNOWN_KEYS, n=1)
        return hint[0] if hint else f"{PROJECT}:{name}"
    return None


def stack_file(stack: str, project_dir: Path | str = ".") -> Path:
    return Path(project_dir) / f"Pulumi.{stack}.yaml"


def read_stack_values(path: Path) -> dict[str, Any]:
    """The `config:` mapping of a stack file; ConfigError when the file is not a stack file."""
    from ruamel.yaml import YAML, YAMLError

    try:
        doc = YAML(typ="safe").load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), NO_VALUE, "does not exist",
                          f"run `python -m capacity probe --stack {_stack_name(path)}` to create it"
                          f"{_other_stacks_hint(path)}") from None
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or exc.__class__.__name__
        raise ConfigError(where, NO_VALUE, f"is not valid YAML ({problem})",
                          "fix the syntax, or move the file away and run the probe again") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("config", {}), dict):
        raise ConfigError(str(path), NO_VALUE, "is not a Pulumi stack file (no `config:` mapping)",
                          "fix the file, or move it away and run the probe again")
    return dict(doc.get("config") or {})


def _stack_name(path: Path) -> str:
    return path.name.removeprefix("Pulumi.").removesuffix(".yaml")


def _other_stacks_hint(path: Path) -> str:
    stacks = sorted(_stack_name(p) for p in path.parent.glob("Pulumi.*.yaml"))
    close = difflib.get_close_matches(_stack_name(path), stacks, n=1)
    if close:
        return f"; or did you mean --stack {close[0]}?"
    return f"; stacks here: {', '.join(stacks)}" if stacks else ""


def key_lines(path: Path) -> dict[str, int]:
    """The line (1-based) of each key under `config:` in a stack file that parses."""
    from ruamel.yaml import YAML

    config = (YAML().load(path.read_text()) or {}).get("config") or {}
    return {key: config.lc.key(key)[0] + 1 for key in config}


def located(error: ConfigError, path: Path) -> ConfigError:
    """`error` (each of ConfigErrors) read from the stack file `path`: with the file and the line
    of its key, in line order, and the stack's name in its fix."""
    errors = error.errors if isinstance(error, ConfigErrors) else (error,)
    lines = key_lines(path)
    placed = sorted(((lines.get(e.key, 0), i, e) for i, e in enumerate(errors)), key=lambda t: t[:2])
    out = [ConfigError(e.key, e.value, e.problem,
                       e.fix.replace("Pulumi.<stack>.yaml", path.name).replace("<stack>", _stack_name(path)),
                       where=f"{path}:{line}" if line else str(path))
           for line, _, e in placed]
    return out[0] if len(out) == 1 else ConfigErrors(out)


def _checked(path: Path, check: Callable[[dict[str, Any]], _T]) -> _T:
    values = read_stack_values(path)
    try:
        return check(values)
    except ConfigError as exc:
        raise located(exc, path) from None


def check_stack_file_settings(path: Path) -> None:
    """`check_settings` of a stack file: every problem at once, each with its line."""
    _checked(path, check_settings)


def load_stack_config(stack: str, project_dir: Path | str = ".") -> StackConfig:
    """The validated config of `Pulumi.<stack>.yaml`: every problem at once, each with its line."""
    return _checked(stack_file(stack, project_dir), parse_stack_config)
