"""The conversion's settings that depend on the normalization or scale its time: the recovery rate's default by the
normalization's power, and ``--budget`` (the recovery's length as a multiple of ``--recovery-steps``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_helpers import save_tiny_lm  # noqa: E402

from hf_knorm.assets.texts import SAMPLE_TEXT  # noqa: E402
from hf_knorm.jobs.convert import RESULT_FILE, check_settings, run_convert  # noqa: E402
from hf_knorm.conversion.settings import (  # noqa: E402
    DEFAULT_TEACHER_TOP_K, LORA_RECOVERY_LEARNING_RATE, ConvertSettings, default_recovery_learning_rate,
    default_teacher_top_k)
from hf_knorm.conversion.state import write_state  # noqa: E402
from hf_knorm.runs.run_folder import settings_record  # noqa: E402


@pytest.mark.parametrize(("normalization", "rate"), [
    ("x/1", 1e-3), ("x/16", 1e-3), ("x/sqrtN", 1e-3), ("x^3/1", 5e-4), ("x^3/16", 5e-4), ("x^3/sqrtN", 5e-4),
    ("x^2/4", 5e-4),
])
def test_full_recoverys_rate_defaults_by_the_normalizations_power_and_loras_is_one_rate(normalization, rate):
    settings = ConvertSettings(normalization=normalization, recovery="full")
    target = settings.target()  # the spelling parsed once, with the default window
    assert target.window == 64 and default_recovery_learning_rate(target, "full") == rate
    assert settings.recovery_learning_rate is None and settings.resolved(target).recovery_learning_rate == rate
    given = ConvertSettings(normalization=normalization, recovery="full", recovery_learning_rate=2e-4)
    assert given.resolved(given.target()).recovery_learning_rate == 2e-4  # a rate given is kept
    lora = ConvertSettings(normalization=normalization)  # the default recovery
    assert lora.recovery == "lora" and lora.resolved(target).recovery_learning_rate == LORA_RECOVERY_LEARNING_RATE


@pytest.mark.parametrize(("overrides", "top_k"), [
    ({}, None), ({"recovery": "full"}, None), ({"distill_weight": 0.0}, 0),
    ({"recovery": "none"}, 0), ({"teacher_top_k": 0}, 0), ({"teacher_top_k": 64}, 64),
])
def test_the_teachers_top_k_is_off_where_the_recovery_does_not_distil_and_left_to_the_recovery_elsewhere(
        overrides, top_k):
    settings = ConvertSettings(**overrides)
    assert settings.resolved(settings.target()).teacher_top_k == top_k


@pytest.mark.parametrize(("drawn", "examples", "top_k"), [
    (600, 764, DEFAULT_TEACHER_TOP_K),  # the default conversion: 150 steps of 4 on the general mixture
    (382, 764, DEFAULT_TEACHER_TOP_K), (381, 764, 0),  # half the training set, and one example fewer
    (200, 940, 0),  # make demo's short conversion: 50 steps of 4 on its 940 blocks
    (8, 30, 0),  # a test's few steps
])
def test_the_default_top_k_is_on_where_the_recovery_draws_half_the_training_set(drawn, examples, top_k):
    assert default_teacher_top_k(drawn, examples) == top_k


@pytest.mark.parametrize(("steps", "budget", "scheduled"), [(150, 1.0, 150), (150, 2.0, 300), (150, 0.5, 75),
                                                             (3, 1.5, 4), (2, 1.5, 3)])
def test_the_budget_multiplies_the_recovery_steps(steps, budget, scheduled):
    assert ConvertSettings(recovery_steps=steps, budget=budget).scheduled_recovery_steps() == scheduled


@pytest.mark.parametrize(("overrides", "message"), [
    ({"budget": 0}, "budget must be > 0"), ({"budget": -1.0}, "budget must be > 0"),
    ({"budget": float("nan")}, "budget must be > 0"), ({"budget": 0.001}, "rounds to no step"),
    ({"recovery_learning_rate": 0.0}, "must be > 0"),
])
def test_a_bad_budget_or_rate_is_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_settings(ConvertSettings(out=str(tmp_path / "run"), report_to=("none",), **overrides))


def test_a_run_records_the_resolved_rate_and_resumes_with_the_default_still_unset(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    started = ConvertSettings(normalization="x/16", out=str(out), report_to=("none",))
    write_state(out, {"settings": settings_record(started.resolved(started.target()))})  # what run_convert records
    check_settings(ConvertSettings(normalization="x/16", out=str(out), report_to=("none",), resume=True))
    with pytest.raises(ValueError, match="recovery_learning_rate: 0.001 then, 0.0005 now"):
        check_settings(ConvertSettings(normalization="x/16", out=str(out), report_to=("none",), resume=True,
                                       recovery_learning_rate=5e-4))


def test_the_conversion_runs_budget_times_the_recovery_steps_at_the_normalizations_rate(tmp_path):
    model_dir = save_tiny_lm(tmp_path / "tiny_lm")
    (tmp_path / "train.txt").write_text((SAMPLE_TEXT + "\n") * 6)
    (tmp_path / "heldout.txt").write_text(SAMPLE_TEXT[::-1] + "\n")
    out = tmp_path / "run"
    summary = run_convert(ConvertSettings(
        model=str(model_dir), dataset=str(tmp_path / "train.txt"), eval_dataset=str(tmp_path / "heldout.txt"),
        out=str(out), normalization="x/16", block_size=32, batch_size=2, eval_tokens=64, eval_steps=4,
        transfer_steps=0, recovery_steps=2, budget=1.5, logging_steps=1, save_steps=4, warmup_steps=0,
        report_to=("none",), eval_domains=("none",), probe=False))
    assert summary["stages"]["recovery"]["steps"] == 3
    assert summary["settings"]["recovery_learning_rate"] == 1e-3 and summary["settings"]["budget"] == 1.5
    assert json.loads((out / RESULT_FILE).read_text())["settings"]["recovery_learning_rate"] == 1e-3
    trainer_state = json.loads((out / "recovery" / "checkpoint-3" / "trainer_state.json").read_text())
    rates = [entry["learning_rate"] for entry in trainer_state["log_history"] if "learning_rate" in entry]
    assert rates and 5e-4 < max(rates) <= 1e-3  # the cosine's peak is the rate: above the cubic ones' 5e-4
