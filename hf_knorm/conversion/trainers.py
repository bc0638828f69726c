"""The Trainers of the two conversion stages; both evaluate held-out perplexity of the student as it stands.

- :class:`TransferTrainer` (stage 1): the training loss is the attention-transfer error
  (:class:`~hf_knorm.conversion.transfer.AttentionTransfer`); each logging step also logs the error of every layer
  (``transfer/layer_07/relative_error``). Evaluation runs the student alone, hooks off: the ordinary next-token loss.
- :class:`DistillationTrainer` (stage 2, recovery): next-token loss, plus ``distill_weight`` times the KL divergence
  from the original model's next-token distribution when a teacher model is given (Hinton et al., 2015; LoLCATs'
  recovery uses the next-token loss alone), or coarse-grained to its top-k tokens computed once before
  (:mod:`.teacher_logits`).

Why not TRL's distillation trainers (TRL 1.16): ``trl.DistillationTrainer`` (and ``trl.experimental``'s
``GKDTrainer``) train on-policy: the student generates completions to a ``prompt`` column and matches the teacher's
distribution on them under a generalized Jensen-Shannon divergence, with no next-token term. The recovery here is
off-policy (the training data's own tokens, every position that carries the loss: text blocks, or the replies of
conversations), next-token loss plus ``KL(teacher || student)``; a converted student that does not yet work would
also generate poor completions, and generation on this CPU costs more than the training step. Not the same loss, so
the project keeps its trainer (its KL scaled exactly as the Trainer scales the next-token loss, the teacher moved
to the run's device).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..data.heldout import PerplexityTrainer
from .teacher_logits import TeacherTopK, top_k_kl
from .transfer import AttentionTransfer


class TransferTrainer(PerplexityTrainer):
    """A Trainer whose training loss is the attention-transfer error of ``transfer``.

    Args:
        transfer: the teachers and hooks, built on the model before it was patched.
        **kwargs: ``Trainer`` arguments.
    """

    def __init__(self, *args, transfer: AttentionTransfer, **kwargs):
        super().__init__(*args, **kwargs)
        self.transfer = transfer.to(self.args.device)  # the Trainer moves ``model`` alone
        self._layer_errors: list[float] | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:  # evaluation: the student's own next-token loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self.transfer.teaching():
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                            use_cache=False, logits_to_keep=1)  # the logits are not needed: one position only
            loss = self.transfer.loss()
        if num_items_in_batch is not None and self.model_accepts_loss_kwargs:
            # The Trainer then takes the loss as normalized over the whole accumulated batch and does not divide it
            # by the accumulation steps itself; the transfer error is a mean over this micro-batch: divide here
            loss = loss / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        self._layer_errors = [float(error.detach()) for _, error in sorted(self.transfer.layer_errors.items())]
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._layer_errors is not None:
            width = max(2, len(str(len(self._layer_errors) - 1)))
            logs.update({f"transfer/layer_{index:0{width}d}/relative_error": error
                         for index, error in enumerate(self._layer_errors)})
        super().log(logs, *args, **kwargs)


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor | None = None,
                    reduction: str = "mean") -> torch.Tensor:
    """``KL(teacher || student)`` of the next-token distributions (in fp32), over the positions the next-token loss
    scores.

    Args:
        student_logits, teacher_logits: ``(B, N, V)``.
        labels: ``(B, N)`` the next-token labels (``-100``: not scored); position ``t`` is counted when label
            ``t + 1`` is scored, as the shifted next-token loss counts it. ``None``: every position.
        reduction: ``mean`` (per counted position) or ``sum``.

    Returns:
        A scalar: the sum over the vocabulary, then the mean (or sum) over the counted positions.
    """
    student = F.log_softmax(student_logits.float(), dim=-1)
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    per_position = (teacher.exp() * (teacher - student)).sum(-1)  # (B, N)
    if labels is not None:
        per_position = per_position[:, :-1][labels[:, 1:] != -100]
    return per_position.sum() if reduction == "sum" else per_position.mean()


class DistillationTrainer(PerplexityTrainer):
    """``next_token_weight`` times the next-token loss plus ``distill_weight * KL(teacher || student)`` per token
    (``teacher=None`` and ``teacher_top_k=None``: no KL term).

    Args:
        teacher: the original model (frozen, same tokenizer), or ``None``.
        teacher_top_k: the teacher's top-k distributions of the training examples, computed before
            (:mod:`.teacher_logits`): the KL coarse-grained to them, no teacher forward per step; instead of
            ``teacher``.
        distill_weight: the weight of the KL term.
        next_token_weight: the weight of the next-token loss (0: the KL alone).
        non_attention_lr_scale: the learning rate of every weight outside the attention modules, as a fraction of
            the learning rate (the attention is what the conversion changed; the rest keeps what it knows).
        **kwargs: ``Trainer`` arguments.
    """

    def __init__(self, *args, teacher: torch.nn.Module | None = None, distill_weight: float = 0.0,
                 next_token_weight: float = 1.0, non_attention_lr_scale: float = 1.0,
                 teacher_top_k: TeacherTopK | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if non_attention_lr_scale <= 0:
            raise ValueError(f"non_attention_lr_scale must be > 0, not {non_attention_lr_scale}.")
        self.non_attention_lr_scale = non_attention_lr_scale
        if distill_weight < 0 or next_token_weight < 0:
            raise ValueError(f"distill_weight and next_token_weight must be >= 0, not {distill_weight} and "
                             f"{next_token_weight}.")
        if next_token_weight == 0 and distill_weight == 0:
            raise ValueError("next_token_weight 0 and distill_weight 0 leave no loss to train on.")
        if teacher is not None and teacher_top_k is not None:
            raise ValueError("Pass the teacher or its top-k cache, not both.")
        if distill_weight > 0 and teacher is None and teacher_top_k is None:
            raise ValueError("distill_weight > 0 needs the original model as teacher (or its top-k cache).")
        self.teacher_top_k = teacher_top_k if distill_weight > 0 else None
        # The Trainer moves ``model`` alone: the teacher goes to the same device here.
        self.teacher = teacher.eval().to(self.args.device) if teacher is not None and distill_weight > 0 else None
        self.distill_weight = distill_weight
        self.next_token_weight = next_token_weight

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if model.training:
            loss = self.next_token_weight * loss
        if self.teacher is not None and model.training:
            with torch.no_grad():
                target = self.teacher(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                                      use_cache=False).logits  # (B, N, V)
            loss = loss + self.distill_weight * self._kl_scaled_like_the_loss(
                lambda reduction: distillation_kl(outputs.logits, target, inputs.get("labels"), reduction),
                num_items_in_batch)
        if self.teacher_top_k is not None and model.training:
            target = self.teacher_top_k.batch(inputs["input_ids"], inputs.get("attention_mask"))
            loss = loss + self.distill_weight * self._kl_scaled_like_the_loss(
                lambda reduction: top_k_kl(outputs.logits, *target, inputs.get("labels"), reduction),
                num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, each parameter group split in two: the attention modules' weights at the group's
        rate, the others at ``non_attention_lr_scale`` times it (the schedule then scales both alike)."""
        optimizer = super().create_optimizer(model)
        if self.non_attention_lr_scale == 1.0:
            return optimizer
        from ..models.architectures import attention_modules

        inside = {id(p) for _, module in attention_modules(self.model) for p in module.parameters()}
        groups = []
        for group in optimizer.param_groups:
            settings = {key: value for key, value in group.items() if key != "params"}
            attention = [p for p in group["params"] if id(p) in inside]
            other = [p for p in group["params"] if id(p) not in inside]
            groups += [{**settings, "params": attention}] if attention else []
            groups += [{**settings, "params": other, "lr": group["lr"] * self.non_attention_lr_scale}] if other else []
        optimizer.param_groups.clear()  # a new optimizer: no state yet
        for group in groups:
            optimizer.add_param_group(group)
        return optimizer

    def _kl_scaled_like_the_loss(self, kl: Callable[[str], torch.Tensor], num_items_in_batch):
        """The KL per scored token (``kl(reduction)``, ``mean`` or ``sum`` over the scored positions), normalized
        exactly as ``Trainer.compute_loss`` normalizes the next-token loss.

        With gradient accumulation or several processes the Trainer divides the next-token loss's sum by the scored
        tokens of the whole accumulated, global batch (``num_items_in_batch``) and multiplies it by the number of
        processes (``average_tokens_across_devices``); without ``num_items_in_batch`` each micro-batch takes its
        mean and ``training_step`` divides by the accumulation steps. The KL follows the same rule, so its weight
        does not change with the batch layout.
        """
        if num_items_in_batch is None or not self.model_accepts_loss_kwargs:
            return kl("mean")
        kl = kl("sum") / num_items_in_batch
        if self.args.average_tokens_across_devices:
            kl = kl * self.accelerator.num_processes
        return kl
