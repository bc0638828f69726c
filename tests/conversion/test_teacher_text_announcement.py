"""The teacher-sampling announcement states a time only from a rate measured at the same batch size on the same
device by the same sampler (a one-sample draw cached by the tests once announced 11 min for a 32-at-a-time draw
that took 2.5 min)."""

from __future__ import annotations

import json

import torch

from hf_knorm.conversion import teacher_text


def _cached_draw(folder, model_dir, *, batch_size, tokens_per_second, device="cpu", sampler=teacher_text.SAMPLER,
                 name):
    cost = {"model_dir": str(model_dir), "tokens_per_second": tokens_per_second, "device": device,
            "sampler": sampler}
    if batch_size is not None:
        cost["batch_size"] = batch_size
    (folder / f"{name}.json").write_text(json.dumps(cost))


def test_the_time_comes_only_from_draws_at_the_same_batch_size_and_device(tmp_path):
    folder, model_dir, model = tmp_path / "teacher_text", tmp_path / "model", torch.nn.Linear(2, 2)
    folder.mkdir()
    path = folder / "next.jsonl"
    tokens = 8192  # 32 samples of 256, drawn 32 at a time
    assert teacher_text.batch_size(tokens) == 32 and teacher_text.batch_size(512) == 2
    _cached_draw(folder, model_dir, batch_size=2, tokens_per_second=12.0, name="small")
    _cached_draw(folder, model_dir, batch_size=None, tokens_per_second=12.0, name="unrecorded")  # an older cache
    _cached_draw(folder, model_dir, batch_size=32, tokens_per_second=500.0, device="cuda:0", name="gpu")
    _cached_draw(folder, tmp_path / "other_model", batch_size=32, tokens_per_second=80.0, name="other")
    _cached_draw(folder, model_dir, batch_size=32, tokens_per_second=40.0, sampler=None, name="sorted")  # the warper's
    line = teacher_text.announcement(model, model_dir, tokens, path)
    assert "32 at a time" in line and "min at the" not in line  # no rate of this draw's kind: no time
    _cached_draw(folder, model_dir, batch_size=32, tokens_per_second=50.0, name="same_a")
    _cached_draw(folder, model_dir, batch_size=32, tokens_per_second=60.0, name="same_b")
    _cached_draw(folder, model_dir, batch_size=32, tokens_per_second=58.0, name="same_c")
    line = teacher_text.announcement(model, model_dir, tokens, path)
    assert f"about {tokens / 58.0 / 60:.1f} min at the 58 tokens/s" in line  # the median of the three
