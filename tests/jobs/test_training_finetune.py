"""hf-knorm finetune: any text source, bad input refused before training, a run folder that reloads and resumes."""

from __future__ import annotations

import json
import math

import pytest
from card_values import stated_data_format
from training_helpers import char_tokenizer, history_lines, lm, save_tiny_lm

import hf_knorm
from hf_knorm.assets.texts import SAMPLE_TEXT
from hf_knorm.cli import main
from hf_knorm.data.text_data import load_text_dataset, pack_dataset


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory):
    """A tiny llama (max 256 positions) with a character tokenizer, saved as a checkpoint folder."""
    return save_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "lighthouse.txt"
    path.write_text((SAMPLE_TEXT + "\n") * 8)
    return path


def _finetune(*flags, model, out) -> int:
    return main(["finetune", "--model", str(model), "--out", str(out), "--block-size", "32", "--eval-tokens", "64", *flags])


def test_local_files_of_each_kind_load_their_text(tmp_path):
    import pandas as pd

    rows = ["first text", "second text"]
    (tmp_path / "a.txt").write_text("\n".join(rows) + "\n")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(rows)))
    (tmp_path / "a.json").write_text(json.dumps([{"text": r} for r in rows]))
    pd.DataFrame({"text": rows, "n": [1, 2]}).to_csv(tmp_path / "a.csv", index=False)
    pd.DataFrame({"body": rows}).to_parquet(tmp_path / "a.parquet")
    for name, column in (("a.txt", "text"), ("a.jsonl", "text"), ("a.json", "text"), ("a.csv", "text"),
                         ("a.parquet", "body")):
        assert load_text_dataset(str(tmp_path / name), column)[column] == rows, name
    both = load_text_dataset(f"{tmp_path / 'a.txt'},{tmp_path / 'a.txt'}")
    assert both["text"] == rows + rows


def test_packing_cuts_blocks_with_end_of_text_between_texts(tmp_path):
    (tmp_path / "a.txt").write_text("abcde\nfghij\n")
    packed = pack_dataset(load_text_dataset(str(tmp_path / "a.txt")), char_tokenizer(), block_size=4)
    tokenizer = char_tokenizer()
    blocks = ["".join(tokenizer.convert_ids_to_tokens(row)) for row in packed["input_ids"]]
    assert blocks == ["abcd", "e</s>fg", "hij</s>"]
    assert packed["labels"] == packed["input_ids"]
    with pytest.raises(ValueError, match="12 tokens, fewer than one block of 64"):
        pack_dataset(load_text_dataset(str(tmp_path / "a.txt")), tokenizer, block_size=64)


BAD_INPUTS = {
    "missing file": (["--dataset", "{tmp}/nowhere.jsonl"], "No such file: .*nowhere.jsonl"),
    "no text column": (["--dataset", "{tmp}/table.csv"], "columns fit no format: found body, title; expected 'text'"),
    "empty dataset": (["--dataset", "{tmp}/blank.jsonl"], "is empty"),
    "empty file": (["--dataset", "{tmp}/empty.txt"], "empty.txt is empty: it holds no text to train on"),
    "unreadable file": (["--dataset", "{tmp}/broken.csv"], "tried reading .*broken.csv as csv with "
                        "datasets.load_dataset, which failed: .*ParserError"),
    "block size above the model's maximum": (["--dataset", "{tmp}/ok.txt", "--block-size", "512"],
                                             "--block-size 512 is above the model's maximum of 256"),
    "unknown normalization": (["--dataset", "{tmp}/ok.txt", "--normalization", "x^2.5/3"],
                              "Unknown normalization .x\\^2.5/3., at the base family's part"),
    "too few tokens": (["--dataset", "{tmp}/short.txt", "--eval-dataset", "{tmp}/ok.txt"],
                       "fewer than one block of 32"),
    "one text, nothing held out": (["--dataset", "{tmp}/ok.txt"], "holds a single text, which cannot be split"),
    "held-out text too short": (["--dataset", "{tmp}/ok.txt", "--eval-dataset", "{tmp}/short.txt"],
                                "held-out text is too short for the evaluation"),
    "evaluation longer than the held-out text": (
        ["--dataset", "{tmp}/ok.txt", "--eval-dataset", "{tmp}/ok.txt", "--eval-tokens", "100000"],
        "fewer than the 3125 that eval_tokens=100000 asks for"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_stops_with_its_message_before_training(tmp_path, tiny_lm_dir, capsys, case):
    (tmp_path / "table.csv").write_text("title,body\na,b\n")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    (tmp_path / "ok.txt").write_text(SAMPLE_TEXT + "\n")
    (tmp_path / "short.txt").write_text("too short\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "broken.csv").write_text('title,body\n"never closed\n')
    flags, message = BAD_INPUTS[case]
    out = tmp_path / "run"
    assert _finetune(*[f.format(tmp=tmp_path) for f in flags], model=tiny_lm_dir, out=out) == 2
    error = capsys.readouterr().err
    assert "hf-knorm finetune: error: " in error
    assert __import__("re").search(message, error), error
    assert not (out / "norms.jsonl").exists() and not list(out.glob("checkpoint-*"))


def test_finetune_logs_norms_checkpoints_reloads_and_resumes(tmp_path, tiny_lm_dir, text_file, capsys):
    out = tmp_path / "run"
    flags = ["--dataset", str(text_file), "--normalization", "x^3/16", "--balance", "layer", "--logging-steps", "2",
             "--save-steps", "2", "--batch-size", "2"]
    assert _finetune(*flags, "--max-steps", "4", model=tiny_lm_dir, out=out) == 0
    assert [line["step"] for line in history_lines(out / "norms.jsonl")] == [2, 4]
    assert list((out / "runs").glob("*/events.out.tfevents.*"))
    assert (out / "norms.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    model = hf_knorm.from_pretrained(out)  # the run folder is the model, with its normalization
    assert hf_knorm.patched_normalization(model) == "x^3/16"
    summary = json.loads((out / "finetune.json").read_text())
    assert summary["global_step"] == 4 and summary["normalization"] == "x^3/16"
    evaluation = summary["evaluation"]  # held out: the last of the 8 lines, 64 tokens
    assert evaluation["tokens"] == 64 and evaluation["text"] == f"the last 1 of 8 texts of {text_file} (not trained on)"
    assert [point[0] for point in evaluation["stages"]["fine-tuning"]] == [0, 4]  # at the start and the end
    assert evaluation["perplexity"] > 0 and evaluation["original_perplexity"] > 0
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    first_eval = next(entry for entry in state["log_history"] if "eval_loss" in entry)
    assert first_eval["eval_perplexity"] == pytest.approx(math.exp(first_eval["eval_loss"]))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "runs").glob("*")))).Reload()
    assert "eval/perplexity" in events.Tags()["scalars"]

    card = (out / "README.md").read_text()  # the card, as convert's: held-out section, data format, norm figure
    assert "### Held-out perplexity" in card
    assert stated_data_format(card) == {"format": "language_modeling", "loss_on": "every token"}
    assert "figures/norm_history.png" in card and "huggingface/trl" not in card  # TRL's own card is not written

    assert _finetune(*flags, "--max-steps", "4", model=tiny_lm_dir, out=out) == 2  # would overwrite: refused
    changed = [flag if flag != "x^3/16" else "x/1" for flag in flags]
    assert _finetune(*changed, "--max-steps", "6", "--resume", model=tiny_lm_dir, out=out) == 2
    assert "normalization: 'x^3/16' then, 'x/1' now" in capsys.readouterr().err
    assert _finetune(*flags, "--max-steps", "6", "--resume", model=tiny_lm_dir, out=out) == 0
    assert [line["step"] for line in history_lines(out / "norms.jsonl")] == [2, 4, 6]
    assert json.loads((out / "finetune.json").read_text())["global_step"] == 6


def test_resume_checks_the_data_the_model_folder_and_the_stored_settings(tmp_path, text_file, capsys):
    """A resumed run must be the run that was interrupted: a data file edited or a model folder rewritten under the
    same path is refused, naming what changed, before the model loads; so is a run folder without its settings
    record (the check used to be skipped then). The same inputs resume."""
    import shutil

    data, model = tmp_path / "lines.txt", save_tiny_lm(tmp_path / "model")
    shutil.copy(text_file, data)
    out = tmp_path / "run"
    flags = ["--dataset", str(data), "--normalization", "x/16", "--save-steps", "2", "--batch-size", "2",
             "--report-to", "none", "--logging-steps", "2"]
    assert _finetune(*flags, "--max-steps", "2", model=model, out=out) == 0
    capsys.readouterr()

    data.write_text(text_file.read_text().replace("lighthouse", "lightship", 1))
    assert _finetune(*flags, "--max-steps", "4", "--resume", model=model, out=out) == 2
    assert "these changed since: the training examples" in capsys.readouterr().err
    shutil.copy(text_file, data)

    hf_knorm.save_pretrained(lm(seed=1), model, tokenizer=char_tokenizer())  # other weights, same path and shapes
    assert _finetune(*flags, "--max-steps", "4", "--resume", model=model, out=out) == 2
    assert "these changed since: the model folder (its config or weight files)" in capsys.readouterr().err
    save_tiny_lm(model)

    settings = out / "finetune_settings.json"
    record = settings.read_text()
    settings.unlink()
    assert _finetune(*flags, "--max-steps", "4", "--resume", model=model, out=out) == 2
    assert "holds no record of the settings its run started with" in capsys.readouterr().err
    settings.write_text(record)
    assert _finetune(*flags, "--max-steps", "4", "--resume", model=model, out=out) == 0


def test_resume_without_a_checkpoint_is_refused(tmp_path, tiny_lm_dir, text_file, capsys):
    assert _finetune("--dataset", str(text_file), "--resume", model=tiny_lm_dir, out=tmp_path / "new") == 2
    assert "no checkpoint-* folder" in capsys.readouterr().err


def test_a_datasets_name_that_cannot_be_loaded_says_what_was_tried(tmp_path, tiny_lm_dir, capsys, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail at once, as with no network
    monkeypatch.chdir(tmp_path)
    assert _finetune("--dataset", "some/name", model=tiny_lm_dir, out=tmp_path / "run") == 2
    error = capsys.readouterr().err
    assert "No such file" not in error
    assert ("tried datasets.load_dataset('some/name', split='train'), as a datasets name (there is no local file or "
            "folder some/name), which failed: ConnectionError: Couldn't reach 'some/name' on the Hub") in error


class _Loaded(Exception):
    pass


def test_a_bf16_checkpoint_is_finetuned_in_fp32_weights(text_file, tmp_path, monkeypatch):
    """Mixed precision is autocast over fp32 weights and optimizer state (``runs/precision.py``): a checkpoint saved
    in bf16 is loaded in fp32, not trained in its saved dtype (Transformers 5 loads ``dtype="auto"``)."""
    import torch

    from hf_knorm.data import heldout

    folder = tmp_path / "bf16_lm"
    lm().to(torch.bfloat16).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    seen = {}

    def first_measure(model, *args, **kwargs):  # the held-out perplexity before training: the model as loaded
        seen["dtypes"] = {parameter.dtype for parameter in model.parameters()}
        raise _Loaded

    monkeypatch.setattr(heldout, "held_out_perplexity", first_measure)
    with pytest.raises(_Loaded):
        _finetune("--dataset", str(text_file), "--max-steps", "1", model=folder, out=tmp_path / "run")
    assert seen["dtypes"] == {torch.float32}
