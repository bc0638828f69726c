"""The jobs in several processes: under torchrun and accelerate launch, 2 CPU processes (gloo) train the same steps as
1 process holding the same global batch through gradient accumulation, only the main process writes the run folder,
and --resume works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from training_helpers import history_lines, save_tiny_lm

from hf_knorm.runs.precision import has_accelerator

ROOT = Path(__file__).resolve().parents[2]
LINES = [f"Line {i}: the lighthouse keeper counted {i * 7 % 13} ships and wrote their names down." for i in range(40)]


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "configs" / "accelerate_cpu.yaml")],
}


def _finetune(out, *flags, processes: int = 1, launcher: str = "torchrun", timeout: int = 300):
    """Run ``hf-knorm finetune`` in ``processes`` processes (``launcher`` for two); returns the result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = (LAUNCHERS[launcher] if processes > 1 else [sys.executable]) + [
        "-m", "hf_knorm.cli", "finetune", "--out", str(out), *flags]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _losses(out) -> dict[int, float]:
    state = json.loads((Path(out) / "finetune.json").read_text())
    checkpoint = max(Path(out).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    assert state["global_step"] == max(entry["step"] for entry in history)
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def test_two_processes_train_like_one_with_gradient_accumulation_and_resume(tmp_path):
    model = save_tiny_lm(tmp_path / "model")
    data = tmp_path / "lines.txt"
    data.write_text("\n".join(LINES) + "\n")
    common = ["--model", str(model), "--dataset", str(data), "--normalization", "x^3/16", "--block-size", "32",
              "--logging-steps", "1", "--save-steps", "3", "--eval-steps", "3", "--eval-tokens", "64",
              "--report-to", "none", "--learning-rate", "1e-3", "--warmup-steps", "0"]
    _finetune(tmp_path / "one", *common, "--max-steps", "5", "--batch-size", "2", "--gradient-accumulation-steps", "2")
    _finetune(tmp_path / "two", *common, "--max-steps", "5", "--batch-size", "2", processes=2)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3, 4, 5]
    for step in one:  # fp32, the same 4 blocks per step: equal but for the order of floating-point sums
        assert two[step] == pytest.approx(one[step], rel=1e-4), step
    # written once, by the main process: each logging step once in norms.jsonl, one card, one record
    assert [line["step"] for line in history_lines(tmp_path / "two" / "norms.jsonl")] == [1, 2, 3, 4, 5]
    assert (tmp_path / "two" / "README.md").is_file() and (tmp_path / "two" / "finetune.json").is_file()
    assert not list((tmp_path / "two").glob("*.partial"))

    # the same with accelerate launch (the README's command)
    _finetune(tmp_path / "accelerate", *common, "--max-steps", "5", "--batch-size", "2", processes=2,
              launcher="accelerate")
    accelerated = _losses(tmp_path / "accelerate")
    assert accelerated == pytest.approx(one, rel=1e-4)

    # resumed in two processes (torchrun) from the run's last checkpoint: the history goes on, each step once
    _finetune(tmp_path / "accelerate", *common, "--max-steps", "7", "--batch-size", "2", "--resume", processes=2)
    assert [line["step"] for line in history_lines(tmp_path / "accelerate" / "norms.jsonl")] == [1, 2, 3, 4, 5, 6, 7]
    assert json.loads((tmp_path / "accelerate" / "finetune.json").read_text())["global_step"] == 7


def test_a_conversion_in_two_processes_trains_like_one_and_is_saved_once(tmp_path):
    """Distilled recovery (next-token loss + KL): the KL is scaled like the next-token loss, so 2 processes and 1
    process accumulating 2 micro-batches log the same losses; one model, one card, one record are written."""
    import hf_knorm

    model = save_tiny_lm(tmp_path / "model")
    common = ["--model", str(model), "--dataset", "paul-graham", "--eval-domains", "essays", "--no-probe",
              "--block-size", "32", "--batch-size", "2", "--eval-tokens", "64", "--eval-steps", "3",
              "--transfer-steps", "2", "--recovery-steps", "3", "--logging-steps", "1", "--save-steps", "3",
              "--warmup-steps", "0", "--max-blocks", "24", "--report-to", "none",
              "--beyond-window-block", "300", "--retrieval-lengths", "300", "--cluster-tokens", "600"]  # short measures

    def convert(out, *flags, processes=1):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        command = (launcher if processes > 1 else [sys.executable]) + [
            "-m", "hf_knorm.cli", "convert", "--out", str(out), *common, *flags]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    convert(tmp_path / "one", "--gradient-accumulation-steps", "2")
    convert(tmp_path / "two", processes=2)
    for stage in ("transfer", "recovery"):
        losses = []
        for run in ("one", "two"):
            history = json.loads((tmp_path / run / stage / "checkpoint-3" / "trainer_state.json").read_text()
                                 if stage == "recovery" else
                                 (max((tmp_path / run / stage).glob("checkpoint-*")) / "trainer_state.json")
                                 .read_text())["log_history"]
            losses.append([entry["loss"] for entry in history if "loss" in entry])
        assert losses[1] == pytest.approx(losses[0], rel=1e-4), stage
    record = json.loads((tmp_path / "two" / "convert.json").read_text())
    assert record["stages"]["recovery"]["tokens"] == 3 * 2 * 2 * 32  # steps x batch x processes x block
    assert (tmp_path / "two" / "README.md").is_file() and not list((tmp_path / "two").rglob("*.partial"))
    hf_knorm.from_pretrained(tmp_path / "two")  # one model, saved once, loads


@pytest.mark.skipif(has_accelerator(), reason="the refusal is for machines without an accelerator")
def test_fsdp_on_a_cpu_only_machine_is_refused_not_run_as_ddp(tmp_path):
    """accelerate ignores an FSDP config in a CPU process group (it would train plain DDP): the job says so instead."""
    model = save_tiny_lm(tmp_path / "model")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate_fsdp.yaml"), "-m", "hf_knorm.cli", "finetune", "--model", str(model),
               "--dataset", "paul-graham", "--out", str(tmp_path / "run"), "--report-to", "none"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "FSDP was requested" in result.stderr and "silently train with plain DDP" in result.stderr
    assert not (tmp_path / "run").exists()


def test_convert_refuses_fsdp_before_loading_a_model(tmp_path, monkeypatch, capsys):
    from hf_knorm.cli import main

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert main(["convert", "--model", str(save_tiny_lm(tmp_path / "model")), "--out", str(tmp_path / "run"),
                 "--report-to", "none"]) == 2
    assert "does not run under FSDP" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_the_jobs_prepare_their_data_with_the_main_process_first(tmp_path, monkeypatch):
    """The tokenizing and packing (datasets.map, whose cache files every process would write at once) run under
    accelerate's main_process_first: the main process fills the cache, the others then read it."""
    import contextlib

    import accelerate

    from hf_knorm.cli import main
    from hf_knorm.data import heldout

    events = []

    @contextlib.contextmanager
    def main_process_first(self):
        events.append("main first")
        yield
        events.append("the others")

    monkeypatch.setattr(accelerate.PartialState, "main_process_first", main_process_first)
    prepare = heldout.training_and_held_out
    monkeypatch.setattr(heldout, "training_and_held_out",
                        lambda *args, **kwargs: events.append("data") or prepare(*args, **kwargs))
    data = tmp_path / "lines.txt"
    data.write_text("\n".join(LINES) + "\n")
    assert main(["finetune", "--model", str(save_tiny_lm(tmp_path / "model")), "--dataset", str(data), "--out",
                 str(tmp_path / "run"), "--block-size", "32", "--eval-tokens", "32", "--max-steps", "1",
                 "--batch-size", "1", "--report-to", "none"]) == 0
    assert events[:3] == ["main first", "data", "the others"]
