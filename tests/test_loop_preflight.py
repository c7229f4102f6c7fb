"""The loop's order: the transport gate runs first, before the model is built or a checkpoint is
restored, so a wrong transport stops the job in seconds and restores nothing."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from workloads.context import TrainContext
from workloads.train import loop
from workloads.train.config import preset
from workloads.transport.gate import TransportGateError


@pytest.fixture()
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_failing_gate_stops_the_loop_before_the_model_and_the_restore(one_rank_group, tmp_path, monkeypatch):
    calls: list[str] = []

    def failing_gate(cfg, *, ctx, device):
        calls.append("gate")
        raise TransportGateError("transport gate failed (expect efa; ...): NET/Socket between nodes")

    def restore():
        calls.append("restore")
        return None

    def build_model(*args, **kwargs):
        calls.append("build")
        raise AssertionError("the model was built before the gate")

    monkeypatch.setattr(loop, "run_transport_gate", failing_gate)
    monkeypatch.setattr(loop, "build_model", build_model)
    ctx = TrainContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                       report=lambda metrics, checkpoint_dir=None: calls.append("report"),
                       latest_checkpoint=restore, scratch_dir=tmp_path)
    with pytest.raises(TransportGateError, match="NET/Socket between nodes"):
        loop.train(preset("demo-cpu"), ctx)
    assert calls == ["gate"]
