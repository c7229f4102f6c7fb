"""Runs the Pulumi program (__main__.py) under pulumi.runtime.set_mocks and records what it
declares: the resources with their inputs, and the stack outputs."""

from __future__ import annotations

import runpy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime.sync_await import _sync_await


@dataclass
class Declared:
    typ: str
    name: str
    inputs: dict[str, Any]


@dataclass
class ProgramRun:
    resources: list[Declared] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)
    secret_outputs: set[str] = field(default_factory=set)
    invokes: list[str] = field(default_factory=list)

    def of_type(self, typ: str) -> list[Declared]:
        return [r for r in self.resources if r.typ == typ]

    def one(self, typ: str) -> Declared:
        found = self.of_type(typ)
        assert len(found) == 1, f"{len(found)} resources of type {typ}"
        return found[0]


class _Mocks(pulumi.runtime.Mocks):
    def __init__(self, run: ProgramRun, region: str):
        self.run, self.region = run, region

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        self.run.resources.append(Declared(args.typ, args.name, dict(args.inputs)))
        outputs = dict(args.inputs)
        if args.typ == "aws:s3/bucket:Bucket":
            outputs.update(bucket=f"{args.inputs['bucketPrefix']}abc123",
                           arn=f"arn:aws:s3:::{args.inputs['bucketPrefix']}abc123")
        if args.typ == "aws:iam/role:Role":
            outputs["arn"] = f"arn:aws:iam::123456789012:role/{args.name}"
        return f"{args.name}-id", outputs

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.run.invokes.append(args.token)
        if args.token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            prefix = "".join(part[0] for part in self.region.split("-")[:-1])
            prefix += self.region.split("-")[-1]
            return {"names": [f"{self.region}{s}" for s in "abc"],
                    "zoneIds": [f"{prefix}-az{i}" for i in (1, 2, 3)], "id": self.region}
        if args.token == "aws:index/getPartition:getPartition":
            return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"}
        return {}


def run_program(*, repo_root: Path, stack: str, config: dict[str, Any], monkeypatch) -> ProgramRun:
    """Run __main__.py for `stack` with `config` (the stack file's `config:` mapping)."""
    run = ProgramRun()
    exported: dict[str, Any] = {}
    monkeypatch.setattr(pulumi, "export", lambda k, v: exported.__setitem__(k, v))
    monkeypatch.chdir(repo_root)
    region = str(config.get("aws:region", "us-west-2"))
    pulumi.runtime.set_mocks(_Mocks(run, region), project="ray-eks", stack=stack, preview=False)
    # What the engine hands a program: strings, with structured values as JSON.
    import json
    pulumi.runtime.set_all_config({
        k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()})
    try:
        _sync_await(pulumi_mocks.run_pulumi_func(
            lambda: runpy.run_path(str(repo_root / "__main__.py"), run_name="__main__")))
        for key, value in exported.items():
            out = pulumi.Output.from_input(value)
            run.outputs[key] = _sync_await(out.future())
            if _sync_await(out.is_secret()):
                run.secret_outputs.add(key)
    finally:
        pulumi.runtime.set_all_config({})
    return run
