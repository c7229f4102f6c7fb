"""`python -m workloads.bench [options]` (training comparison) or `python -m workloads.bench nccl
[options]` (collective bandwidth). Run under torchrun on GPUs; without CUDA both refuse unless
--allow-cpu (which checks the harness on gloo with the tiny model), and `nccl` refuses fewer than
two ranks."""

from __future__ import annotations

import os
import sys

CPU_MODEL = "tiny-qwen2"
"""The only model a CPU run of the training benchmark may build (`--preset demo-cpu`)."""


def refusal(*, nccl: bool, allow_cpu: bool, cuda: bool, world_size: int, model: str = "") -> str | None:
    """Why this machine cannot run the benchmark as asked, or None."""
    if not cuda and not allow_cpu:
        return ("no CUDA GPU is visible: the benchmarks measure GPUs (the default preset needs tens of "
                "GiB per rank). Run them under torchrun on a GPU host, or add --allow-cpu (with "
                "--preset demo-cpu) to check the harness on the CPU")
    if nccl and world_size < 2:
        return (f"bench nccl needs at least 2 ranks, got {world_size}: one rank moves no data, so its "
                "bandwidth means nothing. Run it under torchrun --nproc-per-node 2 (or more)")
    if not nccl and not cuda and model != CPU_MODEL:
        return (f"--allow-cpu runs only the {CPU_MODEL} model (--preset demo-cpu, or --set "
                f"model.name_or_path={CPU_MODEL}); this run builds {model}, far more than a CPU run should take")
    return None


def main(argv: list[str]) -> int:
    nccl = bool(argv) and argv[0] == "nccl"
    if nccl:
        from workloads.bench import nccl as command

        argv = argv[1:]
    else:
        from workloads.bench import settings as command
    try:
        options = command.parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    from workloads.bench.settings import PLACEHOLDER_CHATS, chat_data, preset_config

    # The model after --set, on the stand-in chats the settings were validated with: a named
    # architecture has no tokenizer of its own, and the benchmark gives the chats one.
    model = "" if nccl else preset_config(options, data=chat_data(*PLACEHOLDER_CHATS)).model.name_or_path
    problem = refusal(nccl=nccl, allow_cpu=options.allow_cpu, cuda=torch.cuda.is_available(),
                      world_size=int(os.environ.get("WORLD_SIZE", "1")), model=model)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not nccl:  # the benchmark itself imports torch, transformers and the loop
        from workloads.bench import train_bench as command
    return command.run(options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
