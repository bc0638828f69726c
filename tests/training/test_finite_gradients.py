"""StopOnNonFiniteGradient: the first step whose gradient is not finite raises before the optimizer steps; the weights
and the checkpoints written before stay finite; a finite run is not changed."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_helpers import args, lm, lm_data  # noqa: E402

from hf_knorm.training.finite_gradients import NonFiniteGradientError, StopOnNonFiniteGradient  # noqa: E402


class PoisonLoss(tf.TrainerCallback):
    """Step ``step``'s logits are multiplied by ``value`` (NaN or inf): its loss and gradient, not the weights."""

    def __init__(self, step: int, value: float):
        self.step, self.value, self._hook = step, value, None
        self.weights_before = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            self.weights_before = {name: p.detach().clone() for name, p in model.named_parameters()}
            self._hook = model.lm_head.register_forward_hook(lambda module, inputs, output: output * self.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_gradient_stops_the_run_before_the_optimizer_step(tmp_path, value):
    model = lm("x/1")
    poison = PoisonLoss(step=3, value=value)
    trainer = tf.Trainer(model=model, args=args(tmp_path, save_strategy="steps", save_steps=2),
                         train_dataset=lm_data(), callbacks=[StopOnNonFiniteGradient(advice="do X"), poison])
    with pytest.raises(NonFiniteGradientError, match=r"step 3 \(of 6\).*first model\..*do X"):
        trainer.train()
    for name, parameter in model.named_parameters():  # the step was not taken
        assert torch.isfinite(parameter).all(), name
        assert torch.equal(parameter, poison.weights_before[name]), name
    saved = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-2")
    assert all(torch.isfinite(p).all() for p in saved.parameters())
    assert not (tmp_path / "checkpoint-4").exists()


def test_a_finite_run_is_unchanged_by_the_callback(tmp_path):
    plain, watched = lm("x/1"), lm("x/1")
    tf.Trainer(model=plain, args=args(tmp_path / "plain"), train_dataset=lm_data()).train()
    tf.Trainer(model=watched, args=args(tmp_path / "watched"), train_dataset=lm_data(),
               callbacks=[StopOnNonFiniteGradient()]).train()
    for (name, a), b in zip(plain.named_parameters(), watched.parameters()):
        assert torch.equal(a, b), name
