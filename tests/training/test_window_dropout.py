"""Window dropout (``training/window_dropout.py``): the schedule, the deterministic draws, a real ``Trainer`` with the
callback (off: bit for bit the run without it; at 1: every training forward without the window, no evaluation
forward), and the logged rate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_helpers import args, lm, lm_data  # noqa: E402

from hf_knorm.attention.window_off import WINDOW_DROPPED, window_is_dropped  # noqa: E402
from hf_knorm.models.architectures import attention_modules  # noqa: E402
from hf_knorm.training.window_dropout import (WindowDropoutCallback, window_dropout_probability,  # noqa: E402
                                              window_dropout_steps, window_dropped_at)

WINDOWED = "x^3/16 + softmax window 4 + sinks 2"


def test_the_schedules_at_given_steps():
    assert [window_dropout_probability(0.5, "linear", t, 4) for t in range(5)] == [0.5, 0.375, 0.25, 0.125, 0.0]
    assert [window_dropout_probability(0.5, "constant", t, 4) for t in range(5)] == [0.5] * 5
    assert window_dropout_probability(0.0, "linear", 0, 10) == 0.0


@pytest.mark.parametrize("probability, schedule, message", [
    (1.5, "linear", r"in \[0, 1\]"), (-0.1, "constant", r"in \[0, 1\]"), (float("nan"), "linear", r"in \[0, 1\]"),
    (True, "linear", r"in \[0, 1\]"), ("0.5", "linear", r"in \[0, 1\]"), (0.5, "cosine", "linear, constant")])
def test_bad_settings_raise(probability, schedule, message):
    with pytest.raises(ValueError, match=message):
        WindowDropoutCallback(probability, schedule)


def test_the_draws_depend_on_the_seed_and_the_step_alone():
    state = torch.random.get_rng_state()
    first = [window_dropped_at(0, step, 0.3) for step in range(2000)]
    assert torch.equal(state, torch.random.get_rng_state())  # the global random state is not touched
    torch.manual_seed(123)
    assert [window_dropped_at(0, step, 0.3) for step in range(2000)] == first
    assert [window_dropped_at(1, step, 0.3) for step in range(2000)] != first
    assert 0.27 < sum(first) / len(first) < 0.33  # 2,000 draws at 0.3: 3.4 standard deviations either side
    assert not any(window_dropped_at(0, step, 0.0) for step in range(200))
    assert all(window_dropped_at(0, step, 1.0) for step in range(200))


class _Watch(tf.TrainerCallback):
    """Records, for every forward of the first attention module, whether it trained and ran without its window."""

    def __init__(self):
        self.forwards: list[tuple[bool, bool]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        module = attention_modules(model)[0][1]
        module.register_forward_pre_hook(lambda m, *_: self.forwards.append((m.training, window_is_dropped(m))))


def _train(tmp_path, callbacks, steps=4, **overrides):
    model = lm(WINDOWED)
    data = lm_data(count=16, length=12)
    trainer = tf.Trainer(model=model, args=args(tmp_path, max_steps=steps, **overrides), train_dataset=data,
                         eval_dataset=data[:4], callbacks=callbacks)
    trainer.train()
    return trainer, model


def test_at_probability_zero_the_training_is_bit_for_bit_the_run_without_the_callback(tmp_path):
    plain, plain_model = _train(tmp_path / "plain", [])
    dropout = WindowDropoutCallback(0.0, "constant")
    off, off_model = _train(tmp_path / "off", [dropout])
    losses = lambda trainer: [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]  # noqa: E731
    assert losses(plain) == losses(off) and len(losses(plain)) == 2
    for (name, weight), (_, other) in zip(plain_model.named_parameters(), off_model.named_parameters()):
        assert torch.equal(weight, other), name
    assert dropout.dropped_steps == []
    assert [entry["window_dropout/dropped"] for entry in off.state.log_history if "loss" in entry] == [0.0, 0.0]


def test_at_probability_one_every_training_forward_runs_without_the_window_and_no_evaluation(tmp_path):
    watch = _Watch()
    dropout = WindowDropoutCallback(1.0, "constant")
    trainer, model = _train(tmp_path, [dropout, watch], gradient_accumulation_steps=2, eval_strategy="steps",
                            eval_steps=1)
    training = [dropped for trains, dropped in watch.forwards if trains]
    evaluating = [dropped for trains, dropped in watch.forwards if not trains]
    assert len(training) == 8 and all(training)  # 4 steps x 2 micro-batches
    assert len(evaluating) >= 4 and not any(evaluating)
    assert dropout.dropped_steps == [0, 1, 2, 3]
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [(entry["window_dropout/probability"], entry["window_dropout/dropped"]) for entry in logged] == [(1.0, 1.0)] * 2
    assert dropout.reaches_integrations  # placed before the report_to integrations
    assert not any(hasattr(module, WINDOW_DROPPED) for _, module in attention_modules(model))  # switched off after
    plain, _ = _train(tmp_path / "plain", [], gradient_accumulation_steps=2)
    first = lambda t: next(e["loss"] for e in t.state.log_history if "loss" in e)  # noqa: E731
    assert first(plain) != first(trainer)  # the switch reached the training forwards


def test_the_linear_schedule_draws_the_same_steps_in_every_run_and_logs_its_rate(tmp_path):
    runs = []
    for name in ("a", "b"):
        dropout = WindowDropoutCallback(0.9, "linear")
        trainer, _ = _train(tmp_path / name, [dropout], steps=8, seed=3)
        runs.append(dropout.dropped_steps)
    expected = [t for t in range(8) if window_dropped_at(3, t, 0.9 * (1 - t / 8))]
    assert window_dropout_steps(0.9, "linear", 3, 8) == expected
    assert runs[0] == runs[1] == expected and 0 < len(expected) < 8  # seed 3: some steps each way
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]  # logging every 2 steps
    assert [entry["window_dropout/probability"] for entry in logged] == pytest.approx(
        [0.9 * (1 - t / 8) for t in (1, 3, 5, 7)])
    assert [entry["window_dropout/dropped"] for entry in logged] == [
        sum(t in expected for t in (2 * i, 2 * i + 1)) / 2 for i in range(4)]


def test_a_model_without_a_window_is_refused(tmp_path):
    model = lm("x^3/16")
    trainer = tf.Trainer(model=model, args=args(tmp_path, max_steps=1), train_dataset=lm_data(count=4),
                         callbacks=[WindowDropoutCallback(0.5)])
    with pytest.raises(ValueError, match="softmax_window"):
        trainer.train()


def test_the_norms_are_logged_on_a_step_without_the_window(tmp_path):
    """NormLoggerCallback records through the dropped layer (its norms from the base family's scaled weights)."""
    from hf_knorm import NormLoggerCallback

    logged = []
    for probability in (1.0, 0.0):
        trainer, _ = _train(tmp_path / str(probability), [NormLoggerCallback(history_file=None),
                                                          WindowDropoutCallback(probability, "constant")], steps=2)
        [entry] = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert entry["window_dropout/dropped"] == probability
        logged.append({key: value for key, value in entry.items() if key.startswith("norms/")
                       and key.endswith("attn_fro")})
    dropped, windowed = logged
    assert len(dropped) == 2 and all(0 < value < float("inf") for value in dropped.values())
    assert all(abs(dropped[key] - windowed[key]) > 1e-3 * windowed[key] for key in dropped)  # another layer ran
