"""The training loop in two gloo processes on CPU, as the Ray and torchrun adapters run it.

One spawn of two ranks runs every scenario (process start-up and imports dominate the cost);
each test then checks the records the ranks left behind.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_data_jsonl import write_corpus
from transformers import AutoModelForCausalLM
from ranks import run_ranks
from uneven_chats import with_bf16_compute

from workloads.client.cluster import free_port
from workloads.context import DATA_PREFIX, LOAD_PREFIX
from workloads.model_io.export import consolidate
from workloads.model_io.toy import toy_conversations, write_chat_jsonl, write_toy_model

from workloads.train.config import TrainConfig, preset, with_overrides
from workloads.context import TrainContext
from workloads.train.data import Batch, batches, build_data
from workloads.context import SUMMARY_PREFIX, TRAIN_PREFIX
from workloads.train.loop import build_model, mesh_plan, reductions, shard_model, train
from workloads.train.loss import IGNORE_INDEX, LinearCrossEntropy
from workloads.train.step import accumulate_gradients
from workloads.train.model import CausalLMWithLoss, build_causal_lm
from workloads.train.optim import schedule, set_lr

WORLD_SIZE = 2
# FSDP2 steps against the single-process reference: the two differ only in the order of fp32 sums
# (gradient reduce-scatter over ranks, chunked loss), a few ulps per operation. Measured on CPU
# with torch 2.13: within 2e-7 relative over six steps; 1e-5 leaves room for other versions.
REFERENCE_RTOL = 1e-5
# The tuned configuration (bf16 compute on fp32 master weights, fp32 gradient reduction, chunked
# loss) against the same fp32 reference: bf16 keeps 8 bits of mantissa, so activations carry
# ~0.4% relative error; the loss must stay within 1% at every step. Measured here: at most 0.11%.
BF16_RTOL = 1e-2
# ... and against a single-process reference that computes as FSDP2's mixed precision does (bf16
# copies of fp32 master weights, each rank's gradients in bf16, summed in fp32): the first step's
# loss equal, then a drift to 5e-5 at step six (a reordered fp32 sum now and then flips a weight's
# bf16 rounding, and AdamW carries it on). A loss scaled by 0.1% stands 4x beyond the bound.
MP_REFERENCE_RTOL = 2.5e-4
ODD_LABELS = (128, 129)
"""Labels of each rank in the divisor check: 257 in all, 128.5 per rank, which bf16 rounds to 128."""
REFERENCE_STEPS = 6


def scenarios(root: Path) -> dict[str, dict]:
    jsonl, tokenizer = write_corpus(root / "corpus")
    base = write_toy_model(root / "base")
    chats = write_chat_jsonl(root / "chats.jsonl", toy_conversations(80))
    demo = with_overrides(preset("demo-cpu"), ["eval_every=0"])
    short = ["log_every=1", "warmup_steps=1", "checkpoint_every=0"]
    return {
        "learn": {"cfg": with_overrides(demo, ["steps=40", "log_every=10", "checkpoint_every=20"]),
                  "resume_from": None},
        "reference": {"cfg": with_overrides(demo, [f"steps={REFERENCE_STEPS}", *short]), "resume_from": None},
        "tuned-bf16": {
            "cfg": with_overrides(demo, [f"steps={REFERENCE_STEPS}", *short, "mixed_precision=true"]),
            "resume_from": None,
        },
        "resume-a": {
            "cfg": with_overrides(demo, ["steps=4", "log_every=1", "warmup_steps=1", "checkpoint_every=2"]),
            "resume_from": None,
        },
        "resume-b": {
            "cfg": with_overrides(demo, ["steps=4", "log_every=1", "warmup_steps=1", "checkpoint_every=2"]),
            "resume_from": root / "resume-a" / "checkpoint-0000002",
        },
        "jsonl": {
            "cfg": with_overrides(
                demo,
                [
                    "steps=3",
                    "seq_len=16",
                    *short,
                    "data.kind=jsonl",
                    f"data.path={jsonl}",
                    f"data.tokenizer={tokenizer}",
                ],
            ),
            "resume_from": None,
        },
        "pretrained-chat": {
            "cfg": with_overrides(
                demo,
                [f"model.name_or_path={base}", "data.kind=jsonl", f"data.path={chats}", "seq_len=32",
                 "micro_batch=4", "rows_per_step=16", "steps=4", "log_every=1", "warmup_steps=1",
                 "checkpoint_every=4", "eval_every=2", "data.eval_fraction=0.1"],
            ),
            "resume_from": None,
        },
    }


def recorder(reports: list[dict]):
    def report(metrics: dict, checkpoint_dir: Path | None = None) -> None:
        reports.append(
            {"metrics": metrics, "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir)}
        )

    return report


def step_loss_with_an_odd_label_count(rank: int, cfg: TrainConfig) -> dict[str, float]:
    """One step's loss under `cfg` on micro-batches holding ODD_LABELS labels, sharded as the loop
    shards it, and the exact mean over those labels of the same model's summed losses."""
    cpu = torch.device("cpu")
    ctx = TrainContext(rank=rank, world_size=WORLD_SIZE, local_rank=rank, local_world_size=WORLD_SIZE, node_rank=0,
                       report=recorder([]), latest_checkpoint=lambda: None, scratch_dir=Path("."))
    model, shape = build_model(cfg, device=cpu)
    plan = mesh_plan(cfg, ctx=ctx, device=cpu, model=model)
    model = shard_model(model, cfg, plan=plan, device=cpu)
    _, sync = reductions(cfg, plan)
    source = build_data(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=512, model_name_or_path="").train
    batch = next(batches(source, position=0, micro_batch=cfg.micro_batch, rank=rank, world_size=WORLD_SIZE))
    labels = batch.labels.clone()
    labels.view(-1)[ODD_LABELS[rank]:] = IGNORE_INDEX
    batch = dataclasses.replace(batch, labels=labels)
    share = accumulate_gradients(model, [batch], sync=sync)
    with torch.no_grad():
        total = model(batch.input_ids, batch.labels, divisor=torch.ones((), dtype=torch.int64))
    both = torch.stack([share.double(), total.double()])
    dist.all_reduce(both)
    return {"step_loss": both[0].item() / WORLD_SIZE, "exact": both[1].item() / sum(ODD_LABELS)}


def worker(rank: int, port: int, root: Path, plan: dict[str, dict]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        divisor = step_loss_with_an_odd_label_count(rank, TrainConfig.from_dict(plan["tuned-bf16"]["cfg"]))
        (root / f"divisor-rank{rank}.json").write_text(json.dumps(divisor))
        for name, scenario in plan.items():
            reports: list[dict] = []
            ctx = TrainContext(
                rank=rank,
                world_size=WORLD_SIZE,
                local_rank=rank,
                local_world_size=WORLD_SIZE,
                node_rank=0,
                report=recorder(reports),
                latest_checkpoint=lambda s=scenario: s["resume_from"],
                scratch_dir=root / name,
            )
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                summary = train(TrainConfig.from_dict(scenario["cfg"]), ctx)
            record = {"summary": summary, "reports": reports, "stdout": out.getvalue()}
            (root / f"{name}-rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict[str, list[dict]]]:
    root = tmp_path_factory.mktemp("loop")
    plan = scenarios(root)
    # The config crosses the process boundary as JSON, as it does from the Ray driver.
    wire = {name: {**s, "cfg": s["cfg"].to_dict()} for name, s in plan.items()}
    run_ranks(worker, args=(free_port(), root, wire), nprocs=WORLD_SIZE)
    records = {
        name: [json.loads((root / f"{name}-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
        for name in [*plan, "divisor"]
    }
    return plan, records


def losses(record: dict) -> dict[int, float]:
    return {r["metrics"]["step"]: r["metrics"]["loss"] for r in record["reports"]}


@pytest.mark.slow
def test_loss_falls_on_the_learnable_data(runs):
    _, records = runs
    summary = records["learn"][0]["summary"]
    assert summary["steps_done"] == 40 and summary["resumed_from_step"] == 0
    assert summary["first_loss"] > 5.5  # about log(512) = 6.24 at random init
    assert summary["last_loss"] < 0.6 * summary["first_loss"]
    assert summary["loss_implementation"] == "chunked"
    assert summary["transport_gate"]["applies"] is False


@pytest.mark.slow
def test_every_rank_reports_the_same_steps_and_checkpoints(runs):
    _, records = runs
    for record in records["learn"]:
        steps = [(r["metrics"]["step"], r["checkpoint_dir"] is not None) for r in record["reports"]]
        assert steps == [(10, False), (20, True), (30, False), (40, True)]
        m = record["reports"][0]["metrics"]
        assert set(m) == {"step", "loss", "lr", "tokens_per_s_per_device", "mfu", "peak_mem_gib", "mem_in_use_gib",
                          "grad_norm"}
        assert 0 < m["mem_in_use_gib"] <= m["peak_mem_gib"] + 0.01  # CPU: the resident set now, and its peak
        assert m["mfu"] is None and m["tokens_per_s_per_device"] > 0 and m["grad_norm"] > 0
    assert losses(records["learn"][0]) == losses(records["learn"][1])  # averaged over ranks
    folder = Path(records["learn"][0]["reports"][1]["checkpoint_dir"])
    assert (folder / ".metadata").is_file() and len(list(folder.glob("*.distcp"))) == WORLD_SIZE


@pytest.mark.slow
def test_rank_zero_prints_one_json_line_per_log_step_and_a_summary(runs):
    _, records = runs
    lines = records["learn"][0]["stdout"].splitlines()
    logged = [json.loads(line.removeprefix(TRAIN_PREFIX)) for line in lines if line.startswith(TRAIN_PREFIX)]
    assert [m["step"] for m in logged] == [10, 20, 30, 40]
    assert logged == [r["metrics"] for r in records["learn"][0]["reports"]]
    summaries = [line for line in lines if line.startswith(SUMMARY_PREFIX)]
    assert (
        len(summaries) == 1
        and json.loads(summaries[0].removeprefix(SUMMARY_PREFIX))["last_loss"] == logged[-1]["loss"]
    )
    assert records["learn"][1]["stdout"] == ""


def reference_losses(cfg: TrainConfig) -> list[float]:
    """The same steps in one process: no FSDP, global batch = both ranks' batches. fp32: full
    logits. With cfg.mixed_precision, as FSDP2's policy computes: each rank's batch on bf16 copies
    of the fp32 weights (the loop's chunked loss), its gradients summed over ranks in fp32 (FSDP2's
    reduce dtype), and the optimizer on the fp32 weights."""
    cpu = torch.device("cpu")
    lm = build_causal_lm(cfg.model, device=cpu, seed=cfg.seed)
    model = CausalLMWithLoss(lm, loss=LinearCrossEntropy(implementation="plain"))
    compute = None
    if cfg.mixed_precision:
        chunked = LinearCrossEntropy(implementation="chunked")
        compute = with_bf16_compute(CausalLMWithLoss(copy.deepcopy(lm), loss=chunked))
    # Written out here, not taken from build_optimizer, so that a wrong parameter grouping there
    # cannot cancel out: decay on every weight but the norms and biases, named as HF names them.
    exempt = [p for n, p in model.named_parameters() if "norm" in n or n.endswith(".bias")]
    decayed = [p for n, p in model.named_parameters() if not ("norm" in n or n.endswith(".bias"))]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": exempt, "weight_decay": 0.0}],
        lr=schedule(cfg, 1), betas=cfg.betas, eps=1e-8, foreach=True,
    )
    source = build_data(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=512, model_name_or_path="").train
    streams = [
        batches(source, position=0, micro_batch=cfg.micro_batch, rank=r, world_size=WORLD_SIZE)
        for r in range(WORLD_SIZE)
    ]
    out = []
    for step in range(1, cfg.steps + 1):
        parts: list[Batch] = [next(s) for s in streams]
        set_lr(optimizer, schedule(cfg, step))
        if compute is None:
            loss = model(torch.cat([b.input_ids for b in parts]), torch.cat([b.labels for b in parts]))
            loss.backward()
        else:
            loss = bf16_compute_backward(compute, parts, into=model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        if compute is not None:
            for weight, copied in zip(model.parameters(), compute.parameters(), strict=True):
                copied.data = weight.data.to(torch.bfloat16)
        out.append(loss.item())
    return out


def bf16_compute_backward(compute: CausalLMWithLoss, parts: list[Batch], *, into: CausalLMWithLoss) -> torch.Tensor:
    """The step's loss over every part's labels; the fp32 sum of the parts' bf16 gradients in `into`."""
    count = sum((b.labels != IGNORE_INDEX).sum() for b in parts)
    loss = torch.zeros(())
    for part in parts:
        part_loss = compute(part.input_ids, part.labels, divisor=count)
        part_loss.backward()
        loss += part_loss.detach()
    for weight, copied in zip(into.parameters(), compute.parameters(), strict=True):
        weight.grad = copied.grad.float()
        copied.grad = None
    return loss


@pytest.fixture(scope="module")
def fp32_reference(runs) -> list[float]:
    plan, _ = runs
    want = reference_losses(plan["reference"]["cfg"])
    assert len(want) == REFERENCE_STEPS and want[0] > want[-1] + 0.1  # the steps changed the weights
    return want


@pytest.mark.slow
def test_fsdp2_steps_match_a_single_process_fp32_reference(runs, fp32_reference):
    _, records = runs
    got = losses(records["reference"][0])
    assert [got[s] for s in range(1, REFERENCE_STEPS + 1)] == pytest.approx(
        fp32_reference, rel=REFERENCE_RTOL
    )


@pytest.mark.slow
def test_bf16_mixed_precision_tracks_the_fp32_reference(runs, fp32_reference):
    _, records = runs
    got = losses(records["tuned-bf16"][0])
    assert [got[s] for s in range(1, REFERENCE_STEPS + 1)] == pytest.approx(fp32_reference, rel=BF16_RTOL)
    # bf16 really was in use: the losses are not the fp32 ones.
    assert [got[s] for s in range(1, REFERENCE_STEPS + 1)] != pytest.approx(
        fp32_reference, rel=REFERENCE_RTOL
    )


@pytest.mark.slow
def test_bf16_mixed_precision_matches_a_reference_that_computes_as_it_does(runs):
    plan, records = runs
    want = reference_losses(plan["tuned-bf16"]["cfg"])
    got = losses(records["tuned-bf16"][0])
    assert [got[s] for s in range(1, REFERENCE_STEPS + 1)] == pytest.approx(want, rel=MP_REFERENCE_RTOL)


@pytest.mark.slow
def test_the_step_divides_by_its_exact_label_count_under_mixed_precision(runs):
    _, records = runs
    assert torch.tensor(sum(ODD_LABELS) / WORLD_SIZE).bfloat16().item() != sum(ODD_LABELS) / WORLD_SIZE
    for record in records["divisor"]:
        assert record["step_loss"] == pytest.approx(record["exact"], rel=1e-6)


@pytest.mark.slow
def test_resume_gives_bit_identical_next_losses(runs):
    _, records = runs
    straight, resumed = losses(records["resume-a"][0]), losses(records["resume-b"][0])
    assert sorted(resumed) == [3, 4]
    assert resumed == {3: straight[3], 4: straight[4]}
    summary = records["resume-b"][0]["summary"]
    assert summary["resumed_from_step"] == 2 and summary["steps_done"] == 2


@pytest.mark.slow
def test_jsonl_data_trains(runs):
    _, records = runs
    summary = records["jsonl"][0]["summary"]
    assert summary["steps_done"] == 3
    assert 0 < summary["last_loss"] < summary["first_loss"]


@pytest.mark.slow
def test_a_pretrained_chat_fine_tune_evaluates_and_exports_its_model(runs, tmp_path):
    _, records = runs
    first = records["pretrained-chat"][0]
    evaluated = [r["metrics"]["step"] for r in first["reports"] if "eval_loss" in r["metrics"]]
    assert evaluated == [2, 4] and first["summary"]["eval_loss"] == first["reports"][-1]["metrics"]["eval_loss"]
    assert [r["metrics"].get("eval_loss") for r in records["pretrained-chat"][1]["reports"]] == [
        r["metrics"].get("eval_loss") for r in first["reports"]]  # one figure for all ranks
    lines = first["stdout"].splitlines()
    data = json.loads(next(line for line in lines if line.startswith(DATA_PREFIX)).removeprefix(DATA_PREFIX))
    assert data["chats"] == data["records"] == 80 and data["held_out"] == 8
    # 16 rows a step on 2 ranks of 4-row micro-batches: 2 micro-steps; the passes over the rows, said.
    assert (first["summary"]["rows_per_step"], first["summary"]["grad_accum_steps"]) == (16, 2)
    assert data["rows_per_step"] == 16 and data["passes"] == round(4 * 16 / data["rows"], 2)
    assert ("note" in data) == (data["passes"] > 1)
    load = json.loads(next(line for line in lines if line.startswith(LOAD_PREFIX)).removeprefix(LOAD_PREFIX))
    assert [r["rank"] for r in load["ranks"]] == [0, 1] and all(r["read_mib"] > 0 for r in load["ranks"])
    # The model the run exported (gathered from both ranks' shards) is the one its checkpoint holds.
    checkpoint = Path(first["reports"][-1]["checkpoint_dir"])
    consolidate(checkpoint, tmp_path / "from-shards")
    exported = AutoModelForCausalLM.from_pretrained(checkpoint / "model").state_dict()
    from_shards = AutoModelForCausalLM.from_pretrained(tmp_path / "from-shards").state_dict()
    assert exported.keys() == from_shards.keys()
    assert all(torch.equal(exported[k], from_shards[k]) for k in exported)
