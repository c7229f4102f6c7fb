"""LoRA and activation checkpointing through the training loop, in gloo processes on CPU.

One spawn of two ranks runs the loop's scenarios (LoRA learning; a LoRA run saved, exported and
resumed; a full run's checkpoint for its size) and then checks the mechanics with the loop's own
functions: under mixed precision the frozen base is bf16, the adapters fp32 and nothing else is in
the optimizer, and steps leave the base bitwise unchanged; activation checkpointing gives the same
loss and gradients. A one-rank spawn resumes the two-rank LoRA run (an elastic resize). The tests
then load the export with transformers and peft.
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
from workloads.train.config import ModelConfig, TrainConfig, preset, with_overrides

WORLD_SIZE = 2
LORA_SMALL = ["method=lora", "lora.rank=2", "lora.alpha=4", "steps=6", "log_every=1", "warmup_steps=1",
              "checkpoint_every=3", "micro_batch=2"]
"""Rank 2: the adapters are 4% of tiny-qwen2's parameters, as rank 16 is 0.5% of Qwen2.5-7B's."""
RESUME_RTOL = 1e-5
# Activation checkpointing runs the same fp32 operations again in backward: measured here equal to
# the last bit (loss and every gradient); 1e-6 leaves room for kernels that reorder sums.
CHECKPOINTING_RTOL = 1e-6


def scenarios(root: Path) -> dict[str, dict]:
    demo = with_overrides(preset("demo-cpu"), ["eval_every=0"])
    plan = {
        "learn": (["method=lora", "lora.rank=16", "lr=1e-2", "steps=20", "log_every=1", "warmup_steps=1",
                   "checkpoint_every=0"], None),
        "lora-a": (LORA_SMALL, None),
        "lora-b": (LORA_SMALL, "lora-a/checkpoint-0000003"),
        "full-a": (["steps=3", "log_every=1", "warmup_steps=1", "checkpoint_every=3", "micro_batch=2",
                    "export_model=false"], None),
    }
    return {name: {"cfg": with_overrides(demo, overrides).to_dict(),
                   "resume_from": None if resume is None else str(root / resume)}
            for name, (overrides, resume) in plan.items()}


def context(rank: int, world: int, *, root: Path, name: str, resume_from, reports: list,
            planned: int = 0) -> TrainContext:
    def report(metrics: dict, checkpoint_dir: Path | None = None) -> None:
        reports.append({"metrics": metrics, "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir)})

    return TrainContext(rank=rank, world_size=world, local_rank=rank, local_world_size=world, node_rank=0,
                        report=report, latest_checkpoint=lambda: None if resume_from is None else Path(resume_from),
                        scratch_dir=root / name, planned_world_size=planned)


def sharded(cfg: TrainConfig, rank: int, world: int):
    """The model, optimizer and first micro-batches as the loop builds them."""
    from workloads.train.data import batches, build_data
    from workloads.train.loop import build_model, mesh_plan, reductions, shard_model
    from workloads.train.optim import build_optimizer

    ctx = context(rank, world, root=Path("."), name="unused", resume_from=None, reports=[])
    cpu = torch.device("cpu")
    model, _ = build_model(cfg, device=cpu)
    plan = mesh_plan(cfg, ctx=ctx, device=cpu, model=model)
    model = shard_model(model, cfg, plan=plan, device=cpu)
    _, sync = reductions(cfg, plan)
    source = build_data(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=512, model_name_or_path="").train
    data = batches(source, position=0, micro_batch=cfg.micro_batch, rank=rank, world_size=world)
    return model, build_optimizer(model, cfg, device=cpu), sync, data


def frozen_base_check(rank: int) -> dict:
    """LoRA under mixed precision: dtypes, what the optimizer holds, and the base after steps."""
    from workloads.train.step import train_step

    cfg = with_overrides(preset("demo-cpu"), ["method=lora", "mixed_precision=true", "lora.rank=4"])
    model, optimizer, sync, data = sharded(cfg, rank, WORLD_SIZE)
    params = dict(model.named_parameters())
    frozen = {n: p.to_local().clone() for n, p in params.items() if not p.requires_grad}
    adapters = {n: p.to_local().clone() for n, p in params.items() if p.requires_grad}
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for _ in range(3):
        train_step(model, optimizer, [next(data)], lr=1e-2, grad_clip=1.0, sync=sync)
    return {
        "frozen_dtypes": sorted({str(t.dtype) for t in frozen.values()}),
        "adapter_dtypes": sorted({str(t.dtype) for t in adapters.values()}),
        "adapter_names_are_lora": all(".lora_" in n for n in adapters),
        "optimizer_holds_only_adapters": in_optimizer == {id(params[n]) for n in adapters},
        "frozen_bitwise_unchanged": all(torch.equal(frozen[n], params[n].to_local()) for n in frozen),
        "adapters_moved": sum(not torch.equal(adapters[n], params[n].to_local()) for n in adapters),
        "adapters": len(adapters),
        "optimizer_state_tensors": sum(len(s) for s in optimizer.state.values()),
    }


def checkpointing_check(rank: int) -> dict:
    """One step's loss and gradient shards with and without activation checkpointing (fp32)."""
    from workloads.model_io.load import file_name
    from workloads.train.step import accumulate_gradients

    out = {}
    for checkpointing in (False, True):
        cfg = with_overrides(preset("demo-cpu"), [f"model.activation_checkpointing={str(checkpointing).lower()}",
                                                  "micro_batch=2", "grad_accum_steps=2"])
        model, _, sync, data = sharded(cfg, rank, WORLD_SIZE)
        loss = accumulate_gradients(model, [next(data), next(data)], sync=sync)
        # Compared by name without the checkpoint wrapper's prefix.
        out[checkpointing] = (loss.item(), {file_name(n): p.grad.to_local().clone()
                                            for n, p in model.named_parameters()})
    (loss_off, grads_off), (loss_on, grads_on) = out[False], out[True]
    worst = max(float((grads_on[n] - grads_off[n]).abs().max() / grads_off[n].abs().max().clamp(min=1e-30))
                for n in grads_off)
    return {"loss_off": loss_off, "loss_on": loss_on, "worst_grad_rel": worst, "grads": len(grads_off),
            "names_match": sorted(grads_on) == sorted(grads_off)}


def worker(rank: int, port: int, root: Path, plan: dict[str, dict]) -> None:
    from workloads.train.loop import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        for name, scenario in plan.items():
            reports: list[dict] = []
            ctx = context(rank, WORLD_SIZE, root=root, name=name, resume_from=scenario["resume_from"],
                          reports=reports)
            with contextlib.redirect_stdout(io.StringIO()):
                summary = train(TrainConfig.from_dict(scenario["cfg"]), ctx)
            (root / f"{name}-rank{rank}.json").write_text(json.dumps({"summary": summary, "reports": reports}))
        checks = {"frozen": frozen_base_check(rank), "checkpointing": checkpointing_check(rank)}
        (root / f"checks-rank{rank}.json").write_text(json.dumps(checks))
    finally:
        dist.destroy_process_group()


def elastic_worker(rank: int, port: int, root: Path, cfg: dict) -> None:
    from workloads.train.loop import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        reports: list[dict] = []
        ctx = context(rank, 1, root=root, name="lora-elastic", resume_from=root / "lora-a" / "checkpoint-0000003",
                      reports=reports, planned=WORLD_SIZE)
        with contextlib.redirect_stdout(io.StringIO()):
            summary = train(TrainConfig.from_dict(cfg), ctx)
        (root / "lora-elastic-rank0.json").write_text(json.dumps({"summary": summary, "reports": reports}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("lora")
    plan = scenarios(root)
    run_ranks(worker, args=(free_port(), root, plan), nprocs=WORLD_SIZE)
    run_ranks(elastic_worker, args=(free_port(), root, plan["lora-a"]["cfg"]), nprocs=1)
    names = [*plan, "checks", "lora-elastic"]
    records = {n: [json.loads(p.read_text()) for p in sorted(root.glob(f"{n}-rank*.json"))] for n in names}
    return root, records


def losses(record: dict) -> dict[int, float]:
    return {r["metrics"]["step"]: r["metrics"]["loss"] for r in record["reports"]}


@pytest.mark.slow
def test_lora_trains_only_adapters_and_its_loss_falls(runs):
    _, records = runs
    summary = records["learn"][0]["summary"]
    assert summary["method"] == "lora" and summary["lora"]["rank"] == 16
    # tiny-qwen2's seven projections of two layers at rank 16: 1,024 parameters per rank unit.
    assert summary["trained_params"] == 2 * 16 * 1024
    # All parameters as peft counts them: the base's (all trained by the full run) and the adapters.
    full = records["full-a"][0]["summary"]
    assert full["trained_params"] == full["params"] and summary["params"] == full["params"] + 2 * 16 * 1024
    curve = losses(records["learn"][0])
    first, last_five = curve[1], [curve[s] for s in range(16, 21)]
    # From random weights only the adapters move: 6.24 to about 6.05 here; a loop that trained
    # nothing (or the base) would stay at log(512) = 6.24, within noise of 0.02.
    assert max(last_five) < first - 0.08, curve


@pytest.mark.slow
def test_under_mixed_precision_the_base_is_bf16_frozen_and_out_of_the_optimizer(runs):
    _, records = runs
    for rank in records["checks"]:
        check = rank["frozen"]
        assert check["frozen_dtypes"] == ["torch.bfloat16"] and check["adapter_dtypes"] == ["torch.float32"]
        assert check["adapter_names_are_lora"] and check["optimizer_holds_only_adapters"]
        assert check["frozen_bitwise_unchanged"]
        # Every adapter moved (B from zero, A by its gradient), and AdamW keeps state for them only.
        assert check["adapters_moved"] == check["adapters"] == 2 * 7 * 2
        assert check["optimizer_state_tensors"] == 3 * check["adapters"]  # step, exp_avg, exp_avg_sq


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_loss_and_gradients(runs):
    _, records = runs
    for rank in records["checks"]:
        check = rank["checkpointing"]
        assert check["names_match"] and check["grads"] > 0
        assert check["loss_on"] == pytest.approx(check["loss_off"], rel=CHECKPOINTING_RTOL, abs=0)
        assert check["worst_grad_rel"] <= CHECKPOINTING_RTOL


@pytest.mark.slow
def test_a_resumed_lora_run_continues_exactly_and_on_one_rank_too(runs):
    _, records = runs
    whole, resumed, elastic = (losses(records[n][0]) for n in ("lora-a", "lora-b", "lora-elastic"))
    assert sorted(resumed) == sorted(elastic) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx([whole[s] for s in (4, 5, 6)], rel=RESUME_RTOL)
    assert [elastic[s] for s in (4, 5, 6)] == pytest.approx([whole[s] for s in (4, 5, 6)], rel=RESUME_RTOL)
    summary = records["lora-elastic"][0]["summary"]
    assert (summary["world_size"], summary["planned_world_size"], summary["grad_accum_steps"]) == (1, 2, 2)


def _tensor_bytes(folder: Path) -> int:
    """The bytes of the tensors a DCP checkpoint holds, by its metadata (the files add a constant
    framing per tensor, which at tiny-qwen2's size outweighs the adapters themselves)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = FileSystemReader(str(folder)).read_metadata().state_dict_metadata.values()
    return sum(m.size.numel() * m.properties.dtype.itemsize for m in stored if isinstance(m, TensorStorageMetadata))


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapters_and_progress_only(runs):
    root, _ = runs
    lora, full = root / "lora-a" / "checkpoint-0000003", root / "full-a" / "checkpoint-0000003"
    assert json.loads((lora / "progress.json").read_text())["method"] == "lora"
    assert _tensor_bytes(lora) < 0.10 * _tensor_bytes(full)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(lora)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)


@pytest.mark.slow
def test_a_full_run_refuses_a_lora_checkpoint_with_the_way_out(runs, tmp_path):
    root, _ = runs
    from workloads.train import checkpoint

    with pytest.raises(ValueError, match="saved by a 'lora' fine-tune and this run is 'full'.*method=lora"):
        checkpoint.load(root / "lora-a" / "checkpoint-0000003", model=torch.nn.Linear(1, 1),
                        optimizer=None, method="full")


@pytest.mark.slow
def test_the_export_is_the_merged_model_and_the_adapter_in_peft_format(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from workloads.train.model import build_causal_lm

    root, _ = runs
    folder = root / "lora-a" / "checkpoint-0000006" / "model"
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # The run's base: tiny-qwen2's random weights from the run's seed, built the same way.
    base = build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=torch.device("cpu"), seed=0).eval()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    moved = [k for k, v in merged.state_dict().items() if k in base_state and not torch.equal(v, base_state[k])]
    assert any("q_proj.weight" in k for k in moved) and not any("norm" in k or "embed" in k for k in moved)
    adapted = PeftModel.from_pretrained(base, folder / "adapter").eval()
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (2, 4, "tiny-qwen2")
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_any_lora_checkpoint_exports_its_adapter_and_merges_into_its_base(runs, tmp_path):
    from safetensors.torch import load_file

    from workloads.model_io.export import consolidate
    from workloads.model_io.lora_base import LoraBase
    from workloads.train.model import build_causal_lm

    root, _ = runs
    final = root / "lora-a" / "checkpoint-0000006"
    # The run's base (as submitted) is random weights: no stored base to merge into, said so, the
    # adapter written.
    submitted = LoraBase(name_or_path="tiny-qwen2", told_by="the run's submission")
    with pytest.raises(ValueError, match="the adapter is written to .*has none stored.*--base"):
        consolidate(root / "lora-a" / "checkpoint-0000003", tmp_path / "early", submitted=submitted)
    assert (tmp_path / "early" / "adapter" / "adapter_model.safetensors").is_file()
    # Given the base's weights, the shards of the final checkpoint merge into the run's own export.
    base = tmp_path / "base"
    build_causal_lm(ModelConfig(name_or_path="tiny-qwen2"), device=torch.device("cpu"), seed=0).save_pretrained(base)
    consolidate(final, tmp_path / "merged", base=LoraBase(name_or_path=str(base), told_by="--base"),
                submitted=submitted)
    own, again = (load_file(p / "model.safetensors") for p in (final / "model", tmp_path / "merged"))
    assert own.keys() == again.keys()
    for name in own:
        torch.testing.assert_close(again[name], own[name], rtol=1e-6, atol=1e-7)
    adapters = [load_file(p / "adapter" / "adapter_model.safetensors") for p in (final / "model", tmp_path / "merged")]
    assert adapters[0].keys() == adapters[1].keys() and all(torch.equal(adapters[0][k], adapters[1][k])
                                                            for k in adapters[0])
