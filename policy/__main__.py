"""Policy pack `ray-eks-invariants`: `pulumi preview --policy-pack policy` runs it."""

from pulumi_policy import EnforcementLevel, PolicyPack

from policies import POLICIES

PolicyPack(
    name="ray-eks-invariants",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=POLICIES,
)
