"""`python -m infra render --stack NAME`: print what the stack applies inside the cluster (the
RayCluster and the Helm values), from the stack file alone, without any cloud call.

The first line is the stack's estimated cost per hour, as a YAML comment.

Exit codes: 0 printed; 2 bad input (unknown stack, bad config value).
"""

from __future__ import annotations

import argparse
import sys

from workloads.venv_hint import dependencies_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    render = commands.add_parser("render", help="print the RayCluster and Helm values of a stack")
    render.add_argument("--stack", required=True, help="stack name: reads Pulumi.<stack>.yaml")
    render.add_argument("--project-dir", default=".", help="folder of the stack files")
    args = parser.parse_args(argv)
    with dependencies_of("infra"):
        return _render(args)


def _render(args: argparse.Namespace) -> int:
    from infra.config import ConfigError, load_stack_config
    from infra.cost import cost_summary
    from infra.render import render_yaml

    try:
        cfg = load_stack_config(args.stack, args.project_dir)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    sys.stdout.write(f"# {cost_summary(cfg)}\n{render_yaml(cfg, stack=args.stack)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
