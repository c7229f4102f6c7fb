"""The MLflow tracking server (`ray-eks:mlflow`): access to it granted action by action on its own ARN,
and its artifacts kept in a bucket of this stack (which the bucket rules hold private and encrypted)."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from .resources import BUCKETS, UNKNOWN, StackResource, StackViolation, as_list

MLFLOW_TRACKING_SERVER = "aws:sagemaker/mlflowTrackingServer:MlflowTrackingServer"
IAM_POLICIES = ("aws:iam/rolePolicy:RolePolicy", "aws:iam/policy:Policy", "aws:iam/userPolicy:UserPolicy",
                "aws:iam/groupPolicy:GroupPolicy")
MLFLOW_ACTION_PREFIX = "sagemaker-mlflow:"
_SERVER_ARN_RE = re.compile(r"^arn:aws[\w-]*:sagemaker:[a-z0-9-]+:\d{12}:mlflow-tracking-server/[A-Za-z0-9-]+$")


def _document(policy: Any) -> Mapping[str, Any] | None:
    if policy is UNKNOWN or policy is None:
        return None
    if isinstance(policy, str):
        try:
            policy = json.loads(policy)
        except json.JSONDecodeError:
            return None
    return policy if isinstance(policy, Mapping) else None


def _grants_mlflow(actions: list[Any]) -> bool:
    return any(isinstance(a, str) and (a == "*" or a.lower().startswith(MLFLOW_ACTION_PREFIX)) for a in actions)


def mlflow_access_violations(props: Mapping[str, Any]) -> list[str]:
    """A policy statement that allows MLflow actions names each action (no `*`, no NotAction) and
    only tracking server ARNs, spelt out (no `*`, no NotResource)."""
    document = _document(props.get("policy"))
    if document is None:
        return []
    statements = document.get("Statement")
    out = []
    for i, statement in enumerate(as_list(statements) if not isinstance(statements, Mapping) else [statements]):
        if not isinstance(statement, Mapping) or statement.get("Effect") != "Allow":
            continue
        actions = as_list(statement.get("Action")) if not isinstance(statement.get("Action"), str) \
            else [statement["Action"]]
        if "NotAction" in statement:
            not_actions = statement["NotAction"]
            if not _grants_mlflow(as_list(not_actions) if not isinstance(not_actions, str) else [not_actions]):
                out.append(f"statement {i} allows everything but {not_actions!r}, MLflow's actions included: "
                           "name the actions it needs")
            continue
        if not _grants_mlflow(actions):
            continue
        wild = [a for a in actions if isinstance(a, str) and "*" in a and
                (a == "*" or a.lower().startswith(MLFLOW_ACTION_PREFIX))]
        if wild:
            out.append(f"statement {i} allows {', '.join(wild)}: name each sagemaker-mlflow action it needs")
        if "NotResource" in statement:
            out.append(f"statement {i} allows MLflow actions on everything but {statement['NotResource']!r}: "
                       "name the tracking server's ARN")
            continue
        resource = statement.get("Resource")
        resources = [resource] if isinstance(resource, str) or resource is UNKNOWN else as_list(resource)
        bad = [r for r in resources if r is not UNKNOWN and not (isinstance(r, str) and _SERVER_ARN_RE.match(r))]
        if bad or not resources:
            out.append(f"statement {i} allows MLflow actions on {', '.join(map(str, bad)) or 'no resource'}: "
                       "limit it to the tracking server's ARN")
    return out


def tracking_server_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """Every MLflow tracking server keeps its artifacts in a bucket of this stack, so that the bucket
    rules (public access blocked, encryption) hold for them too."""
    buckets = [r for r in resources if r.type in BUCKETS]
    out = []
    for server in (r for r in resources if r.type == MLFLOW_TRACKING_SERVER):
        linked = set(server.property_dependencies.get("artifactStoreUri", ()))
        if any(b.urn in linked for b in buckets):
            continue
        uri = server.props.get("artifactStoreUri")
        if uri is UNKNOWN:
            continue
        names = {b.props.get("bucket") for b in buckets if isinstance(b.props.get("bucket"), str)}
        bucket = uri.removeprefix("s3://").split("/", 1)[0] if isinstance(uri, str) and uri.startswith("s3://") \
            else None
        if bucket not in names:
            out.append(StackViolation(server.urn, f"the tracking server's artifact store {uri!r} is not in a bucket "
                                      "of this stack (its public access block and encryption are not checked)"))
    return out
