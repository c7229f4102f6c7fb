"""`python -m workloads.bench [options]` (training comparison) or `python -m workloads.bench nccl
[options]` (collective bandwidth). Run under torchrun; without it, one rank runs alone."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if argv and argv[0] == "nccl":
        from workloads.bench import nccl as command

        argv = argv[1:]
    else:
        from workloads.bench import train_bench as command
    try:
        options = command.parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return command.run(options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
