"""What `pulumi up` would create for a stack, as a tree with counts: the program run under the mocks
the tests use (infra/program_mocks.py), so without a cloud, credentials or the Pulumi CLI.

Each component of the program (`ray-eks:infra:*`) is a branch; the resources declared under it are
counted by type. pulumi-eks's remote components (eks:index:Cluster, ManagedNodeGroup) create their
own AWS resources inside their provider at `pulumi up` (the EKS cluster, its roles and security
groups, the node groups' launch templates): the mocks see only the component, so it is marked.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from infra.program_mocks import Declared, ProgramRun, run_program

REMOTE_COMPONENTS = ("eks:index:",)
"""Types whose resources their provider creates, out of the program's sight."""


PROGRAM_DIR = Path(__file__).resolve().parents[1]
"""The Pulumi project this package belongs to: its __main__.py is the program `pulumi up` runs."""


def declared(*, stack: str, config: dict[str, Any]) -> ProgramRun:
    """The program's run for `stack` with its stack file's `config:` mapping, under mocks, as `pulumi
    preview` runs it: the resources `pulumi up` would create, for a stack whose images are not locked by
    digest yet too (`pulumi up` refuses those before declaring anything: infra/images.py)."""
    return run_program(project_dir=PROGRAM_DIR, stack=stack, config=config, preview=True)


def _is_component(resource: Declared) -> bool:
    return resource.typ.startswith("ray-eks:") or resource.typ.startswith(REMOTE_COMPONENTS)


def tree_lines(run: ProgramRun) -> list[str]:
    """The registered resources (reads left out) as indented lines: each component with the count of
    each type declared under it, its sub-components nested; a summary line first."""
    resources = run.registered()
    urns = {r.urn for r in resources}
    children: dict[str, list[Declared]] = collections.defaultdict(list)
    for resource in resources:
        children[resource.parent if resource.parent in urns else ""].append(resource)
    aws = sum(r.typ.startswith("aws:") for r in resources)
    kubernetes = sum(r.typ.startswith("kubernetes:") for r in resources)
    remote = [r for r in resources if r.typ.startswith(REMOTE_COMPONENTS)]
    lines = [f"{len(resources)} resources: {aws} AWS, {kubernetes} Kubernetes objects, {len(remote)} pulumi-eks "
             "components (their own AWS resources are made by pulumi-eks at `pulumi up` and not counted)"]

    def branch(parent: str, depth: int) -> None:
        kids = children.get(parent, [])
        for resource in sorted((k for k in kids if _is_component(k)), key=lambda k: (k.typ, k.name)):
            remote_mark = "  (remote: its resources are pulumi-eks's)" if resource.typ.startswith(
                REMOTE_COMPONENTS) else ""
            lines.append(f"{'  ' * depth}{resource.name} ({resource.typ}){remote_mark}")
            branch(resource.urn, depth + 1)
        counts = collections.Counter(k.typ for k in kids if not _is_component(k))
        width = max((len(t) for t in counts), default=0)
        lines.extend(f"{'  ' * depth}{typ:<{width}}  {count}" for typ, count in sorted(counts.items()))

    branch("", 0)
    return lines
