"""`objective: dpo` held against TRL's DPOTrainer (trl 1.16.0), run for real, on the same tiny model,
records and settings; and a DPO run that learns a rule.

The loop runs in two gloo processes on CPU (FSDP2, the pairs of a step spread over both ranks),
TRL in this process with its own collator (padded batches), sampler made sequential so that each of
its batches holds the pairs one of the loop's steps holds: every pair of the records has the same
total length, so each packed row holds exactly PAIRS_PER_ROW of them in file order. Each scenario
compares, at each of the first STEPS steps, the loss, the chosen and rejected rewards, the margins
and the accuracy:
- fp32: within EXACT (the sigmoid loss with a frozen copy as reference; LoRA with its adapters
  switched off and the SFT term; IPO with the reference precomputed);
- bf16 mixed precision against TRL's fp32: within the SFT path's bound (tests/test_loop_fsdp.py,
  BF16_RTOL): the loss to 1%, and the rewards, differences of summed log-probabilities, to 1% of
  beta times those log-probabilities.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from test_loop_fsdp import BF16_RTOL

from workloads.client.cluster import free_port
from workloads.context import TrainContext
from workloads.model_io.toy import toy_preference_pairs, toy_tokenizer, write_chat_jsonl, write_toy_model
from workloads.train.config import LoraSettings, TrainConfig, preset, with_overrides
from workloads.train.pair_records import preference_record
from workloads.train.pairs import encode_pair

WORLD_SIZE = 2
STEPS = 5
PAIRS_PER_ROW = 2
PAIR_POSITIONS = 40
"""Positions of every pair's two sequences (so that rows hold PAIRS_PER_ROW pairs, in order)."""
EXACT = 1e-5
BETA = 0.1
LR = 1e-3
LORA = LoraSettings(rank=4, alpha=8.0)
RPO_ALPHA = 0.5
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
WORDS = [" is", " the", " capital", " of", " France", " Japan", " Italy", " Spain", " Norway", " opposite"]
"""One token each of the toy tokenizer."""


def equal_length_pairs(count: int, *, seed: int = 0) -> list[dict]:
    """Conversational records (TRL's explicit-prompt shape) of prompts and answers of 1 to 8 words,
    chosen and rejected of different lengths, every pair PAIR_POSITIONS positions in all."""
    tokenizer, rng, records = toy_tokenizer(), random.Random(seed), []

    def text(least: int, most: int) -> str:
        return "".join(rng.choice(WORDS) for _ in range(rng.randint(least, most)))

    while len(records) < count:
        record = {"prompt": [{"role": "user", "content": text(2, 8)}],
                  "chosen": [{"role": "assistant", "content": text(1, 7)}],
                  "rejected": [{"role": "assistant", "content": text(1, 7)}]}
        if record["chosen"] == record["rejected"]:
            continue
        pair = encode_pair(tokenizer, preference_record(record, where="generated"))
        if 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected) - 2 == PAIR_POSITIONS:
            records.append(record)
    return records


def scenarios(root: Path) -> dict:
    model = write_toy_model(root / "model")
    pairs = write_chat_jsonl(root / "pairs.jsonl", equal_length_pairs(WORLD_SIZE * PAIRS_PER_ROW * STEPS))
    toy = write_chat_jsonl(root / "toy-pairs.jsonl", toy_preference_pairs(400))
    exact = [f"model.name_or_path={model}", "data.kind=jsonl", f"data.path={pairs}", "data.eval_fraction=0",
             "data.shuffle=false", f"seq_len={PAIRS_PER_ROW * PAIR_POSITIONS}", "micro_batch=1", f"steps={STEPS}",
             "log_every=1", "warmup_steps=0", "min_lr_ratio=1", "weight_decay=0", "betas=[0.9,0.999]",
             f"lr={LR}", f"dpo.beta={BETA}", "eval_every=0", "checkpoint_every=0", "grad_clip=1.0"]
    lora = ["method=lora", f"lora.rank={LORA.rank}", f"lora.alpha={LORA.alpha}"]
    plan = {
        "full": exact,
        "full-bf16": [*exact, "mixed_precision=true"],
        "lora-rpo": [*exact, *lora, f"dpo.rpo_alpha={RPO_ALPHA}"],
        "ipo-precomputed": [*exact, "dpo.loss_type=ipo", "dpo.reference=precomputed"],
        "learn": [f"model.name_or_path={model}", "data.kind=jsonl", f"data.path={toy}", "data.eval_fraction=0.1",
                  "steps=40", "log_every=10", "eval_every=40", "checkpoint_every=0", "micro_batch=2"],
    }
    demo = preset("demo-cpu-dpo")
    return {"model": str(model), "pairs": str(pairs),
            "cfg": {name: with_overrides(demo, overrides).to_dict() for name, overrides in plan.items()}}


def worker(rank: int, port: int, root: Path, plan: dict) -> None:
    from workloads.train.loop import train

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        for name, cfg in plan["cfg"].items():
            reports: list[dict] = []
            ctx = TrainContext(rank=rank, world_size=WORLD_SIZE, local_rank=rank, local_world_size=WORLD_SIZE,
                               node_rank=0, report=lambda m, checkpoint_dir=None, kept=reports: kept.append(m),
                               latest_checkpoint=lambda: None, scratch_dir=root / name)
            with contextlib.redirect_stdout(io.StringIO()):
                summary = train(TrainConfig.from_dict(cfg), ctx)
            if rank == 0:
                (root / f"{name}.json").write_text(json.dumps({"summary": summary, "reports": reports}))
    finally:
        dist.destroy_process_group()


def run_trl(root: Path, plan: dict, *, method: str = "full", **settings) -> list[dict]:
    """TRL's DPOTrainer on the same model, records and settings: each step's logged metrics."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    records = [json.loads(line) for line in Path(plan["pairs"]).read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(plan["model"], dtype=torch.float32)
    reference, peft_config = None, None
    if method == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, task_type="CAUSAL_LM",
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
    else:
        reference = AutoModelForCausalLM.from_pretrained(plan["model"], dtype=torch.float32)
    args = DPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=WORLD_SIZE * PAIRS_PER_ROW,
                     max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                     logging_steps=1, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to=[],
                     save_strategy="no", max_length=None, beta=BETA, seed=0, disable_tqdm=True,
                     optim="adamw_torch", dataloader_num_workers=0, **settings)
    trainer = InOrder(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(records),
                      processing_class=toy_tokenizer(), peft_config=peft_config)
    if method == "lora":
        same_adapters_as_the_loop(trainer.model, plan)
    logged: list[dict] = []
    log = trainer.log

    def keep(logs: dict, *args, **kwargs):
        out = log(logs, *args, **kwargs)  # DPOTrainer.log adds its metrics to `logs`
        if "loss" in logs:
            logged.append(dict(logs))
        return out

    trainer.log = keep
    trainer.train()
    return logged


def same_adapters_as_the_loop(peft_model, plan: dict) -> None:
    """The loop's initial adapters (peft's initialization, the loop's seed) copied into TRL's."""
    from workloads.train.config import ModelConfig
    from workloads.train.method import LoraFineTune
    from workloads.train.model import causal_lm_on_meta, model_config

    meta = causal_lm_on_meta(model_config(ModelConfig(name_or_path=plan["model"]), pretrained=Path(plan["model"])))
    method = LoraFineTune(settings=LORA)
    method.adapt(meta, mixed_precision=False, seed=0)
    named = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, value in method.initial.items():
            (target,) = [n for n in named if n.endswith(name)]
            named[target].copy_(value)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("dpo")
    plan = scenarios(root)
    run_ranks(worker, args=(free_port(), root, plan), nprocs=WORLD_SIZE)
    records = {name: json.loads((root / f"{name}.json").read_text()) for name in plan["cfg"]}
    return root, plan, records


@pytest.fixture(scope="module")
def trl_full(runs) -> list[dict]:
    root, plan, _ = runs
    return run_trl(root, plan)


def compare(ours: dict, trl: list[dict], *, tolerance: float) -> None:
    steps = [r for r in ours["reports"]]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)) and len(trl) == STEPS
    for mine, theirs in zip(steps, trl):
        for key in ("loss", *METRICS):
            assert mine[key] == pytest.approx(theirs[key], abs=tolerance), (mine["step"], key, mine, theirs)


@pytest.mark.slow
def test_full_dpo_equals_trl_step_by_step(runs, trl_full):
    _, _, records = runs
    compare(records["full"], trl_full, tolerance=EXACT)
    summary = records["full"]["summary"]
    assert summary["objective"] == "dpo" and summary["reference"] == "frozen-copy"
    # The steps trained something: rewards moved apart from their first-step zeros.
    assert trl_full[0]["rewards/margins"] == 0 and any(abs(r["rewards/margins"]) > 1e-3 for r in trl_full[1:])


@pytest.mark.slow
def test_lora_dpo_with_the_sft_term_equals_trl(runs):
    root, plan, records = runs
    trl = run_trl(root, plan, method="lora", loss_type=["sigmoid", "sft"], loss_weights=[1.0, RPO_ALPHA])
    compare(records["lora-rpo"], trl, tolerance=EXACT)
    assert records["lora-rpo"]["summary"]["reference"] == "adapters-off"


@pytest.mark.slow
def test_ipo_with_a_precomputed_reference_equals_trl(runs):
    root, plan, records = runs
    trl = run_trl(root, plan, loss_type=["ipo"], precompute_ref_log_probs=True)
    compare(records["ipo-precomputed"], trl, tolerance=EXACT)
    assert records["ipo-precomputed"]["summary"]["reference"] == "precomputed"


@pytest.mark.slow
def test_bf16_mixed_precision_stays_within_the_sft_bound_of_trl(runs, trl_full):
    _, _, records = runs
    ours = records["full-bf16"]["reports"]
    for mine, theirs in zip(ours, trl_full, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=BF16_RTOL)
        scale = BETA * BF16_RTOL * max(abs(theirs["logps/chosen"]), abs(theirs["logps/rejected"]))
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert mine[key] == pytest.approx(theirs[key], abs=scale), (mine["step"], key)
    # bf16 really computed: the log-probabilities are not fp32's.
    assert any(abs(m["logps/chosen"] - t["logps/chosen"]) > 1e-4 for m, t in zip(ours, trl_full))


@pytest.mark.slow
def test_dpo_learns_a_rule_the_chosen_answers_follow(runs):
    _, _, records = runs
    learned = records["learn"]["reports"][-1]
    # The held-out pairs: the right capital (or opposite) against another one of the same kind. A
    # model that learned nothing scores 0.5 or less (ties count as wrong).
    assert learned["eval_rewards/accuracies"] >= 0.8, learned
    assert learned["eval_rewards/margins"] > 0.3 and learned["eval_loss"] < 0.6, learned
