"""A run starting from another run (`model.name_or_path=RUN`): DPO after SFT.

Fast: what a run folder, a run's checkpoint storage or a checkpoint names. Slow (one gloo rank): an
SFT LoRA run, then DPO from it with its adapter merged and stacked: both start from the SFT model
(the same log-probabilities at the first step, rewards zero: the reference is the SFT model too),
and neither from the base alone.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from workloads.client.cluster import free_port
from workloads.context import TrainContext
from workloads.model_io.run_model import starting_model
from workloads.model_io.toy import toy_conversations, toy_preference_pairs, write_chat_jsonl, write_toy_model
from workloads.train.config import TrainConfig, preset, with_overrides
from workloads.train.starting import with_starting_model


def checkpoint(folder: Path, *, exported: bool, lora: bool = False) -> Path:
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    if exported:
        (folder / "model").mkdir()
        (folder / "model" / "config.json").write_text("{}")
        (folder / "model" / "model.safetensors").write_bytes(b"")
    if lora:
        (folder / "model" / "adapter").mkdir()
        (folder / "model" / "adapter" / "adapter_config.json").write_text(
            json.dumps({"base_model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "revision": "abc123"}))
    return folder


def test_a_run_names_the_model_its_newest_checkpoint_exported(tmp_path):
    storage = tmp_path / "storage"
    checkpoint(storage / "checkpoint-0000010", exported=True)
    checkpoint(storage / "checkpoint-0000020", exported=True, lora=True)
    checkpoint(storage / "checkpoint-0000030", exported=False)  # a checkpoint of a run without its export
    start = starting_model(str(storage))
    assert start.name_or_path == str(storage / "checkpoint-0000020" / "model") and start.run == str(storage)
    # A model folder, a hub id and a named architecture are what they are.
    for spec in (str(storage / "checkpoint-0000010" / "model"), "Qwen/Qwen2.5-1.5B", "tiny-qwen2"):
        assert starting_model(spec).name_or_path == spec and not starting_model(spec).run
    # A local run of `run --local`: its own export first.
    run = tmp_path / "runs" / "sft"
    checkpoint(run / "checkpoints" / "sft" / "checkpoint_000000", exported=True)
    (run / "run.json").write_text("{}")
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}")
    (run / "model" / "model.safetensors").write_bytes(b"")
    assert starting_model(str(run)).name_or_path == str(run / "model")
    # Stacked: the LoRA run's base (and its revision) and its adapter.
    stacked = starting_model(str(storage), stack=True)
    assert (stacked.name_or_path, stacked.revision) == ("Qwen/Qwen2.5-1.5B-Instruct", "abc123")
    assert stacked.stacked_adapter == str(storage / "checkpoint-0000020" / "model" / "adapter")


def test_a_run_without_an_export_or_a_stack_of_a_full_run_is_refused(tmp_path):
    checkpoint(tmp_path / "bare" / "checkpoint-0000010", exported=False)
    with pytest.raises(ValueError, match="hold no exported model: export one"):
        starting_model(str(tmp_path / "bare"))
    checkpoint(tmp_path / "full" / "checkpoint-0000010", exported=True)
    with pytest.raises(ValueError, match="not a LoRA run's model"):
        starting_model(str(tmp_path / "full"), stack=True)
    cfg = TrainConfig.from_dict({"model": {"name_or_path": str(tmp_path / "full"), "adapter": "stack"}})
    with pytest.raises(ValueError, match="set method=lora"):
        with_starting_model(cfg)


def scenarios(root: Path) -> dict:
    base = write_toy_model(root / "base")
    chats = write_chat_jsonl(root / "chats.jsonl", toy_conversations(200))
    pairs = write_chat_jsonl(root / "pairs.jsonl", toy_preference_pairs(64))
    sft = with_overrides(preset("demo-cpu"), [
        f"model.name_or_path={base}", "data.kind=jsonl", f"data.path={chats}", "data.eval_fraction=0", "method=lora",
        "lora.rank=4", "lora.alpha=8", "steps=8", "lr=2e-2", "warmup_steps=1", "checkpoint_every=8", "eval_every=0",
        "log_every=8"])
    dpo = ["data.kind=jsonl", f"data.path={pairs}", "data.eval_fraction=0", "data.shuffle=false", "method=lora",
           "lora.rank=4", "lora.alpha=8", "steps=1", "log_every=1", "checkpoint_every=0", "eval_every=0"]
    storage = root / "sft"
    return {"sft": sft.to_dict(), "dpo": {
        "merge": with_overrides(preset("demo-cpu-dpo"), [f"model.name_or_path={storage}", *dpo]).to_dict(),
        "stack": with_overrides(preset("demo-cpu-dpo"), [f"model.name_or_path={storage}", "model.adapter=stack",
                                                         *dpo]).to_dict(),
        "base": with_overrides(preset("demo-cpu-dpo"), [f"model.name_or_path={base}", *dpo]).to_dict()}}


def worker(rank: int, port: int, root: Path, plan: dict) -> None:
    from workloads.train.loop import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        out = {}
        for name, cfg in [("sft", plan["sft"]), *plan["dpo"].items()]:
            reports: list = []
            ctx = TrainContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                               report=lambda m, checkpoint_dir=None, kept=reports: kept.append(m),
                               latest_checkpoint=lambda: None, scratch_dir=root / name)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                summary = train(TrainConfig.from_dict(cfg), ctx)
            out[name] = {"reports": reports, "summary": summary, "printed": printed.getvalue()}
        (root / "out.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dpo_starts_from_an_sft_lora_run_merged_or_stacked(tmp_path):
    plan = scenarios(tmp_path)
    run_ranks(worker, args=(free_port(), tmp_path, plan), nprocs=1)
    out = json.loads((tmp_path / "out.json").read_text())
    merged, stacked, base = (out[name]["reports"][0] for name in ("merge", "stack", "base"))
    assert "starting from run" in out["merge"]["printed"] and "beneath the new ones" in out["stack"]["printed"]
    assert out["stack"]["summary"]["lora"]["stacked_adapter"].endswith("model/adapter")
    # The same starting model, the SFT one: merged weights or base + adapter, equal to fp32 rounding.
    assert stacked["logps/chosen"] == pytest.approx(merged["logps/chosen"], rel=1e-5)
    assert stacked["logps/rejected"] == pytest.approx(merged["logps/rejected"], rel=1e-5)
    # ... and the reference is that model too: nothing moved before the first step.
    assert merged["rewards/margins"] == stacked["rewards/margins"] == 0.0
    # The SFT adapter made a difference: the base alone gives other log-probabilities.
    assert abs(base["logps/chosen"] - merged["logps/chosen"]) > 0.05
