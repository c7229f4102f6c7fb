"""`python -m infra render --stack NAME`: the look before `pulumi up`, from the stack file alone,
without any cloud call or credentials: what the stack costs, what it creates in AWS and what it
applies inside the cluster.

As YAML comments first: the stack's estimated cost per hour at its region's prices
(infra/prices.py; on Spot, the price the probe wrote), then the resources the Pulumi program
declares, as a tree of its components with counts by type (the program run under the tests' mocks:
infra/resource_tree.py). Then the RayCluster and each Helm chart's values, as YAML documents.

Exit codes: 0 printed; 2 bad input (unknown stack, bad config value).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workloads.venv_hint import dependencies_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    render = commands.add_parser("render", help="print a stack's cost, AWS resources, RayCluster and Helm values")
    render.add_argument("--stack", required=True, help="stack name: reads Pulumi.<stack>.yaml")
    render.add_argument("--project-dir", default=".", help="folder of the stack files")
    args = parser.parse_args(argv)
    with dependencies_of("infra"):
        return _render(args)


def _render(args: argparse.Namespace) -> int:
    from infra.config import ConfigError, load_stack_config
    from infra.cost import cost_summary
    from infra.config import read_stack_values, stack_file
    from infra.render import render_yaml
    from infra.resource_tree import declared, tree_lines

    try:
        cfg = load_stack_config(args.stack, args.project_dir)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    project = Path(args.project_dir).resolve()
    run = declared(stack=args.stack, config=read_stack_values(stack_file(args.stack, project)))
    tree = [f"# AWS and Kubernetes resources `pulumi up --stack {args.stack}` creates (the program run under mocks):",
            *(f"#   {line}" for line in tree_lines(run))]
    sys.stdout.write(f"# {cost_summary(cfg)}\n" + "\n".join(tree) + f"\n{render_yaml(cfg, stack=args.stack)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
