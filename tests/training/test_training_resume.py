"""Interrupt a run, resume it from its checkpoint: norms.jsonl has every logging step exactly once."""

from __future__ import annotations

import pytest
import transformers as tf
from training_helpers import args, history_lines, lm, lm_data

import hf_knorm


class Crash(tf.TrainerCallback):
    """Raises in the forward pass of optimizer step ``step`` (a logging step: the temporary patch is on)."""

    def __init__(self, step: int):
        self.step = step
        self._hook = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            self._hook = model.register_forward_pre_hook(self._raise)

    def _raise(self, module, inputs):
        self._hook.remove()
        raise KeyboardInterrupt("simulated interrupt")


def _args(out, **overrides):
    return args(out, max_steps=10, logging_steps=2, save_strategy="steps", save_steps=4, **overrides)


def test_interrupted_and_resumed_run_logs_every_step_once(tmp_path):
    reference = tf.Trainer(model=lm(), args=_args(tmp_path / "reference"), train_dataset=lm_data(),
                           callbacks=[hf_knorm.NormLoggerCallback()])
    reference.train()
    expected = history_lines(tmp_path / "reference" / "norms.jsonl")
    assert [line["step"] for line in expected] == [2, 4, 6, 8, 10]

    out = tmp_path / "run"
    model, callback = lm(), hf_knorm.NormLoggerCallback()
    trainer = tf.Trainer(model=model, args=_args(out), train_dataset=lm_data(), callbacks=[callback, Crash(8)])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [line["step"] for line in history_lines(out / "norms.jsonl")] == [2, 4, 6]
    assert hf_knorm.patched_normalization(model) == "softmax"  # interrupted inside a logging step (documented)

    # resume from checkpoint-4 with the same model object and callback: steps 6.. are logged again, once
    resumed = tf.Trainer(model=model, args=_args(out), train_dataset=lm_data(), callbacks=[callback])
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert hf_knorm.patched_normalization(model) is None  # the leftover temporary patch was undone
    lines = history_lines(out / "norms.jsonl")
    assert [line["step"] for line in lines] == [2, 4, 6, 8, 10]
    for got, want in zip(lines, expected):  # a resumed run continues exactly where the checkpoint left it
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        for got_layer, want_layer in zip(got["layers"], want["layers"]):
            assert got_layer == pytest.approx(want_layer, rel=1e-5)


def test_a_fresh_run_in_the_same_folder_starts_a_fresh_history(tmp_path):
    for _ in range(2):
        tf.Trainer(model=lm(), args=args(tmp_path, max_steps=4), train_dataset=lm_data(),
                   callbacks=[hf_knorm.NormLoggerCallback()]).train()
    assert [line["step"] for line in history_lines(tmp_path / "norms.jsonl")] == [2, 4]
