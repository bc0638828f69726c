"""The work a conversion does on the original model outside the Trainer (its held-out perplexity, the teacher
samples, the probe) runs where the Trainer trains and in its precision, once, and its size fits the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import convert_processes_run  # noqa: E402
from test_general_conversion import chat_tokenizer  # noqa: E402
from training_helpers import lm  # noqa: E402

from hf_knorm.conversion import teacher_text  # noqa: E402
from hf_knorm.jobs.convert import run_convert  # noqa: E402
from hf_knorm.conversion.settings import ConvertSettings  # noqa: E402
from hf_knorm.evaluation import probe  # noqa: E402
from hf_knorm.data import heldout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(eval_domains=("essays",), block_size=32, batch_size=1, eval_tokens=64, eval_steps=1, transfer_steps=1,
             recovery_steps=1, logging_steps=1, save_steps=1, warmup_steps=0, report_to=("none",),
             beyond_window_block=300, retrieval_lengths=(300,), cluster_tokens=600)


@pytest.fixture(scope="module")
def chat_lm_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_lm")
    lm().save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder


def test_the_original_is_measured_sampled_and_probed_in_the_runs_precision(chat_lm_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """--bf16: every call on the original model (and the converted model's probe) runs under the Trainer's bf16
    autocast on the Trainer's device (they ran in fp32, so a bf16 run divided its evaluations by an fp32 baseline);
    the teacher samples are sized to the run (2 steps of 1 example: 2 samples' worth, not 65,536 tokens) and
    their cost is announced before they are drawn."""
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS_FILE", str(calls))
    monkeypatch.setattr(teacher_text, "_cache_root", lambda: tmp_path / "teacher_text")
    for module, name in ((teacher_text, "_sample"), (heldout, "held_out_perplexity"), (probe, "ask")):
        convert_processes_run.recorded(module, name, monkeypatch.setattr)
    run_convert(ConvertSettings(model=str(chat_lm_dir), out=str(tmp_path / "run"), bf16=True, **SMALL))
    lines = calls.read_text().splitlines()
    assert {line.split()[1] for line in lines} == {"_sample", "held_out_perplexity", "ask"}
    assert all(line.endswith(" cpu bfloat16") for line in lines), lines
    cost = teacher_text.sampling_cost(chat_lm_dir, 2 * teacher_text.NEW_TOKENS_PER_SAMPLE)
    assert cost is not None and cost["asked"] == 2 * 256
    out = capsys.readouterr().out
    assert ("Teacher samples: drawing 512 new tokens (up to 2 samples of 256, 2 at a time) from the original model "
            "on cpu") in out


def test_two_processes_sample_evaluate_and_probe_the_original_once(chat_lm_dir, tmp_path):
    """Under torchrun the main process does the original model's work and the other waits for it (each process
    drew the 65,536 teacher tokens itself, at once); both finish, one record is written."""
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CALLS_FILE=str(calls),
               TEACHER_CACHE=str(tmp_path / "teacher_text"))
    flags = ["convert", "--model", str(chat_lm_dir), "--out", str(tmp_path / "run"), "--eval-domains", "essays",
             "--block-size", "32", "--batch-size", "1", "--eval-tokens", "64", "--eval-steps", "1",
             "--transfer-steps", "1", "--recovery-steps", "1", "--logging-steps", "1", "--save-steps", "1",
             "--warmup-steps", "0", "--report-to", "none", "--beyond-window-block", "300", "--retrieval-lengths", "300",
             "--cluster-tokens", "600"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__).resolve().parent / "convert_processes_run.py"), *flags]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    by_call = {}
    for line in calls.read_text().splitlines():
        rank, name = line.split()[:2]
        by_call.setdefault(name, []).append(rank)
    assert by_call["_sample"] == ["0"]  # drawn once, 4 examples' worth (1 + 1 steps x 1 x 2 processes)
    assert set(by_call["held_out_perplexity"]) == {"0"} and set(by_call["ask"]) == {"0"}
    assert len(by_call["ask"]) == 2  # the original and the converted model, once each
    record = json.loads((tmp_path / "run" / "convert.json").read_text())
    assert record["training_data"]["teacher_sampling"]["asked"] == 4 * 256
    assert record["probe"]["answers"] and result.stdout.count("Teacher samples: drawing") == 1


def test_finetune_measures_its_starting_model_in_the_runs_precision(chat_lm_dir, tmp_path, monkeypatch):
    """finetune --bf16: the starting model's held-out perplexity (the card's baseline) is measured under the
    Trainer's bf16 autocast, as the Trainer's own evaluations are (it was fp32)."""
    from hf_knorm.cli import main

    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS_FILE", str(calls))
    convert_processes_run.recorded(heldout, "held_out_perplexity", monkeypatch.setattr)
    data = tmp_path / "lines.txt"
    data.write_text("".join(f"Line {i}: the keeper counted {i * 7 % 13} ships.\n" for i in range(20)))
    assert main(["finetune", "--model", str(chat_lm_dir), "--dataset", str(data), "--out", str(tmp_path / "run"),
                 "--block-size", "32", "--eval-tokens", "32", "--max-steps", "1", "--eval-steps", "1",
                 "--batch-size", "1", "--report-to", "none", "--bf16"]) == 0
    assert calls.read_text().splitlines() == ["0 held_out_perplexity cpu bfloat16"]


def test_the_stages_pad_examples_of_several_lengths_as_trls_sft_trainer_does():
    """The conversion's collator (Transformers' public DataCollatorForSeq2Seq, right padding) gives the batch TRL's
    SFTTrainer collator gives (imported here as the oracle only: it is not TRL's public API)."""
    import datasets
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_knorm.jobs.convert import examples_collator

    tokenizer = chat_tokenizer()
    tokenizer.padding_side = "left"  # the job's tokenizer may pad on the left (generation): the stages still pad right
    examples = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [9, 10], "labels": [9, 10]}]
    ours = examples_collator(datasets.Dataset.from_list(examples), tokenizer)(examples)
    trl = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)(examples)
    assert set(ours) == set(trl) == {"input_ids", "labels", "attention_mask"}
    for key in trl:
        assert torch.equal(ours[key], trl[key]), key
    assert tokenizer.padding_side == "left"
