"""``--bf16`` / ``--fp16`` of ``finetune`` and ``convert``: fp16 only on an accelerator, never both, refused before
any model loads, and passed to TrainingArguments as asked."""

from __future__ import annotations

import pytest

from hf_knorm.conversion.job import run_convert
from hf_knorm.conversion.settings import ConvertSettings
from hf_knorm.jobs.finetune import FinetuneSettings, run_finetune
from hf_knorm.training import precision
from hf_knorm.training.precision import check_precision, precision_arguments


@pytest.fixture
def no_accelerator(monkeypatch):
    monkeypatch.setattr(precision, "has_accelerator", lambda: False)


def test_fp16_is_refused_without_an_accelerator(no_accelerator):
    with pytest.raises(ValueError, match=r"--fp16 needs an accelerator.*use --bf16"):
        check_precision(bf16=False, fp16=True)
    check_precision(bf16=True, fp16=False)
    check_precision(bf16=False, fp16=False)


def test_fp16_is_accepted_on_an_accelerator(monkeypatch):
    monkeypatch.setattr(precision, "has_accelerator", lambda: True)
    check_precision(bf16=False, fp16=True)
    assert precision_arguments(bf16=False, fp16=True) == {"bf16": False, "fp16": True, "use_cpu": False}


def test_both_precisions_at_once_are_refused(monkeypatch):
    monkeypatch.setattr(precision, "has_accelerator", lambda: True)
    with pytest.raises(ValueError, match="--bf16 and --fp16 are two mixed precisions: choose one"):
        check_precision(bf16=True, fp16=True)


def test_the_cpu_gets_use_cpu_and_the_precision_asked_for(no_accelerator):
    assert precision_arguments(bf16=True) == {"bf16": True, "fp16": False, "use_cpu": True}


@pytest.mark.parametrize("job, settings", [
    (run_convert, ConvertSettings), (run_finetune, FinetuneSettings)], ids=["convert", "finetune"])
def test_the_jobs_refuse_fp16_before_a_model_loads(no_accelerator, tmp_path, monkeypatch, job, settings):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the precision was checked")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_loading)
    with pytest.raises(ValueError, match="--fp16 needs an accelerator"):
        job(settings(out=str(tmp_path / "run"), fp16=True))
    assert not (tmp_path / "run").exists()
