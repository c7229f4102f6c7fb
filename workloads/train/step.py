"""One optimizer step over a rank's micro-batches: one loss for the whole step, however it is split.

The step's loss is the sum of the per-token losses over every label of every micro-batch on every
rank, divided by the step's label count (counted on the host side of the data before the first
forward, then one all-reduce). So a step is exactly one batch holding all its rows, whether they
run as one micro-batch on one rank or as K micro-batches on R ranks of flat FSDP or HSDP, and rows
with few labels (short answers) weigh what their tokens weigh, not what a whole row weighs.

Each micro-batch's backward starts from its own sum divided by that global count, times the
world size: FSDP2 averages gradients over the data-parallel ranks (it divides their sum by the
world size, under HSDP over both mesh dimensions), and the factor cancels that division, so the
reduced gradient is the gradient of the step's loss. The value returned is this rank's share of
the loss, times the world size as well, so the mean over ranks (what the loop logs) is the step's
per-token mean loss, the quantity the eval loss reports too.

The count enters the model's forward as an integer tensor and the world size is applied outside
it: with mixed precision, FSDP2 casts the root's floating-point forward inputs to bf16
(`MixedPrecisionPolicy.cast_forward_inputs`), which would round a count such as 257 to 256 and
scale the step's loss and gradient by up to 0.4%. The loss implementations return their sum in
fp32 (liger-kernel's too: per-token fp32 losses summed in fp32), so the division is fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workloads.train.data import Batch
from workloads.train.loss import IGNORE_INDEX
from workloads.train.model import CausalLMWithLoss
from workloads.train.optim import clip_grad_norm, set_lr
from workloads.train.parallel import GradientSync


def step_label_count(micro_batches: list[Batch]) -> torch.Tensor:
    """Labels in the whole step, all ranks together (a collective), at least 1."""
    count = sum((batch.labels != IGNORE_INDEX).sum() for batch in micro_batches)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return count.clamp(min=1)


def accumulate_gradients(
    model: CausalLMWithLoss, micro_batches: list[Batch], *, sync: GradientSync
) -> torch.Tensor:
    """Forward and backward of each micro-batch, gradients summed into those of the step's loss;
    returns this rank's share of the step's loss times the world size (a device tensor)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    count = step_label_count(micro_batches)  # int64: no mixed-precision cast rounds it
    loss = torch.zeros((), device=micro_batches[0].input_ids.device)
    for i, batch in enumerate(micro_batches):
        micro_loss = model(batch.input_ids, batch.labels, batch.position_ids, divisor=count,
                           **batch.attention()) * world
        # After the forward: FSDP2 sets each unit's reduce dtype at its first forward.
        sync.before_backward(model, last=i == len(micro_batches) - 1)
        micro_loss.backward()
        loss += micro_loss.detach()
    return loss


def train_step(
    model: CausalLMWithLoss,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[Batch],
    *,
    lr: float,
    grad_clip: float,
    sync: GradientSync = GradientSync(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over the micro-batches; returns (this rank's loss share times the world
    size, grad norm) as device tensors, not yet read back."""
    set_lr(optimizer, lr)
    loss = accumulate_gradients(model, micro_batches, sync=sync)
    grad_norm = clip_grad_norm(model, max_norm=grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm.detach()
