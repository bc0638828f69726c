"""``--bf16`` / ``--fp16`` of ``finetune`` and ``convert``: fp16 only on an accelerator, never both, refused before
any model loads, and passed to TrainingArguments as asked."""

from __future__ import annotations

import pytest
import torch
import transformers
from training_helpers import lm, lm_data

import hf_knorm

from hf_knorm.conversion.settings import ConvertSettings
from hf_knorm.jobs.convert import run_convert
from hf_knorm.jobs.finetune import FinetuneSettings, run_finetune
from hf_knorm.runs import precision
from hf_knorm.runs.arguments import job_arguments
from hf_knorm.runs.precision import check_precision


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


def test_both_precisions_at_once_are_refused(monkeypatch):
    monkeypatch.setattr(precision, "has_accelerator", lambda: True)
    with pytest.raises(ValueError, match="--bf16 and --fp16 are two mixed precisions: choose one"):
        check_precision(bf16=True, fp16=True)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_jobs_trainer_runs_the_forward_in_the_precision_asked_on_the_cpu(no_accelerator, tmp_path, bf16):
    """What the job's arguments do in a real Trainer step, not what they spell: with ``bf16`` the forward runs under
    CPU autocast (the projections compute in bf16) while the weights stay fp32; without it, fp32 throughout."""
    model = lm("x^3/16")
    computed = []
    attention = hf_knorm.models.architectures.attention_modules(model)[0][1]
    attention.q_proj.register_forward_hook(lambda module, args, output: computed.append(output.dtype))
    arguments = job_arguments(tmp_path, steps=1, batch_size=2, learning_rate=1e-3, warmup_steps=0, logging_steps=1,
                              save_steps=10, eval_steps=10, report_to=(), seed=0, bf16=bf16, eval_strategy="no",
                              eval_on_start=False, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**arguments),
                                   train_dataset=lm_data(count=2))
    trainer.train()
    assert trainer.args.use_cpu and trainer.args.device.type == "cpu"
    assert computed == [torch.bfloat16 if bf16 else torch.float32]
    assert {param.dtype for param in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("job, settings", [
    (run_convert, ConvertSettings), (run_finetune, FinetuneSettings)], ids=["convert", "finetune"])
def test_the_jobs_refuse_fp16_before_a_model_loads(no_accelerator, tmp_path, monkeypatch, job, settings):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the precision was checked")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_loading)
    with pytest.raises(ValueError, match="--fp16 needs an accelerator"):
        job(settings(out=str(tmp_path / "run"), fp16=True))
    assert not (tmp_path / "run").exists()
