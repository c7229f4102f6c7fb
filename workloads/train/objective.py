"""The training objective, as one object the loop calls (`objective` in the config): what a batch
holds, the module FSDP2 shards around the model, the reference, the step's loss and the metrics.

- `SupervisedObjective` ("sft"): the next-token loss on the records' answers (or whole texts),
  packed rows of samples (workloads/train/data.py), the loss inside the sharded module's forward
  (CausalLMWithLoss), the step of workloads/train/step.py; no reference.
- `PreferenceObjective` ("dpo", workloads/train/preference.py): pairs packed two sequences to a
  row (workloads/train/pairs.py), per-token log-probabilities out of the sharded module, a
  reference model (workloads/train/reference.py), the DPO loss and TRL's metrics.

The loop calls, in order: `build_data`, `eval_batches`, `wrap` (building the model),
`prepare` (after the weights are loaded, before the first step), `batches`, then per step `step`,
and on log steps `step_metrics`, on evaluation steps `evaluate`, on checkpoints `save`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from workloads.train.config import TrainConfig
from workloads.train.data import Batch, Data, batches, build_data, eval_batches
from workloads.train.loss import IGNORE_INDEX, LinearCrossEntropy, choose_implementation
from workloads.train.model import CausalLMWithLoss
from workloads.train.parallel import GradientSync
from workloads.train.step import train_step


class Objective(Protocol):
    name: str

    def build_data(self, cfg: TrainConfig, *, vocab_size: int, model_name_or_path: str, eval_rows: int = 0,
                   cache_dir: str = "") -> Data:
        """The training and held-out sources (`eval_rows`: samples a synthetic evaluation takes)."""

    def batches(self, source, *, position: int, micro_batch: int, rank: int, world_size: int,
                pin_memory: bool = False) -> Iterator[Batch]:
        """This rank's micro-batches from data position `position` on, forever."""

    def eval_batches(self, source, *, rows: int, micro_batch: int, rank: int, world_size: int,
                     max_rows: int) -> list[Batch]:
        """This rank's share of the held-out samples, the same number of micro-batches on every rank."""

    def wrap(self, lm: nn.Module, *, device: torch.device) -> nn.Module:
        """The module FSDP2 shards: `lm` with what the objective computes from its hidden states."""

    def prepare(self, model: nn.Module, *, method, data: Data, pretrained: Optional[Path], device: torch.device,
                resume_from: Optional[Path], rank: int, world_size: int) -> None:
        """After the weights are loaded, before the first step (every rank: may be collective)."""

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], *, lr: float,
             grad_clip: float, sync: GradientSync = GradientSync()) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: (this rank's share of the loss times the world size, grad norm), on
        the device, not yet read back."""

    def step_metrics(self) -> dict:
        """The last step's metrics beside its loss (a collective on log steps)."""

    def evaluate(self, model: nn.Module, held_out: list[Batch], *, device: torch.device) -> dict:
        """`eval_loss` and the objective's other held-out metrics (a collective)."""

    def save(self, folder: Path, *, writer_rank: bool) -> None:
        """What a checkpoint keeps of the objective besides the model and optimizer."""

    def describe(self) -> dict:
        """For the run's summary and tracker."""

    def extra_flops_per_token(self, *, n_params: int, n_layers: int, n_heads: int, head_dim: int,
                              seq_len: int) -> float:
        """Model FLOPs per trained token beyond the training pass (a reference's forward)."""


class SupervisedObjective:
    name = "sft"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    def build_data(self, cfg: TrainConfig, *, vocab_size: int, model_name_or_path: str, eval_rows: int = 0,
                   cache_dir: str = "") -> Data:
        return build_data(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=vocab_size,
                          model_name_or_path=model_name_or_path, eval_rows=eval_rows, cache_dir=cache_dir)

    def batches(self, source, *, position: int, micro_batch: int, rank: int, world_size: int,
                pin_memory: bool = False) -> Iterator[Batch]:
        return batches(source, position=position, micro_batch=micro_batch, rank=rank, world_size=world_size,
                       pin_memory=pin_memory)

    def eval_batches(self, source, *, rows: int, micro_batch: int, rank: int, world_size: int,
                     max_rows: int) -> list[Batch]:
        return eval_batches(source, rows=rows, micro_batch=micro_batch, rank=rank, world_size=world_size,
                            max_rows=max_rows)

    def wrap(self, lm: nn.Module, *, device: torch.device) -> CausalLMWithLoss:
        loss = LinearCrossEntropy(
            implementation=choose_implementation(fused=self.cfg.fused_linear_ce, device=device),
            chunk_size=self.cfg.loss_chunk_size,
        )
        return CausalLMWithLoss(lm, loss=loss)

    def prepare(self, model: nn.Module, **_) -> None:
        return None

    def step(self, model: CausalLMWithLoss, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], *,
             lr: float, grad_clip: float, sync: GradientSync = GradientSync()) -> tuple[torch.Tensor, torch.Tensor]:
        return train_step(model, optimizer, micro_batches, lr=lr, grad_clip=grad_clip, sync=sync)

    def step_metrics(self) -> dict:
        return {}

    def evaluate(self, model: CausalLMWithLoss, held_out: list[Batch], *, device: torch.device) -> dict:
        """The mean loss over every held-out label, all ranks together (a collective)."""
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        one = torch.ones((), dtype=torch.int64, device=device)
        model.eval()
        with torch.no_grad():
            for batch in held_out:
                batch = batch.to(device)
                # divisor 1: the summed loss (a batch of ignored surplus samples adds nothing).
                total = model(batch.input_ids, batch.labels, batch.position_ids, divisor=one, **batch.attention())
                totals += torch.stack([total.double(), (batch.labels != IGNORE_INDEX).sum().double()])
        model.train()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        return {"eval_loss": (totals[0] / totals[1].clamp(min=1)).item()}

    def save(self, folder: Path, *, writer_rank: bool) -> None:
        return None

    def describe(self) -> dict:
        return {}

    def extra_flops_per_token(self, **_) -> float:
        return 0.0


def objective_for(cfg: TrainConfig) -> Objective:
    if cfg.objective == "dpo":
        from workloads.train.preference import PreferenceObjective

        return PreferenceObjective(cfg)
    return SupervisedObjective(cfg)
