"""Needle-in-a-haystack / passkey grid, its resumable results, the heatmap, the pipeline and the ``niah`` command."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache, pipeline

from hf_knorm.evaluation import needle
from hf_knorm.assets.texts import SAMPLE_TEXT
from hf_knorm.cli import parse
from hf_knorm.evaluation.needle import (
    Variant,
    accuracy_grid,
    is_correct,
    make_sample,
    ratio_variants,
    run_needle,
    write_report,
)
from hf_knorm.eviction.pipeline import split_prompt


@pytest.fixture(scope="module")
def haystacks(default_model_and_tokenizer):
    _, tokenizer = default_model_and_tokenizer
    return {task: needle.haystack(task, tokenizer) for task in ("niah", "passkey")}


@pytest.mark.parametrize("task", ["niah", "passkey"])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_sample_has_the_needle_at_its_depth_and_length(default_model_and_tokenizer, haystacks, task, depth):
    _, tokenizer = default_model_and_tokenizer
    sample = make_sample(task, tokenizer, haystacks[task], 1000, depth, seed=0)
    context = sample["context"]
    tokens = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    assert 980 <= tokens <= 1010
    assert context.count(sample["expected"]) == (1 if task == "niah" else 2)
    where = context.index(sample["expected"]) / len(context)
    assert abs(where - depth) < 0.1
    other = make_sample(task, tokenizer, haystacks[task], 1000, depth, seed=1)
    assert other["expected"] != sample["expected"]
    assert make_sample(task, tokenizer, haystacks[task], 1000, depth, seed=0) == sample  # reproducible


def test_exact_match():
    assert is_correct("4827315.", "4827315")
    assert is_correct("The number is 4,827,315 indeed", "4827315")
    assert not is_correct("48273", "4827315")
    assert not is_correct("482731 then 4827315", "4827315")
    assert not is_correct("no number", "4827315")


def test_results_are_written_per_cell_and_resumed(default_model_and_tokenizer, tmp_path, monkeypatch):
    model, tokenizer = default_model_and_tokenizer
    calls = []

    def fake_answer(model, tokenizer, sample, variants, max_new_tokens, evicted=None):
        calls.append(sample["expected"])
        if len(calls) == 2 and fail["on"]:
            raise KeyboardInterrupt  # an interrupted run
        return {v.name: sample["expected"] if v.ratio == 0 else "0" for v in variants}

    fail = {"on": True}
    monkeypatch.setattr(needle, "answer_cell", fake_answer)
    grid = dict(tasks=("niah",), variants=ratio_variants((0.0, 0.5)), lengths=(200,), depths=(0.0, 1.0), seeds=1,
                progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_needle(model, tokenizer, tmp_path, **grid)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved) == 2 and {r["depth"] for r in saved} == {0.0}  # the first cell survived the interruption
    fail["on"] = False
    calls.clear()
    records = run_needle(model, tokenizer, tmp_path, **grid)
    assert len(calls) == 1 and len(records) == 4  # only the missing cell was run
    assert (tmp_path / "results.csv").read_text().count("\n") == 5
    lengths, depths, acc = accuracy_grid(records, "niah", "r=0")
    assert (lengths, depths, acc) == ([200], [0.0, 1.0], [[1.0], [1.0]])
    assert accuracy_grid(records, "niah", "r=0.5")[2] == [[0.0], [0.0]]
    summary = write_report(records, tmp_path)
    assert "| r=0 | 100 | 100.0 | 1 |" in summary.read_text()
    assert (tmp_path / "heatmap_niah_r=0.5.png").stat().st_size > 1000


def test_answer_cell_on_the_default_model(default_model_and_tokenizer, haystacks):
    model, tokenizer = default_model_and_tokenizer
    sample = make_sample("niah", tokenizer, haystacks["niah"], 300, 0.5, seed=0)
    variants = [Variant("r=0"), Variant("authors", {"compression_ratio": 0.5, "layer_ratios": {0: 0.0}},
                                        protocol="authors")]
    answers = needle.answer_cell(model, tokenizer, sample, variants, max_new_tokens=9)
    assert is_correct(answers["r=0"], sample["expected"]), answers
    assert set(answers) == {"r=0", "authors"}


def test_threshold_rows_record_what_they_evicted(default_model_and_tokenizer, tmp_path):
    """A threshold row (KVzap's pruning, no ratio) beside a ratio row: each record holds the share of the tokens seen
    that its cache no longer held after the answer (0 uncompressed; about the ratio of the context for a ratio row;
    what the threshold gave for a threshold row), and the summary averages it."""
    model, tokenizer = default_model_and_tokenizer
    variants = needle.score_variants((0.0, 0.5), ["kv_diff", "kvzap+heads+sinks4+window64+threshold-4.3"])
    records = run_needle(model, tokenizer, tmp_path, variants=variants, lengths=(400,), depths=(0.5,), seeds=1,
                         progress=False)
    evicted = {r["variant"]: r["evicted"] for r in records}
    assert evicted["r=0"] == 0.0
    assert 0.4 < evicted["r=0.5 kv_diff"] < 0.5  # half the context; the question and the answer are kept
    assert 0.0 < evicted["t=-4.3 kvzap+heads+sinks4+window64"] < 1.0
    assert [r["ratio"] for r in records] == [0.0, 0.5, None]
    summary = write_report(records, tmp_path).read_text()
    assert f"| {100 * evicted['t=-4.3 kvzap+heads+sinks4+window64']:.1f}% |" in summary
    assert "evicted" in (tmp_path / "results.csv").read_text().splitlines()[0]


def test_pipeline_compresses_the_context_only(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    pipe = pipeline("knorm-text-generation", model=model, tokenizer=tokenizer)
    context = SAMPLE_TEXT
    question = "How many steps did the keeper climb?"
    answer = pipe(context, question=question, compression_ratio=0.0, max_new_tokens=12)["answer"]
    # the same prompt through plain generate
    context_text, question_text = split_prompt(tokenizer, context, question)
    assert context_text.startswith("<|im_start|>") and question_text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(context_text + question_text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(),
                           max_new_tokens=12, do_sample=False)
    assert answer == tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True).strip()
    compressed = pipe(context, question=question, compression_ratio=0.5, layer_ratios={0: 0.0}, max_new_tokens=4)
    assert isinstance(compressed["answer"], str)
    torch.manual_seed(0)
    sampled = pipe(context, question=question, compression_ratio=0.5, max_new_tokens=4, do_sample=True)
    assert isinstance(sampled["answer"], str)
    with pytest.raises(ValueError, match="question"):
        pipe(context)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        pipe(context, question=question, compression_ratio=1.0)


def test_niah_command_line():
    command, settings, _ = parse(["niah", "--ratios", "0,0.5", "--lengths", "1000", "--seeds", "3", "--no-options",
                                  "--out", "x"])
    assert command.name == "niah" and settings.seeds == 3 and settings.options is False
    assert settings.ratios == (0.0, 0.5) and settings.lengths == (1000,)


def test_heatmap_grid_draws_one_panel_per_row_and_column(tmp_path):
    from matplotlib.image import imread

    from hf_knorm.plots import plot_needle_heatmap_grid

    grid = ([1000, 2000], [0.0, 1.0], [[1.0, 0.5], [None, 0.0]])  # a cell not run is drawn grey
    panels = {"key_norm": {"r=0.5": grid, "r=0.75": grid}, "kv_diff": {"r=0.5": grid}}  # kv_diff at 0.75 missing
    path = plot_needle_heatmap_grid(panels, tmp_path / "grid.png", title="scores")
    height, width, _ = imread(path).shape
    assert width > height  # two columns of panels side by side, two rows
    one_row = plot_needle_heatmap_grid({"key_norm": panels["key_norm"]}, tmp_path / "row.png")
    assert imread(one_row).shape[0] < height


def test_retrieval_records_answer_through_a_given_generate_as_through_the_models_own(default_model_and_tokenizer):
    """``retrieval_records(generate=...)`` (a KNormCache baseline beside a converted model): the same cells, the
    caller's answers; a ``generate`` that is the model's own gives its answers exactly."""
    from hf_knorm.evaluation.retrieval import retrieval_records

    model, tokenizer = default_model_and_tokenizer
    grid = dict(tasks=("passkey",), lengths=(300,), depths=(0.5,), seeds=1)
    own = retrieval_records(model, tokenizer, **grid)
    calls = []

    def generate(ids):
        calls.append(ids.shape)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)

    given = retrieval_records(model, tokenizer, **grid, generate=generate)
    assert len(calls) == 1 and given[0]["cache"] == "custom"
    assert [r["answer"] for r in given] == [r["answer"] for r in own]
    assert {k: v for k, v in given[0].items() if k != "cache"} == {k: v for k, v in own[0].items() if k != "cache"}
