"""`python -m infra render --stack NAME`: the look before `pulumi up`, from the stack file alone,
without any cloud call or credentials: what the stack costs, what it creates in AWS and what it
applies inside the cluster.

As YAML comments first: the stack's estimated cost per hour at its region's prices
(infra/prices.py; on Spot, the price the probe wrote), then the resources the Pulumi program
declares, as a tree of its components with counts by type (the program run under the tests' mocks:
infra/resource_tree.py). Then the RayCluster and each Helm chart's values, as YAML documents.
Exit codes: 0 printed; 2 bad input (unknown stack, bad config value).

`python -m infra lock-images --stack NAME [--dry-run]`: each image of the stack pinned by the digest
its tag names now, read from its registry (infra/registry.py), and written into the stack file as
`repo:tag@sha256:...`, every other key and comment kept (infra/lock_images.py); `pulumi up` deploys no
image without one (infra/images.py). Exit codes, as `python -m capacity probe`'s: 0 written (or already
pinned, or shown with --dry-run); 1 the registry has no such tag or repository; 2 bad input (unknown
stack, bad config value, a file that cannot be edited without touching other lines); 3 the registry
refused an anonymous client; 4 the registry could not be reached. Each error is one line on stderr.
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
    lock = commands.add_parser("lock-images", help="pin each image of a stack by the digest its tag names now")
    lock.add_argument("--stack", required=True, help="stack name: reads and rewrites Pulumi.<stack>.yaml")
    lock.add_argument("--project-dir", default=".", help="folder of the stack files")
    lock.add_argument("--dry-run", action="store_true", help="print the change to the stack file, write nothing")
    args = parser.parse_args(argv)
    with dependencies_of("infra"):
        return _render(args) if args.command == "render" else _lock_images(args)


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



EXIT_NOT_FOUND, EXIT_BAD_INPUT, EXIT_DENIED, EXIT_UNREACHABLE = 1, 2, 3, 4


def _lock_images(args: argparse.Namespace) -> int:
    from infra.config import ConfigError
    from infra.config.stack_edit import StackFileError, write
    from infra.lock_images import ImageLockError, plan_lock
    from infra.registry import RegistryClient, RegistryDenied, TagNotFound

    try:
        locked, update = plan_lock(stack=args.stack, project_dir=args.project_dir, resolve=RegistryClient().digest)
    except (ConfigError, StackFileError) as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except ImageLockError as exc:
        kind = type(exc.error)
        return _fail(str(exc), EXIT_NOT_FOUND if issubclass(kind, TagNotFound) else
                     EXIT_DENIED if issubclass(kind, RegistryDenied) else EXIT_UNREACHABLE)
    for image in locked:
        print(f"{image.key}: {image.before} -> {image.after}" if image.changed else
              f"{image.key}: {image.before} (the digest its tag names)")
    if not update.changed:
        print(f"{update.path}: every image already pinned by the digest its tag names")
    elif args.dry_run:
        sys.stdout.write(update.diff())
    else:
        write(update)
        print(f"{update.path}: written")
    return 0


def _fail(message: str, code: int) -> int:
    for line in message.splitlines():
        print(f"infra lock-images: error: {line}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
