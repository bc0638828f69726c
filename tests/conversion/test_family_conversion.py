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
