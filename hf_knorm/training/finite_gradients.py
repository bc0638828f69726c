"""StopOnNonFiniteGradient: a Trainer run stops, with a clear error, at the first step whose gradient is not finite.

The Trainer itself goes on: its gradient clipping multiplies every gradient by ``max_norm / nan``, the optimizer
writes NaN into every weight it steps, the logged loss is filtered (``logging_nan_inf_filter``) and the run ends
"successfully" with a model that computes nothing, and saves it. Measured here: an ``x^3/16`` conversion whose
gradient went NaN at recovery step ~125 trained on to step 150 and saved NaN weights (BENCHMARKS.md, "Conversion with
a softmax window").

The callback runs in ``on_pre_optimizer_step``: after the backward pass (and the clipping), before
``optimizer.step()``, so no weight takes the step, and the checkpoints already written stay as they were. Under
several processes every process checks its own gradients (its shard, under FSDP) and they agree through one
all-reduce of a flag, so all of them stop at the same step instead of some waiting for the others forever.
"""

from __future__ import annotations

import torch
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
        bad = [name for name, parameter in model.named_parameters()
               if parameter.grad is not None and not torch.isfinite(_local(parameter.grad)).all()]
        if not _any_process(bool(bad), model):
            return
        where = (f"{len(bad)} of this process's parameter tensors, first {bad[0]}" if bad
                 else "on another process")
        raise NonFiniteGradientError(
            f"Training step {state.global_step + 1} (of {state.max_steps}): the gradient is not finite ({where}). "
            f"Stopped before the optimizer step: no weight took it, and the checkpoints in {args.output_dir} are as "
            f"they were saved. To go on: {self.advice}.")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a (possibly distributed, FSDP2) tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _any_process(flag: bool, model: torch.nn.Module) -> bool:
    """Whether ``flag`` holds on any process (one all-reduce when several processes train)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return flag
    device = next(model.parameters()).device
    if torch.distributed.get_backend() == "gloo":
        device = torch.device("cpu")
    total = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(total)
    return bool(total.item() > 0)
