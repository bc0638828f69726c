"""NormLoggerCallback on a real Trainer: where the norms go, what they are, and what happens around them."""

from __future__ import annotations

import glob
import math

import pytest
import torch
import transformers as tf
from training_helpers import (
    CaptureStep, args, direct_statistics, history_lines, lm, lm_data, vit, vit_data,
)

import hf_knorm
from hf_knorm.recording.per_step import STATISTICS


def _train(model, data, out, callbacks, **overrides):
    trainer = tf.Trainer(model=model, args=args(out, **overrides), train_dataset=data, callbacks=callbacks)
    trainer.train()
    return trainer


def _norm_entries(trainer):
    return [entry for entry in trainer.state.log_history if "norms/layer_00/attn_fro" in entry]


@pytest.mark.compat
def test_norms_reach_log_history_tensorboard_and_the_history_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = lm()  # not patched: read through hf_knorm's softmax on logging steps only
    callback = hf_knorm.NormLoggerCallback()
    trainer = _train(model, lm_data(), tmp_path, [callback], report_to=["tensorboard"], logging_first_step=True)

    expected_keys = {f"norms/layer_{layer:02d}/{name}" for layer in range(2) for name in STATISTICS}
    entries = _norm_entries(trainer)
    assert [entry["step"] for entry in entries] == [1, 2, 4, 6]
    for entry in entries:
        assert expected_keys <= set(entry)
        assert "loss" in entry
    assert callback.reaches_integrations

    events = glob.glob(str(tmp_path / "runs" / "*" / "events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(events[0])
    accumulator.Reload()
    for key in ("norms/layer_00/attn_fro", "norms/layer_01/kv_ratio"):
        scalars = accumulator.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [1, 2, 4, 6]
        assert [s.value for s in scalars] == pytest.approx([entry[key] for entry in entries], rel=1e-6)

    lines = history_lines(tmp_path / "norms.jsonl")  # one strict-JSON line per logging step
    assert [line["step"] for line in lines] == [1, 2, 4, 6]
    assert all(line["normalization"] == "softmax" and len(line["layers"]) == 2 for line in lines)
    assert lines[-1]["layers"][1]["attn_fro"] == pytest.approx(entries[-1]["norms/layer_01/attn_fro"])
    assert lines[-1]["loss"] == pytest.approx(entries[-1]["loss"])
    # the temporary softmax patch is gone; softmax norms obey ||A||_F <= sqrt(N)
    assert hf_knorm.patched_normalization(model) is None and model.config._attn_implementation == "sdpa"
    assert all(0 < entry["norms/layer_00/attn_fro_sqrtn_max"] <= 1 for entry in entries)


def test_norms_stay_off_the_console_unless_asked(tmp_path, capsys):
    _train(lm(), lm_data(), tmp_path / "quiet", [hf_knorm.NormLoggerCallback()], max_steps=2)
    quiet = capsys.readouterr().out
    _train(lm(), lm_data(), tmp_path / "loud", [hf_knorm.NormLoggerCallback(console=True)], max_steps=2)
    loud = capsys.readouterr().out
    assert "'loss'" in quiet and "norms/" not in quiet
    assert "norms/layer_01/attn_fro" in loud


# (model, data, normalization, gradient accumulation, layers compared): with attention dropout only layer 0 sees
# the same inputs in training as in the eval-mode recomputation; its matrix norms are taken before dropout.
CASES = {
    "llama-softmax-unpatched": (lm, lm_data, None, 1, 2),
    "llama-x3-16-accumulate2": (lm, lm_data, "x^3/16", 2, 2),
    "llama-x3-16-attention-dropout": (lambda n: lm(n, attention_dropout=0.5), lm_data, "x^3/16", 1, 1),
    "vit-softmax-unpatched": (vit, vit_data, None, 1, 2),
    "vit-x-16": (vit, vit_data, "x/16", 1, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logged_values_equal_a_direct_computation_on_the_same_batch(tmp_path, case):
    make_model, make_data, normalization, accumulation, compared = CASES[case]
    capture = CaptureStep(step=4)
    trainer = _train(make_model(normalization), make_data(), tmp_path, [hf_knorm.NormLoggerCallback(), capture],
                     max_steps=4, gradient_accumulation_steps=accumulation, per_device_train_batch_size=2)
    assert len(capture.batches) == accumulation  # every micro-batch of the logging step counts
    expected = direct_statistics(make_model(normalization), capture.state_dict, capture.batches)  # eval: no dropout
    logged = _norm_entries(trainer)[-1]
    assert logged["step"] == 4
    for layer, stats in enumerate(expected[:compared]):
        for name in STATISTICS:
            assert logged[f"norms/layer_{layer:02d}/{name}"] == pytest.approx(stats[name], rel=1e-5), (layer, name)


def test_polynomial_norms_differ_from_softmax(tmp_path):
    """Sanity of the comparison above: the statistics tell normalizations apart on the same weights and data."""
    values = {}
    for normalization in ("softmax", "x^3/16"):
        trainer = _train(lm(normalization), lm_data(), tmp_path / normalization.replace("/", "-"),
                         [hf_knorm.NormLoggerCallback()], max_steps=2)
        values[normalization] = _norm_entries(trainer)[0]["norms/layer_00/attn_fro"]
    assert values["softmax"] != pytest.approx(values["x^3/16"], rel=1e-2)


def test_reading_an_unpatched_model_leaves_its_training_unchanged(tmp_path):
    # SGD: Adam would amplify fp32 rounding differences on weights whose gradient is ~0
    plain = _train(lm(), lm_data(), tmp_path / "plain", [], logging_steps=1, max_steps=4, optim="sgd",
                   learning_rate=0.1)
    logged = _train(lm(), lm_data(), tmp_path / "logged", [hf_knorm.NormLoggerCallback()], logging_steps=1,
                    max_steps=4, optim="sgd", learning_rate=0.1)
    losses = [entry["loss"] for entry in plain.state.log_history if "loss" in entry]
    assert [entry["loss"] for entry in _norm_entries(logged)] == pytest.approx(losses, rel=1e-5)
    for a, b in zip(plain.model.parameters(), logged.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_does_not_count_a_forward_twice(tmp_path, monkeypatch, reentrant):
    from hf_knorm.recording.per_step import StepNormRecorder

    counted = []  # attention matrices per layer that each logging step summed
    finish = StepNormRecorder.finish

    def spy(self):
        counted.append(self._sums[:, 2].tolist())
        return finish(self)

    monkeypatch.setattr(StepNormRecorder, "finish", spy)
    model = lm("x^3/16")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    _train(model, lm_data(), tmp_path, [hf_knorm.NormLoggerCallback()], max_steps=2)
    assert counted == [[4 * 4, 4 * 4]]  # batch 4 x 4 heads, once per layer: not again in the backward recompute


def test_own_interval_when_the_trainer_does_not_log_by_steps(tmp_path):
    with pytest.raises(ValueError, match="every=N"):
        _train(lm(), lm_data(), tmp_path / "epoch", [hf_knorm.NormLoggerCallback()], logging_strategy="epoch")
    trainer = _train(lm(), lm_data(), tmp_path / "own", [hf_knorm.NormLoggerCallback(every=3)],
                     logging_strategy="no")
    assert [entry["step"] for entry in _norm_entries(trainer)] == [3, 6]


def test_unsupported_architecture_fails_when_training_starts(tmp_path):
    config = tf.GPTNeoConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                             attention_types=[[["global"], 2]])
    model = tf.GPTNeoForCausalLM(config)
    trainer = tf.Trainer(model=model, args=args(tmp_path), train_dataset=lm_data(),
                         callbacks=[hf_knorm.NormLoggerCallback()])
    with pytest.raises(ValueError, match="NormLoggerCallback cannot read.*gpt_neo.*Supported"):
        trainer.train()
    assert trainer.state.global_step == 0 and not (tmp_path / "norms.jsonl").exists()


def _poison_values(model, layer: int):
    """NaN in one layer's value projection: that layer's values (and everything after it) are NaN."""
    with torch.no_grad():
        model.model.layers[layer].self_attn.v_proj.weight[0, 0] = math.nan


def test_nonfinite_norms_are_logged_as_data(tmp_path, caplog):
    model = lm("x/1")
    _poison_values(model, 1)
    callback = hf_knorm.NormLoggerCallback()
    trainer = _train(model, lm_data(), tmp_path, [callback], logging_steps=1, max_steps=3)
    assert trainer.state.global_step == 3  # not stopped: divergence is data
    assert callback.first_nonfinite == (1, "layer_01/value_norm")
    assert "first non-finite attention statistic at step 1: layer_01/value_norm" in caplog.text
    first = _norm_entries(trainer)[0]
    assert math.isfinite(first["norms/layer_01/attn_fro"])  # weights come from q and k, still finite
    assert math.isnan(first["norms/layer_01/value_norm"])
    lines = history_lines(tmp_path / "norms.jsonl")  # strict JSON: NaN is written as a string
    assert lines[0]["layers"][1]["value_norm"] == "nan"
    assert lines[0]["nonfinite"] == ["layer_01/value_norm", "layer_01/kv_ratio"]
    assert math.isnan(hf_knorm.training.history.read_norm_history(tmp_path)[0]["layers"][1]["value_norm"])


def test_stop_on_nonfinite_loss(tmp_path):
    model = lm("x/1")
    callback = hf_knorm.NormLoggerCallback(stop_on_nonfinite_loss=True)
    capture = CaptureStep(step=3)

    class Poison(tf.TrainerCallback):  # the loss goes NaN at step 3
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                _poison_values(model, 0)

    trainer = _train(model, lm_data(), tmp_path, [callback, Poison(), capture], max_steps=6)
    assert callback.stopped_at_step == 3 and trainer.state.global_step == 3


def test_a_resumed_runs_repeated_evaluation_is_one_point_of_the_curve():
    from hf_knorm.data.heldout import perplexity_curve

    history = [{"step": 0, "eval_perplexity": 90.0}, {"step": 50, "eval_perplexity": 40.0, "loss": 3.0},
               {"step": 50, "eval_perplexity": 40.5}, {"step": 100, "eval_perplexity": 30.0}]
    assert perplexity_curve(history, tokens_per_step=10) == [[0, 0, 90.0], [50, 500, 40.5], [100, 1000, 30.0]]
