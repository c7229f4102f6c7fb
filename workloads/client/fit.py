"""Whether a run fits the GPUs it is for, decided before anything starts.

The memory model (workloads/sizing/memory.py) predicts the peak each rank allocates for the run's
config on its target: an instance type and node count (a stack's GPU nodes, or `plan`'s), or this
machine's memory for a local CPU run. A run that does not fit is refused with one line: what it
needs against what there is, and the nearest settings that do fit (a smaller micro-batch at the
same rows per step, activation checkpointing, activation offloading, LoRA, more nodes). Where a
checkpointed run fits only with its layers' inputs offloaded to host memory, `sized_for` turns
offloading on (`plan` and `submit` say so).

The model's shape comes from the config: a named architecture, a local folder's config.json, the
Qwen2.5 hub models the presets use (their shapes are the named ones), or another hub model's
config.json (a 1 KB download). For a LoRA run the target modules are checked against it here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from workloads.sizing.memory import (GIB, Architecture, MemoryPrediction, gradient_bytes, optimizer_bytes, predict,
                                     settings_for, weight_bytes)
from workloads.train.config import TrainConfig, with_overrides

HUB_SHAPES = {
    "Qwen/Qwen2.5-1.5B": "qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
}
"""Hub models whose config.json has a named architecture's shape (no download needed)."""
HOST_SHARE = 0.8
"""A local CPU run may take this share of the memory available on this machine."""


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where the ranks run: `nodes` x `ranks_per_node`, each with `memory_gib`."""

    label: str
    nodes: int
    ranks_per_node: int
    memory_gib: float
    """Memory of one GPU (nvidia-smi's total), or for a CPU target what all its ranks may share."""
    device: str = "GPU"
    """"GPU", or "host" for a local CPU run (every rank on this machine's memory)."""
    instance_type: str = ""
    gpu_memory_gib: int = 0
    """The GPU's memory as the instance table names it (24, 80): what presets are chosen by."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @classmethod
    def instances(cls, instance_type: str, nodes: int) -> Target:
        from infra.instance_types import INSTANCE_TYPES

        kind = INSTANCE_TYPES.get(instance_type)
        if kind is None or not kind.gpus or kind.gpu is None:
            known = ", ".join(sorted(n for n, t in INSTANCE_TYPES.items() if t.gpus))
            raise ValueError(f"instance type {instance_type!r} is not a GPU type this project knows: "
                             f"use one of {known}")
        if nodes < 1:
            raise ValueError(f"--nodes {nodes}: give 1 or more")
        return cls(label=f"{nodes} x {instance_type} ({nodes * kind.gpus} x {kind.gpu_model})", nodes=nodes,
                   ranks_per_node=kind.gpus, memory_gib=kind.gpu.memory_mib / 1024, instance_type=instance_type,
                   gpu_memory_gib=kind.gpu_memory_gib)

    @classmethod
    def host(cls, *, ranks: int, available_gib: float) -> Target:
        return cls(label=f"this machine ({ranks} CPU ranks)", nodes=1, ranks_per_node=ranks,
                   memory_gib=available_gib * HOST_SHARE, device="host")


def host_available_gib() -> float:
    """MemAvailable of this machine (Linux), else its total."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def model_config(cfg: TrainConfig, *, cwd: Path):
    """The transformers config of the model the run trains, or None when its shape cannot be known
    here (an s3:// model, a folder on the nodes, a hub model that cannot be reached)."""
    from workloads.model_io.architectures import named_architecture

    name = cfg.model.name_or_path
    if cfg.model.is_named_architecture:
        return named_architecture(name)
    if name in HUB_SHAPES:
        return named_architecture(HUB_SHAPES[name])
    if "://" in name:
        return None
    from transformers import AutoConfig

    folder = (cwd / name).expanduser()
    local = (folder / "config.json").is_file()
    if not local and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        return None  # a folder this machine does not have
    try:  # a local folder's config.json, or a hub id's alone
        if local:
            return AutoConfig.from_pretrained(folder, trust_remote_code=False)
        return AutoConfig.from_pretrained(name, revision=cfg.model.revision or None, trust_remote_code=False)
    except (OSError, ValueError, KeyError):
        return None  # unreadable here: the job's own load says why


def check_lora_targets(cfg: TrainConfig, config) -> None:
    """ValueError naming the model's linear modules when lora.target_modules matches none of them."""
    if cfg.method != "lora":
        return
    import torch
    from transformers import AutoModelForCausalLM

    from workloads.train.method import resolve_target_modules

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    resolve_target_modules(lm, cfg.lora.target_modules)


def shard_ranks(cfg: TrainConfig, arch: Architecture, target: Target) -> int:
    """The ranks each parameter is sharded over, as the loop's mesh plan would choose them."""
    from workloads.train.parallel import plan_mesh

    unsharded = settings_for(cfg, shard_ranks=1)
    state = weight_bytes(arch, unsharded) + gradient_bytes(arch, unsharded) + optimizer_bytes(arch, unsharded)
    plan = plan_mesh(requested=cfg.parallelism,
                     node_of_rank=[n for n in range(target.nodes) for _ in range(target.ranks_per_node)],
                     model_state_bytes=state,
                     device_memory_bytes=None if target.device == "host" else int(target.memory_gib * GIB))
    return plan.shape[-1]


@dataclass(frozen=True, kw_only=True)
class Fit:
    cfg: TrainConfig
    target: Target
    prediction: MemoryPrediction
    shard_ranks: int

    @property
    def needed_gib(self) -> float:
        """Per GPU: the peak with the allocator's slack and the CUDA context; on a host: every rank's peak."""
        if self.target.device == "host":
            return self.prediction.peak_gib * self.target.world_size
        return self.prediction.needed_gib()

    @property
    def fits(self) -> bool:
        return self.needed_gib <= self.target.memory_gib

    def describe(self) -> str:
        if self.target.device == "host":
            return (f"{self.prediction.peak_gib:.2f} GiB per rank, {self.needed_gib:.1f} GiB for "
                    f"{self.target.world_size} ranks, of {self.target.memory_gib:.1f} GiB this machine can spare")
        return (f"predicted {self.prediction.peak_gib:.2f} GiB of {self.target.memory_gib:.2f} GiB per GPU "
                f"(needs {self.needed_gib:.2f} with the allocator's slack and the CUDA context)")


def assess(cfg: TrainConfig, arch: Architecture, target: Target) -> Fit:
    """The fit of `cfg` as the target's ranks run it (rows_per_step resolved into micro-steps: held
    gradients count with accumulation). ValueError where its rows do not divide among the ranks."""
    cfg = cfg.for_world_size(target.world_size)
    ranks = shard_ranks(cfg, arch, target)
    loss = "chunked" if target.device == "host" else None
    return Fit(cfg=cfg, target=target, prediction=predict(arch, settings_for(cfg, shard_ranks=ranks, loss=loss)),
               shard_ranks=ranks)


@dataclass(frozen=True, kw_only=True)
class Alternative:
    label: str
    """What to change, as the user would say it (`--set micro_batch=1`, `--set method=lora`)."""
    fit: Fit


def _smaller_micro_batches(cfg: TrainConfig) -> list[list[str]]:
    """Each smaller micro-batch that keeps the rows per step (more micro-steps), largest first: with
    rows_per_step the micro-steps follow by themselves."""
    out = []
    for mb in range(cfg.micro_batch - 1, 0, -1):
        if cfg.micro_batch % mb == 0:
            out.append([f"micro_batch={mb}"] if cfg.rows_per_step else
                       [f"micro_batch={mb}", f"grad_accum_steps={cfg.grad_accum_steps * cfg.micro_batch // mb}"])
    return out


def nearest_fits(cfg: TrainConfig, arch: Architecture, target: Target) -> list[Alternative]:
    """The first setting that fits in each direction: a smaller micro-batch at the same rows per
    step, activation checkpointing (with the largest micro-batch that then fits), activation
    offloading where checkpointing alone does not fit (likewise), LoRA instead of
    a full fine-tune, more nodes (GPU targets)."""
    def first(candidates: Sequence[list[str]]) -> Optional[Alternative]:
        for overrides in candidates:
            fit = assess(with_overrides(cfg, overrides), arch, target)
            if fit.fits:
                return Alternative(label=" ".join(f"--set {o}" for o in overrides), fit=fit)
        return None

    found = [first(_smaller_micro_batches(cfg))]
    checkpointed = "model.activation_checkpointing=true"
    if not cfg.model.activation_checkpointing:
        base = [checkpointed]
        found.append(first([base] + [[checkpointed, *mb] for mb in _smaller_micro_batches(cfg)]))
    # Offloading the checkpointed layers' inputs (GPUs only), where checkpointing alone does not do.
    if target.device == "GPU" and not cfg.model.activation_offloading and (
            cfg.model.activation_checkpointing or first([[checkpointed]]) is None):
        offloaded = [OFFLOADED] if cfg.model.activation_checkpointing else [checkpointed, OFFLOADED]
        found.append(first([offloaded] + [[*offloaded, *mb] for mb in _smaller_micro_batches(cfg)]))
    if cfg.method == "full" and cfg.objective == "dpo" and cfg.dpo.reference == "model":
        # A full fine-tune's reference copy (bf16) leaves memory when its log-probabilities are precomputed.
        found.append(first([["dpo.reference=precomputed"], ["dpo.reference=precomputed", checkpointed]]))
    if cfg.method == "full":
        found.append(first([["method=lora"], ["method=lora", checkpointed]]))
    if target.instance_type:
        for nodes in range(target.nodes + 1, 4 * target.nodes + 1):
            try:
                fit = assess(cfg, arch, Target.instances(target.instance_type, nodes))
            except ValueError:  # its rows per step do not divide among that many ranks
                continue
            if fit.fits:
                found.append(Alternative(label=f"{nodes} nodes", fit=fit))
                break
    return [a for a in found if a is not None]


OFFLOADED = "model.activation_offloading=true"


def offloading_makes_it_fit(cfg: TrainConfig, arch: Architecture, target: Target) -> bool:
    """Whether a checkpointed run on GPUs that does not fit would fit with its layers' inputs
    offloaded to host memory (workloads/train/offload.py)."""
    if target.device != "GPU" or not cfg.model.activation_checkpointing or cfg.model.activation_offloading:
        return False
    return not assess(cfg, arch, target).fits and assess(with_overrides(cfg, [OFFLOADED]), arch, target).fits


def micro_batch_for(cfg: TrainConfig, arch: Architecture, target: Target) -> Optional[int]:
    """The largest micro-batch the GPUs' memory takes (by the memory model) among those that divide
    the rows each rank trains per step; None without rows_per_step, or where none fits (the fit
    check then says what would). ValueError where the rows do not divide among the ranks."""
    if not cfg.rows_per_step or target.device != "GPU":
        return None
    per_rank = cfg.for_world_size(target.world_size).samples_per_rank_per_step
    for micro_batch in (m for m in range(per_rank, 0, -1) if per_rank % m == 0):
        candidate = with_overrides(cfg, [f"micro_batch={micro_batch}"])
        if assess(candidate, arch, target).fits:
            return micro_batch
    return None


def sized_for(cfg: TrainConfig, target: Target, *, cwd: Path, config=None) -> TrainConfig:
    """`cfg` with the micro-batch the target's GPU memory takes (`micro_batch_for`), and with activation
    offloading turned on where no micro-batch (or, without rows_per_step, its own) fits without it
    and one does with it (`offloading_turned_on` says so); unchanged where nothing can be chosen (an
    unknown model shape, nothing fits)."""
    config = config or model_config(cfg, cwd=cwd)
    if config is None:
        return cfg
    arch = Architecture.from_config(config)
    if not cfg.rows_per_step:
        return with_overrides(cfg, [OFFLOADED]) if offloading_makes_it_fit(cfg, arch, target) else cfg
    chosen = micro_batch_for(cfg, arch, target)
    if chosen is None and target.device == "GPU" and cfg.model.activation_checkpointing:
        offloaded = with_overrides(cfg, [OFFLOADED])
        chosen = micro_batch_for(offloaded, arch, target)
        cfg = offloaded if chosen is not None else cfg
    return cfg if chosen is None else with_overrides(cfg, [f"micro_batch={chosen}"])


def offloading_turned_on(before: TrainConfig, after: TrainConfig) -> bool:
    """Whether `sized_for` turned activation offloading on."""
    return after.model.activation_offloading and not before.model.activation_offloading


def refusal(fit: Fit, alternatives: Sequence[Alternative], *, what: str) -> str:
    """The one line a run that does not fit is refused with."""
    ways = [f"{a.label} ({a.fit.prediction.peak_gib:.1f} GiB)" for a in alternatives]
    stuck = ("lower seq_len (tokens per sample) or micro_batch" if fit.target.device == "host"
             else "use GPUs with more memory")
    way_out = ("; it fits with " + ", or ".join(ways)) if ways else f"; no nearby setting fits: {stuck}"
    return f"{what} does not fit {fit.target.label}: {fit.describe()}{way_out}"


def check_fits(cfg: TrainConfig, target: Target, *, what: str, cwd: Path, config=None) -> Optional[Fit]:
    """Refuse (ValueError, one line) a run that does not fit `target` or names LoRA targets its
    model lacks; the Fit when it fits, None when the model's shape is unknown here. `config`: the
    model's transformers config when the caller knows it (a model it is about to make)."""
    config = config or model_config(cfg, cwd=cwd)
    if config is None:
        return None
    check_lora_targets(cfg, config)
    arch = Architecture.from_config(config)
    fit = assess(cfg, arch, target)
    if not fit.fits:
        raise ValueError(refusal(fit, nearest_fits(cfg, arch, target), what=what))
    return fit
