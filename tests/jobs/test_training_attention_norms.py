"""hf-knorm attention-norms at toy size: a history per normalization (a polynomial, a family with a learned value),
one figure, runs not trained twice; by default every family."""

from __future__ import annotations

import json

from training_helpers import history_lines

from hf_knorm.cli import main
from hf_knorm.data.digits_vit import digits_splits
from hf_knorm.jobs.attention_norms import FIGURE_NORMALIZATIONS, AttentionNormsSettings, run_slug
from hf_knorm.normalizations import parse_normalization
from hf_knorm.normalizations.registry import FAMILIES


def test_default_runs_are_the_paper_five_and_every_other_family():
    defaults = AttentionNormsSettings().normalizations
    assert defaults[:5] == ("softmax", "x/1", "x/16", "x^3/1", "x^3/16") and defaults == FIGURE_NORMALIZATIONS
    assert {parse_normalization(name).family for name in defaults} == set(FAMILIES)
    slugs = [run_slug(name) for name in defaults]
    assert len(set(slugs)) == len(slugs) and all(slug.replace("-", "").replace(".", "").isalnum() for slug in slugs)
    assert run_slug("x^3/16") == "x3-16" and run_slug("sigmoid(bias=-log n)") == "sigmoid-bias-log-n"


def test_digits_split_is_stratified_and_seeded():
    train, test = digits_splits(seed=0)
    assert (len(train), len(test)) == (1437, 360)
    assert train[0]["pixel_values"].shape == (1, 8, 8)
    assert -1.0 <= float(train[0]["pixel_values"].min()) and float(train[0]["pixel_values"].max()) <= 1.0
    assert sorted({example["labels"] for example in test}) == list(range(10))
    assert digits_splits(seed=0)[1][0]["labels"] == test[0]["labels"]


def test_figure_job_at_toy_size(tmp_path, capsys):
    flags = ["attention-norms", "--out", str(tmp_path), "--layers", "2", "--hidden", "24", "--heads", "2",
             "--max-steps", "4", "--logging-steps", "2", "--normalizations", "softmax,x^3/16,softmax(sink=learned)"]
    names = ("softmax", "x^3/16", "softmax(sink=learned)")
    assert main(flags) == 0
    for name in names:
        lines = history_lines(tmp_path / run_slug(name) / "norms.jsonl")
        assert [line["step"] for line in lines] == [2, 4] and len(lines[0]["layers"]) == 2
        assert lines[0]["normalization"] == name
    assert (tmp_path / "attention_norms.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [run["normalization"] for run in summary["runs"]] == list(names)
    assert all(0.0 <= run["test_accuracy"] <= 1.0 and run["global_step"] == 4 for run in summary["runs"])
    table = (tmp_path / "summary.md").read_text()
    assert "| x^3/16 |" in table and "| softmax(sink=learned) |" in table and "| 2 | " in table
    assert "order, largest first" in table
    assert len(summary["late_medians"]) == 2 and set(summary["late_medians"][0]) == set(names)
    assert all(value > 0 for value in summary["late_medians"][0].values())  # every run's norms were recorded
    capsys.readouterr()
    assert main(flags) == 0  # finished runs are kept, not trained again
    assert capsys.readouterr().out.count("already trained") == 3


def test_unknown_normalization_is_refused_before_training(tmp_path, capsys):
    assert main(["attention-norms", "--out", str(tmp_path), "--normalizations", "softmax,x^q/2"]) == 2
    err = capsys.readouterr().err  # the message lists the families with their spellings
    assert "Unknown normalization" in err and "x^3/16" in err and "stick-breaking" in err
    assert not list(tmp_path.iterdir())
