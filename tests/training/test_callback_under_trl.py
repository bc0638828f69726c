"""NormLoggerCallback under TRL's trainers: SFTTrainer in each dataset format (TRL tokenizing the raw records itself)
and DPOTrainer on preference pairs log the per-layer norms exactly as under Trainer; resume works under SFTTrainer."""

from __future__ import annotations

import glob

import datasets
import pytest
import torch
from training_helpers import char_tokenizer, history_lines, lm
from test_training_resume import Crash

import hf_knorm
from hf_knorm.recording.per_step import STATISTICS

trl = pytest.importorskip("trl")
from hf_knorm.runs.sft import CHECKPOINTING  # noqa: E402 (imports trl)

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
PAIRS = [(f"What is {a} + {b}?", f"{a + b}.", f"{a * b + 1}.") for a in range(4) for b in range(4)]


def _tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _records(kind: str) -> datasets.Dataset:
    if kind == "text":
        rows = [{"text": f"{q} {a}"} for q, a, _ in PAIRS]
    elif kind == "messages":
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a, _ in PAIRS]
    elif kind == "prompt_completion":
        rows = [{"prompt": q, "completion": " " + a} for q, a, _ in PAIRS]
    else:  # preference pairs
        rows = [{"prompt": q, "chosen": " " + a, "rejected": " " + wrong} for q, a, wrong in PAIRS]
    return datasets.Dataset.from_list(rows)


def _config(config_class, out, **overrides):
    settings = dict(output_dir=str(out), max_steps=4, logging_steps=2, per_device_train_batch_size=4,
                    learning_rate=1e-3, report_to=["tensorboard"], save_strategy="no", disable_tqdm=True,
                    use_cpu=True, bf16=False, seed=0, data_seed=0, max_length=64)
    settings[CHECKPOINTING] = False  # under the name the installed Transformers has (the old one warns in 5.2x)
    settings.update(overrides)
    return config_class(**settings)


def _check_norms_everywhere(trainer, out, steps):
    """The norms are in log_history at each logging step, in TensorBoard with the same values, and in norms.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected_keys = {f"norms/layer_{layer:02d}/{name}" for layer in range(2) for name in STATISTICS}
    entries = [entry for entry in trainer.state.log_history if "norms/layer_00/attn_fro" in entry]
    assert [entry["step"] for entry in entries] == steps
    assert all(expected_keys <= set(entry) and "loss" in entry for entry in entries)
    events = EventAccumulator(glob.glob(str(out / "runs" / "*" / "events.out.tfevents.*"))[0]).Reload()
    scalars = events.Scalars("train/norms/layer_01/attn_fro")
    assert [s.step for s in scalars] == steps
    assert [s.value for s in scalars] == pytest.approx([entry["norms/layer_01/attn_fro"] for entry in entries],
                                                       rel=1e-6)
    lines = history_lines(out / "norms.jsonl")
    assert [line["step"] for line in lines] == steps
    assert lines[-1]["layers"][1]["attn_fro"] == pytest.approx(entries[-1]["norms/layer_01/attn_fro"])
    return entries


@pytest.mark.compat
@pytest.mark.parametrize("kind", ["text", "messages", "prompt_completion"])
def test_the_callback_logs_under_sft_trainer_in_each_format(tmp_path, kind):
    model = lm("x^3/16")
    trainer = trl.SFTTrainer(model=model, args=_config(trl.SFTConfig, tmp_path), train_dataset=_records(kind),
                             processing_class=_tokenizer(), callbacks=[hf_knorm.NormLoggerCallback()])
    trainer.train()
    entries = _check_norms_everywhere(trainer, tmp_path, [2, 4])
    assert all(line["normalization"] == "x^3/16" for line in history_lines(tmp_path / "norms.jsonl"))
    assert "mean_token_accuracy" in entries[-1]  # TRL's own metrics share the entry


@pytest.mark.compat
def test_the_callback_logs_under_dpo_trainer(tmp_path):
    model, reference = lm("x^3/16"), lm("x^3/16").eval()  # a built model has no Hub id to load a reference from
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=_config(trl.DPOConfig, tmp_path),
                             train_dataset=_records("preference"), processing_class=_tokenizer(),
                             callbacks=[hf_knorm.NormLoggerCallback()])
    trainer.train()
    entries = _check_norms_everywhere(trainer, tmp_path, [2, 4])
    assert "rewards/margins" in entries[-1]  # DPO's own metrics share the entry


@pytest.mark.compat
def test_the_reference_models_calls_are_left_out_of_the_norms(tmp_path):
    """DPOTrainer calls the reference model in every step, through the plugin too: the norms are the policy's alone.
    With the learning rate 0 the policy never changes, so two runs whose references differ wildly (one with its
    attention weights scaled by 3) log the same norms, to the last digit, and different DPO rewards."""
    logged = []
    for scale in (1.0, 3.0):
        reference = lm("x^3/16", seed=1).eval()
        with torch.no_grad():
            for _, module in hf_knorm.models.architectures.attention_modules(reference):
                module.q_proj.weight.mul_(scale)
                module.k_proj.weight.mul_(scale)
        out = tmp_path / f"scale_{scale}"
        trainer = trl.DPOTrainer(model=lm("x^3/16"), ref_model=reference,
                                 args=_config(trl.DPOConfig, out, learning_rate=0.0, report_to="none"),
                                 train_dataset=_records("preference"), processing_class=_tokenizer(),
                                 callbacks=[hf_knorm.NormLoggerCallback()])
        trainer.train()
        logged.append([entry for entry in trainer.state.log_history if "norms/layer_00/attn_fro" in entry])
    norms = [[{key: value for key, value in entry.items() if key.startswith("norms/")} for entry in run]
             for run in logged]
    assert norms[0] == norms[1] and len(norms[0]) == 2
    assert logged[0][-1]["rewards/chosen"] != logged[1][-1]["rewards/chosen"]  # the references did differ


def test_an_interrupted_sft_run_resumes_with_every_step_logged_once(tmp_path):
    def run(out, callbacks, resume=None, model=None):
        trainer = trl.SFTTrainer(
            model=model or lm(), args=_config(trl.SFTConfig, out, max_steps=8, save_strategy="steps", save_steps=4,
                                              report_to="none"),
            train_dataset=_records("messages"), processing_class=_tokenizer(), callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    run(tmp_path / "reference", [hf_knorm.NormLoggerCallback()])
    expected = history_lines(tmp_path / "reference" / "norms.jsonl")
    out, model, callback = tmp_path / "run", lm(), hf_knorm.NormLoggerCallback()
    with pytest.raises(KeyboardInterrupt):
        run(out, [callback, Crash(6)], model=model)
    assert [line["step"] for line in history_lines(out / "norms.jsonl")] == [2, 4]
    run(out, [callback], resume=str(out / "checkpoint-4"), model=model)
    lines = history_lines(out / "norms.jsonl")
    assert [line["step"] for line in lines] == [2, 4, 6, 8]
    for got, want in zip(lines, expected):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        for got_layer, want_layer in zip(got["layers"], want["layers"]):
            assert got_layer == pytest.approx(want_layer, rel=1e-5)
