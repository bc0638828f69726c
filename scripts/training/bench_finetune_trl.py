"""Benchmark: fine-tuning text through TRL's SFTTrainer (what ``hf-knorm finetune`` runs) against the plain Trainer
(what it ran before), same model, same blocks, same settings, in the same run.

The default model (SmolLM2-135M-Instruct) patched with ``--normalization``, the Paul Graham essays packed into blocks of
``--block-size`` (``hf_knorm.data.text_data.pack_dataset``), ``--steps`` optimizer steps of ``--batch-size`` blocks
per arm; the arms alternate ``--repeats`` times (Trainer, SFTTrainer, Trainer, ...), each from the same weights, and
the time of each run's first ``--warmup`` steps is left out (a step callback stamps every step). Reported: tokens per
second of each run, their medians and the ratio SFTTrainer / Trainer (the target: at least 0.95), and the first losses
of both arms (the same examples in the same order: they must agree).

Usage:
    python scripts/training/bench_finetune_trl.py --steps 12 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
import transformers

from hf_knorm import load_default_model, patch
from hf_knorm.data.text_data import load_text_dataset, pack_dataset
from hf_knorm.runs.precision import precision_arguments
from hf_knorm.runs.sft import SFTPerplexityTrainer, sft_config


class StepClock(transformers.TrainerCallback):
    """The wall time at the end of every optimizer step."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def run(arm: str, model, tokenizer, blocks, args, out: str) -> tuple[float, list[float]]:
    """One run of ``arm``; returns (tokens per second after the warm-up steps, the logged losses)."""
    settings = dict(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                    learning_rate=5e-5, warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
                    disable_tqdm=True, seed=0, data_seed=0, dataloader_pin_memory=False,
                    **precision_arguments(False))
    clock = StepClock()
    if arm == "Trainer":
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**settings),
                                       train_dataset=blocks, data_collator=transformers.default_data_collator,
                                       callbacks=[clock])
    else:
        trainer = SFTPerplexityTrainer(model=model, args=sft_config(args.block_size, **settings), train_dataset=blocks,
                                       processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    timed = clock.ends[args.warmup - 1:]
    seconds = timed[-1] - timed[0]
    tokens = (len(timed) - 1) * args.batch_size * args.block_size
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return tokens / seconds, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--normalization", default="x^3/16")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=256)
    args = parser.parse_args()
    original, tokenizer = load_default_model()
    patch(original, args.normalization)
    blocks = pack_dataset(load_text_dataset("paul-graham"), tokenizer, args.block_size,
                          max_blocks=args.steps * args.batch_size)
    speeds = {"Trainer": [], "SFTTrainer": []}
    losses = {}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeats):
            for arm in speeds:
                model = copy.deepcopy(original).train()
                speed, losses[arm] = run(arm, model, tokenizer, blocks, args, out)
                speeds[arm].append(speed)
                print(f"{arm}: {speed:.1f} tokens/s", flush=True)
    print(f"\nSmolLM2-135M-Instruct patched with {args.normalization}, {args.steps} steps of {args.batch_size} x "
          f"{args.block_size} tokens (first {args.warmup} left out), {args.repeats} runs per arm, torch "
          f"{torch.__version__}, threads={torch.get_num_threads()}")
    print("| trainer | tokens/s per run | median |")
    print("|---|---|---:|")
    for arm, values in speeds.items():
        print(f"| {arm} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")
    ratio = statistics.median(speeds["SFTTrainer"]) / statistics.median(speeds["Trainer"])
    print(f"\nSFTTrainer / Trainer: {ratio:.3f}x (median / median)")
    print(f"first losses: Trainer {losses['Trainer'][:3]}, SFTTrainer {losses['SFTTrainer'][:3]}")


if __name__ == "__main__":
    main()
