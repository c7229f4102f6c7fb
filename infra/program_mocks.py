"""The Pulumi program run under Pulumi's mocks: every resource it declares, without a cloud or the
Pulumi CLI. The tests run it this way for every stack file (tests/test_infra_program.py), and
`python -m infra render` lists what it declares from the same run (infra/resource_tree.py).

Remote components (eks.Cluster, eks.ManagedNodeGroup) show only their inputs under mocks: their own
children are created by their provider at `pulumi up`, and do not appear here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import runpy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pulumi
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc
from pulumi.runtime.proto import resource_pb2
from pulumi.runtime.sync_await import _sync_await


@dataclass
class Declared:
    typ: str
    name: str
    inputs: dict[str, Any]
    transforms: list = field(default_factory=list)
    """The transforms given to the resource (they reach the children of a remote component)."""
    read: bool = False
    """Read with `Resource.get` (a ReadResource call), not registered. Pulumi's engine hands
    policies the registered resources only."""
    retain_on_delete: bool = False
    """Registered with the `retain_on_delete` option."""
    urn: str = ""
    parent: str = ""
    """The URN of the resource it was declared under (a component), or "" at the top."""


@dataclass
class ProgramRun:
    resources: list[Declared] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)
    secret_outputs: set[str] = field(default_factory=set)
    invokes: list[str] = field(default_factory=list)
    dependencies: dict[str, set[str]] = field(default_factory=dict)
    """URN -> the URNs it depends on (explicitly or through its inputs)."""
    warnings: list[str] = field(default_factory=list)

    def urn(self, typ: str, name: str) -> str:
        (found,) = [u for u in self.dependencies
                    if u.endswith(f"::{name}") and u.split("::")[-2].split("$")[-1] == typ]
        return found

    def waits_for(self, typ: str, name: str) -> set[str]:
        """The names of everything the resource depends on."""
        return {u.rsplit("::", 1)[-1] for u in self.dependencies[self.urn(typ, name)]}

    def of_type(self, typ: str) -> list[Declared]:
        return [r for r in self.resources if r.typ == typ]

    def registered(self) -> list[Declared]:
        """The resources the program registers: what the engine hands stack policies (reads
        left out)."""
        return [r for r in self.resources if not r.read]

    def one(self, typ: str) -> Declared:
        found = self.of_type(typ)
        assert len(found) == 1, f"{len(found)} resources of type {typ}"
        return found[0]


_DIRECTIONS = {"north": "n", "south": "s", "east": "e", "west": "w", "central": "c",
               "northeast": "ne", "southeast": "se", "northwest": "nw", "southwest": "sw"}


def zone_id_prefix(region: str) -> str:
    """How AWS spells a region in its AZ IDs: its country, its direction's initials and its number
    (usw2 for US West 2, apse2 for Asia Pacific Southeast 2)."""
    country, direction, number = region.split("-")
    return f"{country}{_DIRECTIONS[direction]}{number}"


def same_order_zones(region: str) -> list[tuple[str, str]]:
    """An account where zone a is az1, b is az2, c is az3."""
    return [(f"{region}{s}", f"{zone_id_prefix(region)}-az{i}") for s, i in zip("abc", (1, 2, 3))]


class RecordingMonitor(pulumi_mocks.MockMonitor):
    """The mock monitor, also keeping each registration's dependencies (the mocks see only its
    inputs)."""

    def __init__(self, mocks: pulumi.runtime.Mocks, run: ProgramRun):
        super().__init__(mocks)
        self.run = run

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        self.run.dependencies[response.urn] = set(request.dependencies)
        if request.type != "pulumi:pulumi:Stack":
            declared = self._declared(request.type, request.name)
            declared.urn, declared.parent = response.urn, request.parent
            declared.retain_on_delete = bool(request.retainOnDelete)
        return response

    def ReadResource(self, request):
        response = super().ReadResource(request)
        self.run.dependencies[response.urn] = set(request.dependencies)
        declared = self._declared(request.type, request.name)
        declared.read, declared.urn, declared.parent = True, response.urn, request.parent
        return response

    def _declared(self, typ: str, name: str) -> Declared:
        """The resource the mocks just recorded for this request."""
        return next(r for r in reversed(self.run.resources) if (r.typ, r.name) == (typ, name))

    # Without resource references the program sends a referenced resource as its URN or ID, as
    # the engine's state records it. With them, the mock monitor rebuilds each referenced resource
    # on its executor thread, whose `getResource` task lands in Pulumi's global list of RPCs on
    # that thread's own event loop; the program's loop awaiting it before it ends fails with
    # "attached to a different loop" (it did, now and then, in full test runs).
    def GetDeploymentInfo(self, request):
        info = super().GetDeploymentInfo(request)
        features = [f for f in info.supportedFeatures
                    if f != resource_pb2.RESOURCE_MONITOR_FEATURE_RESOURCE_REFERENCES]
        return resource_pb2.DeploymentInfo(supportedFeatures=features)

    def SupportsFeature(self, request):
        if request.id == "resourceReferences":
            return type("SupportsFeatureResponse", (), {"hasSupport": False})
        return super().SupportsFeature(request)


class WarningsLogger(logging.Logger):
    def __init__(self, run: ProgramRun):
        super().__init__("pulumi-mocks")
        self.run = run

    def warning(self, msg, *args, **kwargs):
        self.run.warnings.append(str(msg))


class Mocks(pulumi.runtime.Mocks):
    monitor: RecordingMonitor
    """The mock monitor the program talks to (set by run_program)."""

    def __init__(self, run: ProgramRun, region: str, zones: list[tuple[str, str]] | None = None):
        self.run, self.region = run, region
        self.zones = zones or same_order_zones(region)

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        self.run.resources.append(Declared(args.typ, args.name, dict(args.inputs), list(args.transforms or [])))
        outputs = dict(args.inputs)
        if args.typ == "aws:s3/bucket:Bucket":
            outputs.update(bucket=f"{args.inputs['bucketPrefix']}abc123",
                           arn=f"arn:aws:s3:::{args.inputs['bucketPrefix']}abc123")
        if args.typ == "aws:iam/role:Role":
            outputs["arn"] = f"arn:aws:iam::123456789012:role/{args.name}"
        if args.typ == MANAGED_NODE_GROUP:
            outputs["nodeGroup"] = self.node_group_reference(args.name)
        return f"{args.name}-id", outputs

    def node_group_reference(self, name: str) -> dict[str, Any]:
        """What pulumi-eks's ManagedNodeGroup outputs as `nodeGroup`: a reference to the
        `aws:eks/nodeGroup:NodeGroup` it created, whose state (EKS's answer: the Auto Scaling group
        EKS made for it, `autoscaling_group_of(name)`) the program reads through the engine."""
        urn = f"urn:pulumi:{pulumi.get_stack()}::{pulumi.get_project()}::{NODE_GROUP}::{name}"
        state = {"nodeGroupName": f"{name}-{abs(hash(name)) % 10**7:07d}",
                 "resources": [{"autoscalingGroups": [{"name": autoscaling_group_of(name)}]}]}
        self.monitor.resources[urn] = pulumi_mocks.MockMonitor.ResourceRegistration(urn, f"{name}-ng", state)
        return {rpc._special_sig_key: rpc._special_resource_sig, "urn": urn, "id": f"{name}-ng"}

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.run.invokes.append(args.token)
        if args.token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            return {"names": [n for n, _ in self.zones], "zoneIds": [i for _, i in self.zones],
                    "id": self.region}
        if args.token == "aws:index/getPartition:getPartition":
            return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"}
        return {}


MANAGED_NODE_GROUP = "eks:index:ManagedNodeGroup"
NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"


def autoscaling_group_of(node_group: str) -> str:
    """The name the mocks' EKS gives the Auto Scaling group of the ManagedNodeGroup `node_group`."""
    return f"eks-{node_group}-4d5e6f7-asg"


_PROGRAM_LOOP = asyncio.new_event_loop()


@contextlib.contextmanager
def _program_process(project_dir: Path, exported: dict[str, Any]) -> Iterator[None]:
    """What running the program changes in this process, undone after: the working folder (the
    program reads its stack files from there) and `pulumi.export` (recorded instead)."""
    before, export = os.getcwd(), pulumi.export
    os.chdir(project_dir)
    pulumi.export = lambda key, value: exported.__setitem__(key, value)
    try:
        yield
    finally:
        pulumi.export = export
        os.chdir(before)


def run_program(*, project_dir: Path, stack: str, config: dict[str, Any], zones: list[tuple[str, str]] | None = None,
                mocks: type[Mocks] = Mocks, preview: bool = False) -> ProgramRun:
    """Run the project's __main__.py for `stack` with `config` (the stack file's `config:` mapping), in
    an account whose AZs are `zones` ((name, ID) pairs; by default a is az1, b az2, c az3), under
    `mocks` (a subclass of `Mocks` answers more calls), as `pulumi up` runs it, or as `pulumi preview`
    does with `preview` (what `pulumi.runtime.is_dry_run()` then says)."""
    run = ProgramRun()
    exported: dict[str, Any] = {}
    region = str(config["aws:region"])  # every stack file names it (the probe writes it)
    # Every program run in this process on one event loop of its own: other code runs asyncio loops
    # of its own (asyncio.run replaces the thread's loop), and Pulumi's runtime keeps futures from
    # earlier runs that must stay on the loop they were made on.
    asyncio.set_event_loop(_PROGRAM_LOOP)
    program_mocks = mocks(run, region, zones)
    program_mocks.monitor = RecordingMonitor(program_mocks, run)
    pulumi.runtime.set_mocks(program_mocks, project="ray-eks", stack=stack, preview=preview,
                             monitor=program_mocks.monitor, logger=WarningsLogger(run))
    # What the engine hands a program: strings, with structured values as JSON.
    pulumi.runtime.set_all_config({
        k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()})
    try:
        with _program_process(project_dir, exported):
            _sync_await(pulumi_mocks.run_pulumi_func(
                lambda: runpy.run_path(str(project_dir / "__main__.py"), run_name="__main__")))
        for key, value in exported.items():
            out = pulumi.Output.from_input(value)
            run.outputs[key] = _sync_await(out.future())
            if _sync_await(out.is_secret()):
                run.secret_outputs.add(key)
    finally:
        pulumi.runtime.set_all_config({})
    return run
