"""``convert`` trains fp32 weights whatever dtype the checkpoint was saved in (``runs/precision.py``: mixed precision
is autocast over fp32 weights and optimizer state)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_helpers import char_tokenizer, lm  # noqa: E402

from hf_knorm.conversion import stages  # noqa: E402
from hf_knorm.jobs.convert import run_convert  # noqa: E402

from test_conversion import _settings, texts  # noqa: E402,F401


class _Stopped(Exception):
    pass


def test_a_bf16_checkpoint_is_converted_in_fp32_weights(texts, tmp_path, monkeypatch):  # noqa: F811
    folder = tmp_path / "bf16_lm"
    lm().to(torch.bfloat16).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    assert '"dtype": "bfloat16"' in (folder / "config.json").read_text()
    seen = {}

    def stop_at_transfer(model, *args, **kwargs):  # what the transfer stage is handed: the loaded model
        seen["dtypes"] = {parameter.dtype for parameter in model.parameters()}
        raise _Stopped

    monkeypatch.setattr(stages, "run_transfer", stop_at_transfer)
    with pytest.raises(_Stopped):
        run_convert(_settings(folder, texts, tmp_path / "run"))
    assert seen["dtypes"] == {torch.float32}
