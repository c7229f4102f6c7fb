"""All-reduce bus bandwidth: the nccl-tests formula, and a real two-process gloo measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from workloads.transport.bandwidth import bus_bandwidth_gbps, measure_allreduce


@pytest.mark.parametrize(
    ("world_size", "busbw"),
    [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75), (16, 1.875)],
)
def test_busbw_is_algbw_times_2_n_minus_1_over_n(world_size, busbw):
    algbw, bus = bus_bandwidth_gbps(size_bytes=10**9, seconds=1.0, world_size=world_size)
    assert algbw == 1.0
    assert bus == pytest.approx(busbw)


def test_real_h200_figure_reproduces():
    # shared/fixtures/nccl/h200x2-single-node-p2p.log: 1024 MiB in 3.2528 ms on 2 ranks.
    algbw, bus = bus_bandwidth_gbps(size_bytes=1024 * 2**20, seconds=3.25283419999991e-3, world_size=2)
    assert algbw == pytest.approx(330.094, rel=1e-5) and bus == algbw


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_non_positive_time_is_rejected(seconds):
    with pytest.raises(ValueError, match="all-reduce time must be positive"):
        bus_bandwidth_gbps(size_bytes=1, seconds=seconds, world_size=2)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        sample = measure_allreduce(device=torch.device("cpu"), message_bytes=1 << 20, warmup=1, iters=3)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(sample.__dict__))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gloo_measurement_is_the_same_on_every_rank(tmp_path):
    run_ranks(_worker, args=(str(tmp_path / "pg"), str(tmp_path)), nprocs=2)
    samples = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert samples[0] == samples[1]
    sample = samples[0]
    assert sample["size_bytes"] == 1 << 20 and sample["world_size"] == 2
    assert sample["seconds"] > 0
    assert sample["busbw_gbps"] == pytest.approx(sample["algbw_gbps"])  # 2(n-1)/n == 1 for n == 2
    assert sample["algbw_gbps"] == pytest.approx((1 << 20) / sample["seconds"] / 1e9)
