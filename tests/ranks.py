"""Start a multi-process test's ranks from a forkserver that has imported torch, transformers and the
training loop once, instead of one fresh interpreter per rank importing them all again (about 5 s of
CPU per rank on two cores; the suite starts a few dozen ranks).

A forkserver child inherits the forkserver's environment, not the test's: each rank is given the
test's environment as it is at the call (monkeypatched variables included) before its function runs.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "transformers",
           "transformers.models.qwen2.modeling_qwen2", "workloads.train.loop"]
"""Imported once by the forkserver; forked ranks find them in sys.modules."""


def _rank(rank: int, fn: Callable, environ: dict[str, str], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def run_ranks(fn: Callable, *, args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` processes; raises as torch.multiprocessing.spawn does when one fails."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(_rank, args=(fn, dict(os.environ), args), nprocs=nprocs, join=True, start_method="forkserver")
