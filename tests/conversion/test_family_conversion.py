"""``hf-knorm convert`` to the families beyond ``x^p/c`` (issue 47, item 2): ReLU powers, sigmoid (a fixed and a
learned bias), softpick and SSMax, pure and beside a softmax window; the converted model reloads and scores what the
run measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_knorm  # noqa: E402
from hf_knorm.data.heldout import held_out_blocks  # noqa: E402
from hf_knorm.data.text_data import load_text_dataset  # noqa: E402
from hf_knorm.evaluation.perplexity import perplexity_of_windows  # noqa: E402
from hf_knorm.jobs.convert import RESULT_FILE, run_convert  # noqa: E402

from test_conversion import _settings, texts, tiny_lm_dir  # noqa: E402,F401


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("normalization", ["relu(x)^2/n", "sigmoid(bias=-log n)", "sigmoid(bias=learned)", "softpick",
                                           "ssmax(scale=learned)"])
def test_a_conversion_to_another_family_reloads_and_scores_what_it_measured(tiny_lm_dir, texts, tmp_path,
                                                                           normalization, window):
    out = tmp_path / "run"
    run_convert(_settings(tiny_lm_dir, texts, out, normalization=normalization, softmax_window=window,
                          transfer_steps=2, recovery_steps=2))
    record = json.loads((out / RESULT_FILE).read_text())
    expected = normalization + (f" + softmax window {window} + sinks 4" if window else "")
    assert record["normalization"] == record["trained_as"] == expected  # only x^p/c trains a twin
    reloaded = hf_knorm.from_pretrained(out).eval()
    assert hf_knorm.patched_normalization(reloaded) == expected
    tokenizer = tf.AutoTokenizer.from_pretrained(out)
    blocks = held_out_blocks(load_text_dataset(str(texts / "heldout.txt")), tokenizer, 32, 128)
    windows = [torch.tensor(block["input_ids"]) for block in blocks]
    again = perplexity_of_windows(reloaded, windows, progress=False).perplexity
    assert again == pytest.approx(record["evaluation"]["perplexity"], rel=1e-5)


def test_a_familys_learned_values_train_in_both_stages_and_a_resumed_run_continues_them(tiny_lm_dir, texts, tmp_path,
                                                                                      monkeypatch):
    """``sigmoid(bias=learned)`` beside a window, LoRA recovery: the transfer trains the bias with the projections,
    the recovery beside LoRA's adapters (which would freeze it), checkpointed beside them and read back on resume;
    the window's mix stays the closed form the transfer solved (no window dropout)."""
    from safetensors.torch import load_file
    from test_window_dropout_conversion import converted_after_a_break

    from hf_knorm.conversion.learned_values import FILE

    def values(folder, name):
        return torch.stack([tensor for key, tensor in sorted(load_file(folder / "model.safetensors").items())
                            if key.endswith(f"self_attn.hf_knorm_{name}")])

    common = dict(normalization="sigmoid(bias=learned)", softmax_window=4, attention_sinks=1, beyond_window=False,
                  recovery="lora", transfer_steps=2, recovery_steps=6, teacher_top_k=0)
    whole = tmp_path / "whole"
    record = run_convert(_settings(tiny_lm_dir, texts, whole, **common))
    initial = -torch.log(torch.tensor(1024.0))
    transferred = values(whole / "transfer" / "model", "bias")
    assert (transferred - initial).abs().min() > 0  # every head's bias moved in the transfer
    assert (values(whole, "bias") - transferred).abs().min() > 0  # and again in the recovery
    torch.testing.assert_close(values(whole, "window_mix"), torch.tensor(record["stages"]["transfer"]["window_mix"]))
    assert (whole / "recovery" / "checkpoint-6" / FILE).is_file()

    broken = tmp_path / "broken"
    converted_after_a_break(monkeypatch, _settings(tiny_lm_dir, texts, broken, **common))
    torch.testing.assert_close(values(broken, "bias"), values(whole, "bias"), rtol=1e-4, atol=1e-6)


def test_train_learned_values_marks_the_family_and_the_mix_on_request_never_the_codebook():
    from tiny_models import tiny_model

    from hf_knorm.conversion.learned_values import learned_parameters, train_learned_values

    model = hf_knorm.patch(tiny_model("llama"), "sigmoid(bias=learned) + softmax window 4 + sinks 1 + sparse 4 + "
                           "clusters 2")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    layers = len(hf_knorm.models.architectures.attention_modules(model))
    assert train_learned_values(model, mix=False) == layers
    trained = {name.rsplit(".", 1)[-1] for name, parameter in learned_parameters(model).items()
               if parameter.requires_grad}
    assert trained == {"hf_knorm_bias"}
    assert train_learned_values(model, mix=True) == 2 * layers
    trained = {name.rsplit(".", 1)[-1] for name, parameter in learned_parameters(model).items()
               if parameter.requires_grad}
    assert trained == {"hf_knorm_bias", "hf_knorm_window_mix"}
