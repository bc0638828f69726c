"""``hf-knorm convert --window-dropout``: the flags checked before anything runs, and a tiny conversion whose LoRA
recovery runs every step without the window (p = 1), logs the rate, and leaves no switch behind."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_conversion import _settings, texts, tiny_lm_dir  # noqa: E402,F401

import hf_knorm  # noqa: E402
from hf_knorm.attention.window_off import WINDOW_DROPPED  # noqa: E402
from hf_knorm.conversion.settings import ConvertSettings  # noqa: E402
from hf_knorm.jobs.convert import check_settings, run_convert  # noqa: E402
from hf_knorm.models.architectures import attention_modules  # noqa: E402


def test_window_dropout_is_off_by_default():
    assert ConvertSettings().window_dropout == 0.0 and ConvertSettings().window_dropout_schedule == "linear"


@pytest.mark.parametrize("overrides, message", [
    (dict(window_dropout=1.5), r"in \[0, 1\]"),
    (dict(window_dropout=-0.5), r"in \[0, 1\]"),
    (dict(window_dropout=0.5, window_dropout_schedule="cosine"), "linear, constant"),
    (dict(window_dropout=0.5, softmax_window=0), "--softmax-window W > 0"),
    (dict(window_dropout=0.5, recovery="none"), "applies in the recovery"),
])
def test_bad_window_dropout_settings_are_refused_before_anything_runs(tiny_lm_dir, texts, tmp_path, overrides,
                                                                      message):
    settings = _settings(tiny_lm_dir, texts, tmp_path / "run", **dict(dict(softmax_window=4), **overrides))
    with pytest.raises(ValueError, match=message):
        check_settings(settings)
    assert not (tmp_path / "run").exists()


def test_a_conversion_recovers_without_the_window_on_every_step_at_probability_one(tiny_lm_dir, texts, tmp_path):
    out = tmp_path / "run"
    settings = _settings(tiny_lm_dir, texts, out, softmax_window=4, attention_sinks=1, window_dropout=1.0,
                         window_dropout_schedule="constant", beyond_window=False, recovery="lora")
    run_convert(settings)
    [checkpoint] = (out / "recovery").glob("checkpoint-*")
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    logged = [entry for entry in history if "loss" in entry]
    assert len(logged) == 2  # 4 steps, logging every 2
    assert all(entry["window_dropout/probability"] == 1.0 and entry["window_dropout/dropped"] == 1.0
               for entry in logged)
    transfer = json.loads(next((out / "transfer").glob("checkpoint-*/trainer_state.json")).read_text())
    assert not any("window_dropout/probability" in entry for entry in transfer["log_history"])  # recovery only
    converted = hf_knorm.from_pretrained(out)
    assert not any(hasattr(module, WINDOW_DROPPED) for _, module in attention_modules(converted))
    record = json.loads((out / "convert.json").read_text())
    assert record["settings"]["window_dropout"] == 1.0
    assert record["stages"]["recovery"]["window_dropout"] == {"probability": 1.0, "schedule": "constant",
                                                              "dropped_steps": [0, 1, 2, 3]}
    assert "window_dropout" not in record["stages"]["transfer"]


def _interrupted_at_recovery_step(monkeypatch, step: int):
    """Make the recovery's ``step``-th training step (1-based) raise ``KeyboardInterrupt``."""
    from hf_knorm.conversion import trainers

    calls, original_step = {"n": 0}, trainers.DistillationTrainer.training_step

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == step:
            raise KeyboardInterrupt
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(trainers.DistillationTrainer, "training_step", interrupted)
    return lambda: monkeypatch.setattr(trainers.DistillationTrainer, "training_step", original_step)


def converted_after_a_break(monkeypatch, settings: ConvertSettings) -> None:
    """``run_convert(settings)`` interrupted at the recovery's 5th step (after the checkpoint of step 4), then run
    again with ``resume``."""
    restore = _interrupted_at_recovery_step(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        run_convert(settings)
    restore()
    run_convert(dataclasses.replace(settings, resume=True))


def test_lora_recovery_with_window_dropout_trains_the_mix_and_a_resumed_run_continues_it(tiny_lm_dir, texts, tmp_path,
                                                                                      monkeypatch):
    """A dropped step is the base family times the mix: with the mix frozen (LoRA freezes the base model) it would
    give no output and no gradient. With window dropout the recovery trains the mix, checkpoints it beside the
    adapters (PEFT saves the adapters alone) and a resumed run reads it back: the same mix as without the break."""
    import torch

    from hf_knorm.conversion.learned_values import FILE
    from hf_knorm.models.window_mix import window_mixes

    def mixes(out):
        return torch.tensor(window_mixes(hf_knorm.from_pretrained(out)))

    common = dict(softmax_window=4, attention_sinks=1, window_dropout=1.0, window_dropout_schedule="constant",
                  beyond_window=False, recovery="lora", recovery_steps=6, teacher_top_k=0)
    whole = tmp_path / "whole"
    record = run_convert(_settings(tiny_lm_dir, texts, whole, **common))
    transferred = torch.tensor(record["stages"]["transfer"]["window_mix"])
    assert (mixes(whole) - transferred).abs().max() > 1e-3  # the recovery moved the mix
    assert (whole / "recovery" / "checkpoint-6" / FILE).is_file()

    broken = tmp_path / "broken"
    converted_after_a_break(monkeypatch, _settings(tiny_lm_dir, texts, broken, **common))
    torch.testing.assert_close(mixes(broken), mixes(whole), rtol=1e-4, atol=1e-6)

    unchanged = tmp_path / "no_dropout"  # without window dropout LoRA trains its adapters alone, as documented
    record = run_convert(_settings(tiny_lm_dir, texts, unchanged, **dict(common, window_dropout=0.0)))
    torch.testing.assert_close(mixes(unchanged), torch.tensor(record["stages"]["transfer"]["window_mix"]))
    assert not list((unchanged / "recovery").glob(f"checkpoint-*/{FILE}"))


def test_a_checkpoint_without_the_learned_values_is_refused_with_the_reason(tmp_path):
    from hf_knorm.conversion.learned_values import restore_learned_values
    from tiny_models import tiny_model

    model = hf_knorm.patch(tiny_model("llama"), "x/1", softmax_window=4)
    with pytest.raises(FileNotFoundError, match="saved without the learned values"):
        restore_learned_values(model, tmp_path)
