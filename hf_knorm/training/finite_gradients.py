"""StopOnNonFiniteGradient: a Trainer run stops, with a clear error, at the first step whose gradient is not finite.

The Trainer itself goes on: its gradient clipping multiplies every gradient by ``max_norm / nan``, the optimizer
writes NaN into every weight it steps, the logged loss is filtered (``logging_nan_inf_filter``) and the run ends
"successfully" with a model that computes nothing, and saves it. Measured here: an ``x^3/16`` conversion whose
gradient went NaN at recovery step ~125 trained on to step 150 and saved NaN weights
(docs/research/2026-12-conversion.md, "Conversion with a softmax window").

The callback runs in ``on_pre_optimizer_step``: after the backward pass (and the clipping), before
``optimizer.step()``, so no weight takes the step, and the checkpoints already written stay as they were. Under
several processes every process checks its own gradients (its shard, under FSDP) and they agree through one
all-reduce of a flag, so all of them stop at the same step instead of some waiting for the others forever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers


class NonFiniteGradientError(FloatingPointError):
    """A training step's gradient holds NaN or infinity; raised before the optimizer takes the step."""


class StopOnNonFiniteGradient(transformers.TrainerCallback):
    """Raises :class:`NonFiniteGradientError` at the first optimizer step whose gradient is not finite.

    Args:
        advice: what the user can do, appended to the error (a job names its own flags: "lower
            --recovery-learning-rate"); default: generic advice.
    """

    def __init__(self, advice: str = "lower the learning rate or the gradient clipping (max_grad_norm), or train "
                                     "in fp32, and start again from the last checkpoint or from the start"):
        self.advice = advice

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        grads = [(name, _local(parameter.grad)) for name, parameter in model.named_parameters()
                 if parameter.grad is not None]
        device = grads[0][1].device if grads else torch.device("cpu")
        finite = (torch.stack([torch.isfinite(grad).all().to(device) for _, grad in grads]).all() if grads
                  else torch.ones((), dtype=torch.bool, device=device))  # on the device: one host sync below
        if finite_on_every_process(finite):
            return
        bad = [name for name, grad in grads if not torch.isfinite(grad).all()]
        where = (f"{len(bad)} of this process's {len(grads)} gradient tensors, first {bad[0]}" if bad
                 else "on another process")
        raise NonFiniteGradientError(
            f"Training step {state.global_step + 1} (of {state.max_steps}): the gradient is not finite ({where}). "
            f"Stopped before the optimizer step: no weight took it, and the checkpoints in {args.output_dir} are as "
            f"they were saved. To go on: {self.advice}.")


def finite_on_every_process(finite: torch.Tensor) -> bool:
    """Whether a flag computed on the device (a 0-d bool tensor) holds on every process: one all-reduce (``MIN``)
    when several processes train, then one host synchronization."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = finite.to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        finite = flag[0]
    return bool(finite)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a (possibly distributed, FSDP2) tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
