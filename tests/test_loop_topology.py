"""Topology-aware sharding, in four gloo processes on CPU shaped as two nodes of two ranks.

Ranks are numbered across nodes (node = rank % 2), as a launcher may number them, so the HSDP mesh
has to be built from the node ranks rather than from rank order. One spawn runs every scenario;
the tests check the records the ranks left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from uneven_chats import data_overrides, one_batch_step, write_uneven_chats
from ranks import run_ranks

from workloads.client.cluster import free_port
from workloads.context import TrainContext
from workloads.train.config import TrainConfig, preset, with_overrides
from workloads.train.data import batches, build_data, global_indices
from workloads.train.loop import build_model, mesh_plan, reductions, shard_model, train
from workloads.train.step import accumulate_gradients
from workloads.train.parallel import GradientSync, MeshPlan, plan_mesh, reduction_plan

WORLD_SIZE, NODES = 4, 2
STEPS = 6
# Flat FSDP, HSDP and accumulation compute the same fp32 sums in other orders: measured here
# within 9e-8 relative over six steps (torch 2.13); 1e-5 leaves room for other versions.
SAME_SUMS_RTOL = 1e-5
# With bf16 compute the same reordering moves fp32 master weights by an ulp, which now and then
# flips a bf16 rounding of a weight: measured 7e-6 relative (HSDP vs flat, both fp32 reductions).
MP_SAME_SUMS_RTOL = 1e-4
# bf16 between nodes against fp32 between nodes, both with bf16 compute: the node-reduced fp32
# gradient is rounded to bf16 (2^-9 relative) before and after the all-reduce. Measured here: the
# reduced gradient within 0.25% of the fp32 one (norm of the difference over the norm), the loss
# within 0.023% at every step of six, with or without accumulation. The bounds leave 4x room.
BF16_GRAD_RTOL = 1e-2
BF16_LOSS_RTOL = 1e-3
ACCUM_STEPS = 3
CHAT_ROWS = 8
"""Rows per step of the uneven-chat scenarios: micro-batch x micro-steps x ranks."""
# One step on uneven chats, split into micro-batches and ranks, against one batch in one process:
# the same per-token sums in other orders. Measured here: within 3e-7 (loss and gradient norm), in
# fp32 and with bf16 compute (against the same pieces' bf16 gradients summed in fp32). A mean per
# micro-batch (what the loop did before) moves the step-1 loss by 0.04% (HSDP, one micro-step) to
# 0.21% (two micro-steps), a divisor rounded to bf16 by 0.37%: far outside it.
SPLIT_RTOL = 1e-5


CHAT_SPLITS = {
    "flat-accum": ["parallelism=fsdp", "micro_batch=1", "grad_accum_steps=2"],
    "hsdp": ["parallelism=hsdp", "micro_batch=2"],
    "hsdp-accum": ["parallelism=hsdp", "micro_batch=1", "grad_accum_steps=2"],
}


def chat_pieces(split: str) -> list[list[int]]:
    """The rows of each micro-batch on each rank of a chat split's step 1."""
    cfg = with_overrides(preset("demo-cpu"), CHAT_SPLITS[split])
    return [global_indices(position=0, batch=k, micro_batch=cfg.micro_batch, rank=r, world_size=WORLD_SIZE)
            for r in range(WORLD_SIZE) for k in range(cfg.grad_accum_steps)]


def node_of(rank: int) -> int:
    return rank % NODES


def scenarios(root: Path) -> dict[str, dict]:
    demo = preset("demo-cpu")
    chats = [*data_overrides(*write_uneven_chats(root)), "steps=1", "log_every=1", "warmup_steps=1",
             "checkpoint_every=0"]
    short = [f"steps={STEPS}", "log_every=1", "warmup_steps=1", "checkpoint_every=0"]
    mp_fp32 = ["mixed_precision=true", "cross_node_reduce_dtype=float32"]
    resume = ["steps=4", "log_every=1", "warmup_steps=1", "checkpoint_every=2", "micro_batch=2",
              "grad_accum_steps=2"]
    plan = {
        "flat": [*short, "parallelism=fsdp", "micro_batch=4"],
        "flat-accum": [*short, "parallelism=fsdp", "micro_batch=2", "grad_accum_steps=2"],
        "auto": [*short, "micro_batch=4"],
        "auto-accum": [*short, "micro_batch=2", "grad_accum_steps=2"],
        "mp-flat-fp32": [*short, "parallelism=fsdp", "micro_batch=4", *mp_fp32],
        "mp-hsdp-fp32": [*short, "parallelism=hsdp", "micro_batch=4", *mp_fp32],
        "mp-auto": [*short, "micro_batch=4", "mixed_precision=true"],
        "mp-auto-accum": [*short, "micro_batch=2", "grad_accum_steps=2", "mixed_precision=true"],
        "resume-a": resume,
        "resume-b": resume,
        # CHAT_ROWS rows per step, split three ways, in fp32 and with bf16 compute (fp32 reductions,
        # which the one-batch reference sums as FSDP2 does).
        **{f"{prefix}chats-{split}": [*chats, *options, *extra] for prefix, extra in (("", []), ("mp-", mp_fp32))
           for split, options in CHAT_SPLITS.items()},
    }
    return {
        name: {
            "cfg": with_overrides(demo, overrides).to_dict(),
            "resume_from": str(root / "resume-a" / "checkpoint-0000002") if name == "resume-b" else None,
        }
        for name, overrides in plan.items()
    }


def context(rank: int, *, root: Path, name: str, resume_from: str | None, reports: list) -> TrainContext:
    def report(metrics: dict, checkpoint_dir: Path | None = None) -> None:
        reports.append({"metrics": metrics, "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir)})

    return TrainContext(
        rank=rank,
        world_size=WORLD_SIZE,
        local_rank=rank // NODES,
        local_world_size=WORLD_SIZE // NODES,
        node_rank=node_of(rank),
        report=report,
        latest_checkpoint=lambda: None if resume_from is None else Path(resume_from),
        scratch_dir=root / name,
    )


class CollectiveLog:
    """Records the gradient reductions FSDP2 issues (it calls them through `torch.distributed`)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CollectiveLog:
        names = ["all_reduce", "reduce_scatter_tensor", "reduce_scatter_single"]
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                # all_reduce(tensor, op, group); reduce_scatter_*(output, input, op, group)
                params = ["tensor", "op", "group"] if _name == "all_reduce" else ["output", "input", "op", "group"]
                bound = dict(zip(params, args)) | kwargs
                reduced = bound["tensor" if _name == "all_reduce" else "input"]
                group = bound.get("group")
                ranks = dist.get_process_group_ranks(group) if group is not None else range(WORLD_SIZE)
                self.calls.append({
                    "op": "all_reduce" if _name == "all_reduce" else "reduce_scatter",
                    "dtype": str(reduced.dtype).removeprefix("torch."),
                    "ranks": sorted(ranks),
                })
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def mark(self, label: str) -> None:
        self.calls.append({"op": "mark", "label": label})

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MarkingSync(GradientSync):
    """The loop's sync, with a mark in the collective log before each micro-step's backward."""

    log: CollectiveLog | None = None

    def before_backward(self, model, *, last: bool) -> None:
        self.log.mark("last" if last else "micro")
        super().before_backward(model, last=last)


def sharded_step(rank: int, *, parallelism: str, dtype: str):
    """A model sharded as the loop shards it, its sync and one step's micro-batches (bf16 compute)."""
    cfg = with_overrides(preset("demo-cpu"), ["mixed_precision=true", f"parallelism={parallelism}",
                                              f"cross_node_reduce_dtype={dtype}", "micro_batch=2",
                                              f"grad_accum_steps={ACCUM_STEPS}"])
    ctx = context(rank, root=Path("."), name="unused", resume_from=None, reports=[])
    cpu = torch.device("cpu")
    model, shape = build_model(cfg, device=cpu)
    plan = mesh_plan(cfg, ctx=ctx, device=cpu, model=model)
    model = shard_model(model, cfg, plan=plan, device=cpu)
    _, sync = reductions(cfg, plan)
    source = build_data(cfg.data, seq_len=cfg.seq_len, seed=0, vocab_size=512, model_name_or_path="").train
    data = batches(source, position=0, micro_batch=cfg.micro_batch, rank=rank, world_size=WORLD_SIZE)
    return model, sync, [next(data) for _ in range(ACCUM_STEPS)]


def reductions_by_micro_step(rank: int, *, parallelism: str, dtype: str) -> list[list[dict]]:
    """One optimizer step of ACCUM_STEPS micro-steps with the collectives logged per micro-step."""
    model, sync, micro_batches = sharded_step(rank, parallelism=parallelism, dtype=dtype)
    with CollectiveLog() as log:
        marking = MarkingSync(hsdp=sync.hsdp, cross_node_dtype=sync.cross_node_dtype, log=log)
        accumulate_gradients(model, micro_batches, sync=marking)
    steps: list[list[dict]] = []
    for call in log.calls:
        if call["op"] == "mark":
            steps.append([])
        elif steps:  # reductions run in backward, after the mark
            steps[-1].append(call)
    return steps


def reduced_gradients(rank: int, *, cross: str) -> dict[str, torch.Tensor]:
    """This rank's gradient shards after one accumulated step under HSDP with bf16 compute."""
    model, sync, micro_batches = sharded_step(rank, parallelism="hsdp", dtype=cross)
    accumulate_gradients(model, micro_batches, sync=sync)
    return {name: p.grad.to_local().detach().clone() for name, p in model.named_parameters()}


def worker(rank: int, port: int, root: Path, plan: dict[str, dict]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        for name, scenario in plan.items():
            reports: list[dict] = []
            ctx = context(rank, root=root, name=name, resume_from=scenario["resume_from"], reports=reports)
            with contextlib.redirect_stdout(io.StringIO()):
                summary = train(TrainConfig.from_dict(scenario["cfg"]), ctx)
            (root / f"{name}-rank{rank}.json").write_text(json.dumps({"summary": summary, "reports": reports}))
        counts = {
            f"{parallelism}-{dtype}": reductions_by_micro_step(rank, parallelism=parallelism, dtype=dtype)
            for parallelism, dtype in (("auto", "bfloat16"), ("auto", "float32"), ("fsdp", "float32"))
        }
        (root / f"count-rank{rank}.json").write_text(json.dumps(counts))
        fp32, bf16 = reduced_gradients(rank, cross="float32"), reduced_gradients(rank, cross="bfloat16")
        diff = sum(float((bf16[k] - fp32[k]).double().norm() ** 2) for k in fp32)
        norm = sum(float(fp32[k].double().norm() ** 2) for k in fp32)
        (root / f"grads-rank{rank}.json").write_text(json.dumps({"diff": diff**0.5, "norm": norm**0.5}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("topology")
    plan = scenarios(root)
    run_ranks(worker, args=(free_port(), root, plan), nprocs=WORLD_SIZE)
    names = [*plan, "count", "grads"]
    out = {
        name: [json.loads((root / f"{name}-rank{r}.json").read_text()) for r in range(WORLD_SIZE)] for name in names
    }
    out["chats-one-batch"] = one_batch_step(*write_uneven_chats(root), rows=CHAT_ROWS)
    for split in CHAT_SPLITS:
        out[f"mp-chats-{split}-one-batch"] = one_batch_step(*write_uneven_chats(root), rows=CHAT_ROWS,
                                                            pieces=chat_pieces(split))
    return out


def relative_gap(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def losses(records: dict, name: str) -> list[float]:
    by_step = {r["metrics"]["step"]: r["metrics"]["loss"] for r in records[name][0]["reports"]}
    return [by_step[s] for s in sorted(by_step)]


# --- the plan, as data ------------------------------------------------------------------------------

GIB = 2**30
QWEN_1_5B_STATE = 16 * 1_543_714_304
"""Qwen2.5-1.5B's fp32 weights, gradients and AdamW moments (a full fine-tune)."""


@pytest.mark.parametrize(
    ("node_of_rank", "gib", "kind", "shape", "rows"),
    [
        ([0, 0, 0, 0], 24, "fsdp", (4,), ((0, 1, 2, 3),)),  # one node
        ([0, 0, 0, 0, 1, 1, 1, 1], 24, "hsdp", (2, 4), ((0, 1, 2, 3), (4, 5, 6, 7))),  # 2x g6.12xlarge
        ([0, 1], 140, "hsdp", (2, 1), ((0,), (1,))),  # two emulated hosts of one H200 each
        ([1, 0, 1, 0], 24, "hsdp", (2, 2), ((1, 3), (0, 2))),  # ranks numbered across nodes
        ([0, 0, 0, 1], 24, "fsdp", (4,), ((0, 1, 2, 3),)),  # uneven nodes
    ],
)
def test_auto_follows_the_nodes(node_of_rank, gib, kind, shape, rows):
    plan = plan_mesh(requested="auto", node_of_rank=node_of_rank, model_state_bytes=QWEN_1_5B_STATE,
                     device_memory_bytes=gib * GIB)
    assert (plan.kind, plan.shape, plan.ranks) == (kind, shape, rows)
    assert plan.nodes == len(set(node_of_rank))


def test_auto_shards_over_every_rank_when_one_node_cannot_hold_the_model_state():
    # Qwen2.5-1.5B: 16 bytes a parameter is 23 GiB; on one 24 GB GPU per node that cannot be replicated.
    one_gpu_nodes = plan_mesh(requested="auto", node_of_rank=[0, 1], model_state_bytes=QWEN_1_5B_STATE,
                              device_memory_bytes=24 * GIB)
    assert one_gpu_nodes.kind == "fsdp" and "23.0 GiB per rank" in one_gpu_nodes.reason
    h200 = plan_mesh(requested="auto", node_of_rank=[0, 1], model_state_bytes=QWEN_1_5B_STATE,
                     device_memory_bytes=140 * GIB)
    assert h200.kind == "hsdp"
    assert plan_mesh(requested="auto", node_of_rank=[0, 1], model_state_bytes=16 * 10**12,
                     device_memory_bytes=None).kind == "hsdp"


def test_the_config_overrides_auto():
    nodes = [0, 0, 1, 1]
    assert plan_mesh(requested="fsdp", node_of_rank=nodes, model_state_bytes=16, device_memory_bytes=None).shape == (4,)
    forced = plan_mesh(requested="hsdp", node_of_rank=[0, 0], model_state_bytes=16, device_memory_bytes=None)
    assert (forced.kind, forced.shape) == ("hsdp", (1, 2))
    with pytest.raises(ValueError, match="different numbers of ranks"):
        plan_mesh(requested="hsdp", node_of_rank=[0, 0, 1], model_state_bytes=16, device_memory_bytes=None)


def test_only_traffic_between_nodes_uses_the_cross_node_dtype():
    bf16 = torch.bfloat16
    hsdp = MeshPlan(kind="hsdp", ranks=((0, 1), (2, 3)), nodes=2, reason="")
    flat_two_nodes = MeshPlan(kind="fsdp", ranks=((0, 1, 2, 3),), nodes=2, reason="")
    flat_one_node = MeshPlan(kind="fsdp", ranks=((0, 1, 2, 3),), nodes=1, reason="")
    assert reduction_plan(hsdp, mixed_precision=True, cross_node_dtype=bf16) == (
        torch.float32, GradientSync(hsdp=True, cross_node_dtype=bf16))
    assert reduction_plan(flat_two_nodes, mixed_precision=True, cross_node_dtype=bf16) == (bf16, GradientSync())
    assert reduction_plan(flat_one_node, mixed_precision=True, cross_node_dtype=bf16) == (torch.float32, GradientSync())
    assert reduction_plan(hsdp, mixed_precision=False, cross_node_dtype=bf16) == (
        torch.float32, GradientSync(hsdp=True, cross_node_dtype=None))


def test_config_rejects_bad_parallelism_values():
    for bad, match in (({"parallelism": "ddp"}, "parallelism"), ({"grad_accum_steps": 0}, "grad_accum_steps"),
                       ({"cross_node_reduce_dtype": "float16"}, "cross_node_reduce_dtype")):
        with pytest.raises(ValueError, match=match):
            TrainConfig.from_dict(bad)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        TrainConfig(grad_accum_steps=0)


# --- four ranks on two nodes --------------------------------------------------------------------------


@pytest.mark.slow
def test_auto_builds_an_hsdp_mesh_from_the_node_ranks(records):
    for name in ("auto", "mp-auto-accum", "resume-a"):
        summary = records[name][0]["summary"]
        assert summary["parallelism"]["kind"] == "hsdp" and summary["parallelism"]["mesh"] == [2, 2], name
        assert summary["nodes"] == NODES
    assert records["flat"][0]["summary"]["parallelism"]["mesh"] == [WORLD_SIZE]


@pytest.mark.slow
def test_hsdp_gives_flat_fsdps_loss_curve(records):
    flat = losses(records, "flat")
    assert len(flat) == STEPS and flat[0] > flat[-1] + 0.1  # the steps changed the weights
    assert losses(records, "auto") == pytest.approx(flat, rel=SAME_SUMS_RTOL)
    assert losses(records, "mp-hsdp-fp32") == pytest.approx(losses(records, "mp-flat-fp32"), rel=MP_SAME_SUMS_RTOL)


@pytest.mark.slow
def test_accumulation_matches_one_bigger_batch(records):
    flat = losses(records, "flat")  # micro-batch 4, one micro-step
    assert losses(records, "flat-accum") == pytest.approx(flat, rel=SAME_SUMS_RTOL)  # 2 x 2
    assert losses(records, "auto-accum") == pytest.approx(flat, rel=SAME_SUMS_RTOL)
    for name in ("flat", "flat-accum", "auto-accum"):
        metrics = records[name][0]["reports"][-1]["metrics"]
        assert metrics["grad_norm"] == pytest.approx(records["flat"][0]["reports"][-1]["metrics"]["grad_norm"],
                                                     rel=SAME_SUMS_RTOL)


@pytest.mark.slow
def test_bf16_between_nodes_stays_within_its_bound(records):
    fp32 = losses(records, "mp-flat-fp32")
    for name in ("mp-auto", "mp-auto-accum"):
        got = losses(records, name)
        assert got == pytest.approx(fp32, rel=BF16_LOSS_RTOL), name
    # ... and bf16 really crossed the nodes: it moves the losses well beyond what reordering fp32
    # sums does.
    reordered = relative_gap(losses(records, "mp-hsdp-fp32"), fp32)
    assert relative_gap(losses(records, "mp-auto"), fp32) > 3 * reordered
    for record in records["grads"]:
        assert 1e-6 < record["diff"] / record["norm"] < BF16_GRAD_RTOL


@pytest.mark.slow
def test_only_the_last_micro_step_all_reduces_across_nodes(records):
    for rank, record in enumerate(records["count"]):
        node_peers = [r for r in range(WORLD_SIZE) if node_of(r) == node_of(rank)]
        # The mesh's rows are the nodes ((0, 2), (1, 3)); its columns, the same shard on each node.
        replicas = [r for r in range(WORLD_SIZE) if r // NODES == rank // NODES]
        units = 3  # two decoder layers and the root
        hsdp = record["auto-bfloat16"]
        assert len(hsdp) == ACCUM_STEPS
        for i, calls in enumerate(hsdp):
            last = i == ACCUM_STEPS - 1
            scatters = [c for c in calls if c["op"] == "reduce_scatter"]
            reduces = [c for c in calls if c["op"] == "all_reduce"]
            # Within the node every micro-step (fp32 until the last, which reduces in bf16) ...
            assert [c["ranks"] for c in scatters] == [node_peers] * units
            assert {c["dtype"] for c in scatters} == {"bfloat16" if last else "float32"}
            # ... across nodes only on the last, in bf16.
            assert [c["ranks"] for c in reduces] == ([replicas] * units if last else [])
            assert {c["dtype"] for c in reduces} <= {"bfloat16"}
        assert {c["dtype"] for c in record["auto-float32"][-1]} == {"float32"}
        assert [len(calls) for calls in record["auto-float32"]] == [units, units, 2 * units]
        # Flat FSDP has no cross-node stage of its own: every micro-step reduce-scatters over all ranks.
        flat = record["fsdp-float32"]
        assert [[c["ranks"] for c in calls] for calls in flat] == [[list(range(WORLD_SIZE))] * units] * ACCUM_STEPS


@pytest.mark.slow
@pytest.mark.parametrize("split", CHAT_SPLITS)
@pytest.mark.parametrize("prefix", ["", "mp-"], ids=["fp32", "bf16-compute"])
def test_a_step_on_uneven_chats_is_one_batch_however_it_is_split(records, prefix, split):
    one_batch = records[f"mp-chats-{split}-one-batch" if prefix else "chats-one-batch"]
    # The step's divisor per rank is one bf16 cannot hold: rounding it would scale the loss by 0.37%.
    per_rank = one_batch["labels"] / WORLD_SIZE
    assert torch.tensor(per_rank).bfloat16().item() != per_rank
    step = records[f"{prefix}chats-{split}"][0]["reports"][0]["metrics"]
    assert step["step"] == 1
    assert step["loss"] == pytest.approx(one_batch["loss"], rel=SPLIT_RTOL)
    assert step["grad_norm"] == pytest.approx(one_batch["grad_norm"], rel=SPLIT_RTOL)


@pytest.mark.slow
def test_a_resumed_accumulating_run_continues_exactly(records):
    straight, resumed = losses(records, "resume-a"), losses(records, "resume-b")
    assert resumed == straight[2:]
    summary = records["resume-b"][0]["summary"]
    assert summary["resumed_from_step"] == 2 and summary["steps_done"] == 2
    checkpoint_dir = records["resume-a"][0]["reports"][1]["checkpoint_dir"]
    progress = {"step": 0, "data_position": 0}
    dcp.load({"progress": progress}, checkpoint_id=checkpoint_dir, no_dist=True)
    # 2 steps x 2 micro-steps x micro-batch 2 x 4 ranks.
    assert progress == {"step": 2, "data_position": 32}
