"""hf-knorm attention-norms at toy size: five histories, one figure, runs not trained twice."""

from __future__ import annotations

import json

from training_helpers import history_lines

from hf_knorm.cli import main
from hf_knorm.data.digits_vit import digits_splits
from hf_knorm.jobs.attention_norms import run_slug


def test_digits_split_is_stratified_and_seeded():
    train, test = digits_splits(seed=0)
    assert (len(train), len(test)) == (1437, 360)
    assert train[0]["pixel_values"].shape == (1, 8, 8)
    assert -1.0 <= float(train[0]["pixel_values"].min()) and float(train[0]["pixel_values"].max()) <= 1.0
    assert sorted({example["labels"] for example in test}) == list(range(10))
    assert digits_splits(seed=0)[1][0]["labels"] == test[0]["labels"]


def test_figure_job_at_toy_size(tmp_path, capsys):
    flags = ["attention-norms", "--out", str(tmp_path), "--layers", "2", "--hidden", "24", "--heads", "2",
             "--max-steps", "4", "--logging-steps", "2", "--normalizations", "softmax,x^3/16"]
    assert main(flags) == 0
    for name in ("softmax", "x^3/16"):
        lines = history_lines(tmp_path / run_slug(name) / "norms.jsonl")
        assert [line["step"] for line in lines] == [2, 4] and len(lines[0]["layers"]) == 2
        assert lines[0]["normalization"] == name
    assert (tmp_path / "attention_norms.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [run["normalization"] for run in summary["runs"]] == ["softmax", "x^3/16"]
    table = (tmp_path / "summary.md").read_text()
    assert "| x^3/16 |" in table and "| 2 | " in table and "order, largest first" in table
    assert len(summary["late_medians"]) == 2 and set(summary["late_medians"][0]) == {"softmax", "x^3/16"}
    capsys.readouterr()
    assert main(flags) == 0  # finished runs are kept, not trained again
    assert capsys.readouterr().out.count("already trained") == 2


def test_unknown_normalization_is_refused_before_training(tmp_path, capsys):
    assert main(["attention-norms", "--out", str(tmp_path), "--normalizations", "softmax,x^q/2"]) == 2
    assert "x^p/c" in capsys.readouterr().err and not list(tmp_path.iterdir())
