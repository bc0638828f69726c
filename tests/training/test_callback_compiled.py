"""NormLoggerCallback in a Trainer with ``torch_compile=True``: the callback's recorder is a tap, so the compiled model
runs the custom op between logging steps and recompiles with the tap reads on them; the losses and the logged norms
are those of the eager run (same seed, same data). The Trainer compiles with ``aot_eager`` (Dynamo's recompilations,
AOTAutograd's forward and backward, no code generation: inductor compiles the same op in
tests/attention/test_compile.py)."""

import pytest
import torch
import transformers as tf
from training_helpers import args, history_lines, lm, lm_data

from hf_knorm.training.callback import NormLoggerCallback


def _train(out, compiled: bool):
    torch._dynamo.reset()
    compiling = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
    trainer = tf.Trainer(model=lm("x^3/16"), args=args(out, max_steps=4, logging_steps=2, **compiling),
                         train_dataset=lm_data(), callbacks=[NormLoggerCallback()])
    trainer.train()
    torch._dynamo.reset()
    return history_lines(out / "norms.jsonl")


def test_compiled_training_logs_the_eager_norms(tmp_path):
    eager, compiled = _train(tmp_path / "eager", False), _train(tmp_path / "compiled", True)
    assert [line["step"] for line in compiled] == [line["step"] for line in eager] == [2, 4]
    for got, want in zip(compiled, eager, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        for got_layer, want_layer in zip(got["layers"], want["layers"], strict=True):
            assert got_layer == pytest.approx(want_layer, rel=1e-5)
