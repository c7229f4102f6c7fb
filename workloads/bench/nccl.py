"""`python -m workloads.bench nccl`: all-reduce, all-gather and reduce-scatter bus bandwidth by
message size, with nccl-tests' conventions, so figures compare with published nccl-tests numbers.

Conventions (nccl-tests, doc/PERFORMANCE.md): the size of a message is the bytes of the larger
buffer (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input);
algbw = size / time; busbw = algbw * 2(n-1)/n for all-reduce and algbw * (n-1)/n for all-gather and
reduce-scatter, which makes busbw comparable to the link's hardware bandwidth whatever n is.
The time of one operation is the mean over `iters` back-to-back launches, and the slowest rank's.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from workloads.transport.bandwidth import measure_allreduce
from workloads.bench.report import write_json
from workloads.bench.runtime import Runtime, init_runtime, max_over_ranks, nccl_version

OPS = ("all_reduce", "all_gather", "reduce_scatter")
_FLOAT32_BYTES = 4
_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def gather_scatter_bandwidth_gbps(*, size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one all-gather or reduce-scatter whose larger buffer is
    `size_bytes`: each rank sends or receives (n-1)/n of it. All-reduce is
    `workloads.transport.bandwidth.bus_bandwidth_gbps`."""
    if seconds <= 0:
        raise ValueError(f"collective time must be positive, got {seconds}")
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * (world_size - 1) / world_size


def parse_size(text: str) -> int:
    """Bytes from '1048576', '1M', '1MiB', '512K', '1G' (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r}; use bytes or a K/M/G (KiB/MiB/GiB) suffix")
    return int(match.group(1)) * _UNITS[unit]


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """min_bytes, 2*min_bytes, ... up to max_bytes, like nccl-tests' -f 2."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min bytes <= max bytes, got {min_bytes} and {max_bytes}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


@dataclass(frozen=True, kw_only=True)
class BandwidthRow:
    op: str
    size_bytes: int
    """nccl-tests' size: bytes of the larger buffer, rounded down to whole float32 elements per rank."""
    time_us: float
    """Mean time of one operation on the slowest rank."""
    algbw_gbps: float
    busbw_gbps: float
    """Bus bandwidth in GB/s (10^9 bytes), as nccl-tests prints it."""


def _time_launches(launch: Callable[[], None], *, device: torch.device, iters: int, warmup: int) -> float:
    """Mean seconds of one launch over `iters` back-to-back launches, the slowest rank's."""
    for _ in range(warmup):
        launch()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            launch()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000.0 / iters
    else:
        began = time.perf_counter()
        for _ in range(iters):
            launch()
        seconds = (time.perf_counter() - began) / iters
    return max_over_ranks(seconds, device=device)


def measure_gather_scatter(
    op: str, *, size_bytes: int, world_size: int, device: torch.device, iters: int, warmup: int
) -> BandwidthRow:
    """One all-gather or reduce-scatter row: the gathered (scattered) buffer is `size_bytes`."""
    per_rank = max(1, size_bytes // _FLOAT32_BYTES // world_size)
    big = torch.zeros(per_rank * world_size, device=device)
    small = torch.zeros(per_rank, device=device)
    # The *_single names are torch 2.13's; 2.11 (still supported) has only the older ones.
    if op == "all_gather":
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def launch() -> None:
            all_gather(big, small)
    elif op == "reduce_scatter":
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def launch() -> None:
            reduce_scatter(small, big)
    else:
        raise ValueError(f"not an all-gather or reduce-scatter: {op!r}")
    seconds = _time_launches(launch, device=device, iters=iters, warmup=warmup)
    actual = big.numel() * _FLOAT32_BYTES
    algbw, busbw = gather_scatter_bandwidth_gbps(size_bytes=actual, seconds=seconds, world_size=world_size)
    return BandwidthRow(op=op, size_bytes=actual, time_us=seconds * 1e6, algbw_gbps=algbw, busbw_gbps=busbw)


def measure_row(op: str, *, size_bytes: int, runtime: Runtime, iters: int, warmup: int) -> BandwidthRow:
    if op == "all_reduce":
        result = measure_allreduce(device=runtime.device, message_bytes=size_bytes, warmup=warmup, iters=iters)
        return BandwidthRow(
            op=op, size_bytes=result.size_bytes, time_us=result.seconds * 1e6,
            algbw_gbps=result.algbw_gbps, busbw_gbps=result.busbw_gbps,
        )
    return measure_gather_scatter(
        op, size_bytes=size_bytes, world_size=runtime.world_size, device=runtime.device, iters=iters, warmup=warmup
    )


def format_rows(rows: Sequence[BandwidthRow]) -> str:
    lines = [f"{'op':<15}{'size':>14}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for row in rows:
        lines.append(
            f"{row.op:<15}{row.size_bytes:>14,}{row.time_us:>12.1f}{row.algbw_gbps:>12.2f}{row.busbw_gbps:>12.2f}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m workloads.bench nccl",
        description="Collective bus bandwidth by message size (run under torchrun).",
    )
    parser.add_argument("--min-bytes", default="1MiB", help="smallest message (default 1MiB)")
    parser.add_argument("--max-bytes", default="1GiB", help="largest message (default 1GiB)")
    parser.add_argument("--iters", type=int, default=20, help="timed launches per size (default 20)")
    parser.add_argument("--warmup-iters", type=int, default=5, help="untimed launches first (default 5)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)}")
    parser.add_argument("--out", type=Path, default=None, help="folder for nccl.json (rank 0 writes)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run without CUDA (gloo on the CPU), to check the harness; still 2+ ranks")
    args = parser.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in args.ops if op not in OPS]
    if unknown or not args.ops:
        raise ValueError(f"--ops {','.join(unknown) or '(empty)'}: choose from {', '.join(OPS)}")
    args.sizes = message_sizes(parse_size(args.min_bytes), parse_size(args.max_bytes))
    if args.iters < 1 or args.warmup_iters < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup-iters >= 0, got {args.iters} and {args.warmup_iters}")
    return args


def run(args: argparse.Namespace) -> int:
    runtime = init_runtime()
    leader = runtime.rank == 0
    document = {
        "world_size": runtime.world_size,
        "device": torch.cuda.get_device_name(runtime.device) if runtime.is_cuda else "cpu",
        "backend": dist.get_backend(),
        "nccl_version": nccl_version(),
        "torch": torch.__version__,
        "dtype": "float32",
        "iters": args.iters,
        "warmup_iters": args.warmup_iters,
        "rows": [],
    }
    if leader:
        print(f"[nccl] {runtime.world_size} ranks, {document['device']}, backend {document['backend']}", flush=True)

    def on_row(row: BandwidthRow) -> None:
        if leader:
            print(f"[nccl] {row.op} {row.size_bytes:,} B: busbw {row.busbw_gbps:.2f} GB/s", flush=True)
            document["rows"].append(asdict(row))
            if args.out:
                write_json(args.out / "nccl.json", document)

    rows = []
    for op in args.ops:
        for size in args.sizes:
            rows.append(measure_row(op, size_bytes=size, runtime=runtime, iters=args.iters, warmup=args.warmup_iters))
            on_row(rows[-1])
    if leader:
        table = format_rows(rows)
        print(table, flush=True)
        if args.out:
            (args.out / "nccl.txt").write_text(table + "\n")
    dist.destroy_process_group()
    return 0

