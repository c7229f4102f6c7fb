"""`ray-eks:mlflow`: the Pulumi program under mocks with the setting (a SageMaker managed MLflow tracking
server, its artifact store under the checkpoint prefix, the Ray pods' access to it and nothing more,
its ARN and UI URL exported, its cost estimated) and without it (the stack unchanged), the setting's
validation, and the policy pack on exactly what the program registers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_infra_program import REPO_ROOT, _Mocks, run_program

from infra import outputs
from infra.config import ConfigError, parse_stack_config, read_stack_values
from infra.cost import cost_summary, estimated_cost_per_hour
from infra.tracking import POD_ACTIONS, server_name

sys.path.insert(0, str(REPO_ROOT / "policy"))
import rules  # noqa: E402
from test_policy_pack import analyze, analyze_stack, servicer  # noqa: E402,F401

SERVER = "aws:sagemaker/mlflowTrackingServer:MlflowTrackingServer"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
ACCOUNT = "123456789012"
BUCKET = "ray-checkpoints-abc123"


class _TrackingMocks(_Mocks):
    """The mocks, with the tracking server's outputs as SageMaker returns them."""

    def new_resource(self, args):
        resource_id, state = super().new_resource(args)
        if args.typ == SERVER:
            name = args.inputs["trackingServerName"]
            state.update(arn=f"arn:aws:sagemaker:{self.region}:{ACCOUNT}:mlflow-tracking-server/{name}",
                         trackingServerUrl=f"https://t-{name}.{self.region}.experiments.sagemaker.aws")
        return resource_id, state


def _config(**settings) -> dict:
    return {**read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml"),
            **{f"ray-eks:{k}": v for k, v in settings.items()}}


@pytest.fixture(scope="module")
def runs():
    with pytest.MonkeyPatch.context() as mp:
        plain = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=_config(), monkeypatch=mp,
                            mocks=_TrackingMocks)
    with pytest.MonkeyPatch.context() as mp:
        tracked = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=_config(mlflow="true"), monkeypatch=mp,
                              mocks=_TrackingMocks)
    return plain, tracked


def _policy(run, name: str) -> dict:
    (found,) = [r for r in run.of_type(ROLE_POLICY) if r.name == name]
    return json.loads(found.inputs["policy"])


def test_the_setting_is_off_by_default_and_a_stack_without_it_is_unchanged(runs):
    plain, tracked = runs
    assert parse_stack_config(_config()).mlflow is False
    assert plain.of_type(SERVER) == [] and set(plain.outputs) == set(outputs.ALL)
    # The tracked stack is the plain one plus the tracking component, each other resource as it was.
    key = lambda r: (r.typ, r.name, json.dumps(r.inputs, sort_keys=True, default=str))  # noqa: E731
    added = {key(r) for r in tracked.resources} - {key(r) for r in plain.resources}
    assert {key(r) for r in plain.resources} <= {key(r) for r in tracked.resources}
    assert sorted((typ, name) for typ, name, _ in added) == sorted([
        ("ray-eks:infra:MlflowTracking", "mlflow"), ("aws:iam/role:Role", "mlflow-server-role"),
        (ROLE_POLICY, "mlflow-server-artifacts"), (SERVER, "mlflow-server"), (ROLE_POLICY, "mlflow-pod-access")])


def test_the_tracking_server_keeps_its_artifacts_under_the_checkpoint_prefix(runs):
    _, tracked = runs
    server = tracked.one(SERVER).inputs
    assert server["trackingServerName"] == "ray-eks-us-west-2" and server["trackingServerSize"] == "Small"
    assert server["artifactStoreUri"] == f"s3://{BUCKET}/ray-train/mlflow"
    assert server["roleArn"] == f"arn:aws:iam::{ACCOUNT}:role/mlflow-server-role"
    assert server["automaticModelRegistration"] is False
    assert "mlflow-server-artifacts" in tracked.waits_for(SERVER, "mlflow-server")
    role = next(r for r in tracked.of_type("aws:iam/role:Role") if r.name == "mlflow-server-role")
    trust = json.loads(role.inputs["assumeRolePolicy"])
    assert trust["Statement"][0]["Principal"] == {"Service": "sagemaker.amazonaws.com"}
    artifacts = {s["Sid"]: s for s in _policy(tracked, "mlflow-server-artifacts")["Statement"]}
    assert artifacts["Artifacts"]["Resource"] == f"arn:aws:s3:::{BUCKET}/ray-train/mlflow/*"
    assert artifacts["List"]["Condition"] == {"StringLike": {"s3:prefix": ["ray-train/mlflow", "ray-train/mlflow/*"]}}


def test_the_ray_pods_may_log_to_this_server_only_and_write_its_artifact_prefix(runs):
    _, tracked = runs
    arn = tracked.outputs[outputs.MLFLOW_TRACKING_SERVER_ARN]
    assert arn == f"arn:aws:sagemaker:us-west-2:{ACCOUNT}:mlflow-tracking-server/ray-eks-us-west-2"
    access = next(r for r in tracked.of_type(ROLE_POLICY) if r.name == "mlflow-pod-access")
    checkpoints = next(r for r in tracked.of_type(ROLE_POLICY) if r.name == "checkpoints-access")
    assert access.inputs["role"] == checkpoints.inputs["role"] == "checkpoints-role-id"  # the pods' role
    (statement,) = _policy(tracked, "mlflow-pod-access")["Statement"]
    assert statement["Resource"] == arn and statement["Action"] == list(POD_ACTIONS)
    assert all(a.startswith("sagemaker-mlflow:") and "*" not in a for a in statement["Action"])
    assert statement["Condition"]["StringEquals"]["aws:PrincipalTag/kubernetes-service-account"] == "ray-train"
    # Artifacts (the run's summary) go straight to S3, inside the prefix the checkpoint policy grants.
    objects = next(s for s in _policy(tracked, "checkpoints-access")["Statement"] if s["Sid"] == "Objects")
    assert objects["Resource"] == f"arn:aws:s3:::{BUCKET}/ray-train/*"
    assert tracked.one(SERVER).inputs["artifactStoreUri"].startswith(f"s3://{BUCKET}/ray-train/")


def test_its_arn_and_ui_url_are_exported_and_its_hours_are_in_the_estimate(runs):
    plain, tracked = runs
    assert set(tracked.outputs) == set(outputs.ALL) | set(outputs.TRACKING)
    assert tracked.outputs[outputs.MLFLOW_UI_URL] == "https://t-ray-eks-us-west-2.us-west-2.experiments.sagemaker.aws"
    assert tracked.outputs[outputs.ESTIMATED_COST_PER_HOUR_USD] == pytest.approx(
        plain.outputs[outputs.ESTIMATED_COST_PER_HOUR_USD] + 0.60)
    medium = parse_stack_config(_config(mlflow="true", mlflowSize="Medium"))
    assert estimated_cost_per_hour(medium) == pytest.approx(estimated_cost_per_hour(parse_stack_config(_config()))
                                                            + 1.40, abs=0.01)
    assert "MLflow tracking server (Medium) $1.40" in cost_summary(medium)
    assert "MLflow" not in cost_summary(parse_stack_config(_config()))


def test_the_size_is_a_setting_too(monkeypatch):
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=_config(mlflow=True, mlflowSize="Large"),
                      monkeypatch=monkeypatch, mocks=_TrackingMocks)
    assert run.one(SERVER).inputs["trackingServerSize"] == "Large"


@pytest.mark.parametrize("settings, message", [
    ({"mlflowSize": "medium"}, "ray-eks:mlflowSize = 'medium': is not a tracking server size (Small, Medium, Large). "
                               "Fix: pulumi config set ray-eks:mlflowSize Medium"),
    ({"mlflowSize": "XL"}, "Fix: pulumi config set ray-eks:mlflowSize Small"),
    ({"mlflow": "yes"}, "ray-eks:mlflow = 'yes': must be true or false"),
])
def test_bad_values_are_refused_with_the_fix(settings, message):
    with pytest.raises(ConfigError) as raised:
        parse_stack_config(_config(**{"mlflow": "true", **settings}))
    assert message in str(raised.value)


def test_the_policy_pack_passes_what_the_tracked_program_registers(servicer, runs):  # noqa: F811
    _, tracked = runs
    registered = tracked.registered()
    assert {SERVER, ROLE_POLICY} <= {r.typ for r in registered}
    for resource in registered:
        assert analyze(servicer, resource.typ, resource.inputs) == [], resource.name
    # Stack policies see outputs: the inputs, with what AWS adds (every resource's id; the bucket's name).
    resources = [rules.StackResource(urn=f"urn:pulumi:us-west-2::ray-eks::{r.typ}::{r.name}", type=r.typ,
                                     props={**r.inputs, "id": f"{r.name}-id",
                                            **({"bucket": BUCKET} if r.typ in rules.BUCKETS else {})})
                 for r in registered]
    assert [d.policyName for d in analyze_stack(servicer, resources)] == []


def test_the_policy_pack_refuses_wide_mlflow_access_and_foreign_artifact_stores(servicer, runs):  # noqa: F811
    _, tracked = runs
    (statement,) = _policy(tracked, "mlflow-pod-access")["Statement"]
    for change in ({"Action": ["sagemaker-mlflow:*"]}, {"Resource": "*"},
                   {"Resource": "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/*"}):
        wide = {"Version": "2012-10-17", "Statement": [{**statement, **change}]}
        diagnostics = analyze(servicer, ROLE_POLICY, {"role": "r", "policy": json.dumps(wide)})
        assert [d.policyName for d in diagnostics] == ["mlflow-access-least-privilege"], change
    server = tracked.one(SERVER)
    foreign = rules.StackResource(urn="urn:server", type=SERVER,
                                  props={**server.inputs, "artifactStoreUri": "s3://someone-elses/mlflow"})
    bucket = rules.StackResource(urn="urn:bucket", type=rules.BUCKETS[0], props={"bucket": BUCKET})
    (diagnostic,) = [d for d in analyze_stack(servicer, [foreign, bucket]) if d.policyName.startswith("mlflow")]
    assert diagnostic.urn == "urn:server" and "not in a bucket of this stack" in diagnostic.message


def test_the_docs_name_the_setting_and_the_outputs():
    docs = (REPO_ROOT / "docs" / "INFRA.md").read_text()
    assert [name for name in outputs.TRACKING if f"`{name}`" not in docs] == []
    assert "`ray-eks:mlflow`" in docs and "`ray-eks:mlflowSize`" in docs
    assert Path(REPO_ROOT / "infra" / "tracking.py").is_file()


def test_the_mlflow_rules_as_data():
    arn = f"arn:aws:sagemaker:us-west-2:{ACCOUNT}:mlflow-tracking-server/ray-eks-us-west-2"

    def policy(**statement):
        return {"policy": json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", **statement}]})}

    assert rules.mlflow_access_violations(policy(Action=["sagemaker-mlflow:LogBatch"], Resource=arn)) == []
    assert rules.mlflow_access_violations(policy(Action="s3:GetObject", Resource="*")) == []  # not MLflow's
    assert rules.mlflow_access_violations({"policy": rules.UNKNOWN}) == []  # preview: said at `pulumi up`
    assert rules.mlflow_access_violations(policy(Action="*", Resource=arn)) == [
        "statement 0 allows *: name each sagemaker-mlflow action it needs"]
    assert rules.mlflow_access_violations(policy(NotAction="s3:*", Resource=arn)) == [
        "statement 0 allows everything but 's3:*', MLflow's actions included: name the actions it needs"]
    assert rules.mlflow_access_violations(policy(Action=["sagemaker-mlflow:GetRun"], NotResource=arn)) == [
        f"statement 0 allows MLflow actions on everything but {arn!r}: name the tracking server's ARN"]
    bucket = rules.StackResource(urn="urn:b", type=rules.BUCKETS[0], props={"bucket": BUCKET})
    linked = rules.StackResource(urn="urn:s", type=SERVER, props={"artifactStoreUri": rules.UNKNOWN},
                                 property_dependencies={"artifactStoreUri": ("urn:b",)})
    named = rules.StackResource(urn="urn:s", type=SERVER, props={"artifactStoreUri": f"s3://{BUCKET}/ray-train/mlflow"})
    assert rules.tracking_server_violations([bucket, linked]) == rules.tracking_server_violations([bucket, named]) == []
    assert [v.urn for v in rules.tracking_server_violations([named])] == ["urn:s"]  # no bucket of the stack


def test_a_stack_name_becomes_a_name_sagemaker_takes():
    assert server_name("ray-eks-us-west-2") == "ray-eks-us-west-2"
    assert server_name("ray-eks-dev_1.b") == "ray-eks-dev-1-b"
