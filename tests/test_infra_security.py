"""The security controls of the stack as declared (docs/SECURITY.md): who reaches the EKS API, what
pods can reach on the node and on the network, what the Ray pods may do, and how the bucket is
reached; under Pulumi mocks and through the policy pack, as the engine would feed it."""

from __future__ import annotations

from infra.config import read_stack_values
from test_infra_program import REPO_ROOT, run_program
from test_policy_pack import analyze, servicer  # noqa: F401  (a fixture)

import rules  # noqa: E402  (the policy pack's, on the path test_policy_pack puts it on)

STACK_FILE = REPO_ROOT / "Pulumi.us-west-2.yaml"


# --- the EKS API endpoint -------------------------------------------------------------------------

def test_an_api_open_to_every_address_is_declared_only_as_the_stack_says_and_then_passes_the_pack(
        monkeypatch, servicer):  # noqa: F811
    config = {**read_stack_values(STACK_FILE),
              "ray-eks:apiAccessCidrs": ["0.0.0.0/0"], "ray-eks:apiOpenToInternet": True}
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch)
    cluster = run.one("eks:index:Cluster").inputs
    assert (cluster["endpointPublicAccess"], cluster["publicAccessCidrs"]) == (True, ["0.0.0.0/0"])
    assert cluster["clusterTags"] == {rules.OPEN_TO_INTERNET_TAG: "true"}
    # What pulumi-eks makes of it: the aws:eks/cluster:Cluster with the cluster tags among its tags.
    created = {"vpcConfig": {"endpointPublicAccess": True, "publicAccessCidrs": cluster["publicAccessCidrs"]},
               "tags": {"Name": "cluster-eks", **cluster["clusterTags"]}}
    assert analyze(servicer, rules.EKS_CLUSTER, created) == []
    assert [d.policyName for d in analyze(servicer, rules.EKS_CLUSTER, {**created, "tags": {}})] == [
        "eks-api-not-open-to-all"]
    # The committed stack: no public endpoint, and no such tag.
    committed = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=read_stack_values(STACK_FILE),
                            monkeypatch=monkeypatch)
    assert "clusterTags" not in committed.one("eks:index:Cluster").inputs
    assert any("the EKS API endpoint is private" in w for w in committed.warnings)
