"""Pinned images and chart versions: every container image and Helm chart names a release, and an image
its digest."""

from __future__ import annotations

import re
from typing import Any, Iterator, Mapping, Sequence

from .resources import POD_SPEC_PATHS, RAY_CLUSTER, UNKNOWN, as_list, pod_containers, value_at

_DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
# A tag pins a release when it carries a version (v1.1, 2.58.0-py311, train-ml-cuda-v1.1).
_VERSION_IN_TAG_RE = re.compile(r"(?:^|[-_.])v?\d+\.\d+(?:\.\d+)*(?:$|[-_.+])")
_EXACT_CHART_VERSION_RE = re.compile(
    r"^v?\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")


def tag_pin_violation(tag: Any) -> str | None:
    """Why an image tag names no release (None when it does, e.g. v1.1 or 2.58.0-py311)."""
    text = str(tag)
    if text == "latest" or not _VERSION_IN_TAG_RE.search(text):
        return f"tag {text!r} names no release; pin a version tag (vX.Y) or a digest"
    return None


def image_pin_violation(image: Any) -> str | None:
    """Why `image` is not pinned to a release (None when it is): a digest or a version tag."""
    if image is UNKNOWN:
        return None
    if not isinstance(image, str) or not image.strip():
        return f"image {image!r} is not an image reference"
    if _DIGEST_RE.search(image):
        return None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"image {image} has no tag (means :latest); pin a version tag (vX.Y) or a digest"
    problem = tag_pin_violation(last.rsplit(":", 1)[1])
    return f"image {image}: {problem}" if problem else None


def _pod_specs(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    if resource_type == RAY_CLUSTER:
        yield "head", value_at(props, "spec", "headGroupSpec", "template", "spec")
        for i, group in enumerate(as_list(value_at(props, "spec", "workerGroupSpecs"))):
            gname = value_at(group, "groupName")
            yield f"worker group {gname if isinstance(gname, str) else i}", value_at(
                group, "template", "spec")
    elif resource_type in POD_SPEC_PATHS:
        yield "pod", value_at(props, *POD_SPEC_PATHS[resource_type])


def workload_image_violations(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Every container image of a RayCluster or Kubernetes workload is pinned."""
    out: list[str] = []
    for where, pod_spec in _pod_specs(resource_type, props):
        for name, container in pod_containers(pod_spec):
            problem = image_pin_violation(container.get("image"))
            if problem:
                out.append(f"{where}, container {name}: {problem}")
    return out


def digest_pin_violations(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Every container image of a RayCluster or Kubernetes workload names its digest: a tag, even a
    version tag, is a pointer its registry's owner can move to other code; a digest is the content.
    (`python -m infra lock-images` pins the stack's images.)"""
    out: list[str] = []
    for where, pod_spec in _pod_specs(resource_type, props):
        for name, container in pod_containers(pod_spec):
            image = container.get("image")
            if isinstance(image, str) and image.strip() and not _DIGEST_RE.search(image):
                out.append(f"{where}, container {name}: image {image} is pinned by tag only, which its registry "
                           "can move to other code; pin its digest (python -m infra lock-images --stack <stack> "
                           "does for the stack's images)")
    return out


def _helm_value_images(values: Any, path: str = "values") -> Iterator[tuple[str, Any, bool]]:
    """(path, image or tag, is_tag) for each image setting in Helm values."""
    if isinstance(values, Mapping):
        for key, value in values.items():
            here = f"{path}.{key}"
            if key == "image" and isinstance(value, str):
                yield here, value, False
            elif key == "image" and isinstance(value, Mapping) and "tag" in value:
                yield f"{here}.tag", value["tag"], True
            yield from _helm_value_images(value, here)
    elif isinstance(values, Sequence) and not isinstance(values, str):
        for i, value in enumerate(values):
            yield from _helm_value_images(value, f"{path}[{i}]")


def helm_violations(props: Mapping[str, Any]) -> list[str]:
    """An exact chart version, and no floating image tag in the values."""
    out: list[str] = []
    version = props.get("version")
    if version is not UNKNOWN:
        if not isinstance(version, str) or not _EXACT_CHART_VERSION_RE.match(version.strip()):
            chart = props.get("chart")
            out.append(f"Helm chart {chart!r} version {version!r} is not an exact version "
                       "(X.Y.Z): without one Helm installs whatever is newest")
    for path, value, is_tag in _helm_value_images(props.get("values")):
        if value is UNKNOWN or (is_tag and value in ("", None)):
            continue  # an empty tag means the chart's appVersion, pinned by the chart version
        problem = tag_pin_violation(value) if is_tag else image_pin_violation(value)
        if problem:
            out.append(f"{path}: {problem}")
    return out
