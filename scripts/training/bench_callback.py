"""Training throughput with NormLoggerCallback logging every 10 steps, against no callback, in one run.

The same model (a Llama from a config, random init, seed 0), the same data (random token blocks, seed 0) and the
same Trainer settings (logging_steps=10 in both, so the Trainer's own logging is in both), alternated repetition by
repetition (none, callback, none, callback, ...) so that a change in the machine's load hits both alike. Throughput
is counted between the end of the warm-up steps and the end of the run, from a timing callback (Trainer setup and
the first steps excluded); the ratio is taken per repetition, then the median over repetitions. Two model states:
patched with x^3/16 (the norms are read from the attention the model runs anyway), and not patched (SDPA; on
logging steps the callback runs it through hf_knorm's softmax).

    python scripts/training/bench_callback.py                       # ~5 min on a 2-core CPU
    python scripts/training/bench_callback.py --hidden 256 --block 256 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers as tf

import hf_knorm


class StepClock(tf.TrainerCallback):
    """Wall-clock time at the end of every optimizer step."""

    def __init__(self):
        self.times: dict[int, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.times[state.global_step] = time.perf_counter()


def build_model(settings, normalization: str | None):
    config = tf.LlamaConfig(vocab_size=settings.vocab, hidden_size=settings.hidden,
                            intermediate_size=4 * settings.hidden, num_hidden_layers=settings.layers, num_attention_heads=settings.heads,
                            num_key_value_heads=settings.heads // 2, max_position_embeddings=settings.block)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    if normalization:
        hf_knorm.patch(model, normalization)
    return model.train()


def run_once(settings, normalization: str | None, with_callback: bool, data) -> float:
    """Tokens per second over the steps after the warm-up."""
    clock = StepClock()
    callbacks = [clock] + ([hf_knorm.NormLoggerCallback()] if with_callback else [])
    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(
            output_dir=out, max_steps=settings.steps, logging_steps=10, per_device_train_batch_size=settings.batch,
            learning_rate=1e-4, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
            data_seed=0, dataloader_pin_memory=False,
        )
        trainer = tf.Trainer(model=build_model(settings, normalization), args=args, train_dataset=data,
                             callbacks=callbacks)
        trainer.remove_callback(tf.trainer_callback.PrinterCallback)  # no console output inside the timing
        trainer.train()
    steps = settings.steps - settings.warmup
    seconds = clock.times[settings.steps] - clock.times[settings.warmup]
    return steps * settings.batch * settings.block / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (logging every 10)")
    parser.add_argument("--warmup", type=int, default=10, help="steps not timed")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--block", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    settings = parser.parse_args()
    torch.set_num_threads(settings.threads)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, settings.vocab, (settings.steps * settings.batch, settings.block), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in ids]
    tf.logging.set_verbosity_error()

    print(f"Llama {settings.layers} layers, width {settings.hidden}, {settings.heads} heads; batch {settings.batch} x "
          f"{settings.block} tokens; {settings.steps} steps ({settings.warmup} not timed); "
          f"{settings.repeats} interleaved repeats; {settings.threads} thread(s)")
    rows = []
    for label, normalization in (("x^3/16 (patched)", "x^3/16"), ("softmax (not patched, SDPA)", None)):
        plain, logged = [], []
        for repeat in range(settings.repeats):
            plain.append(run_once(settings, normalization, False, data))
            logged.append(run_once(settings, normalization, True, data))
            print(f"  {label} repeat {repeat + 1}: {plain[-1]:.0f} vs {logged[-1]:.0f} tokens/s", flush=True)
        ratios = [b / a for a, b in zip(plain, logged)]
        rows.append((label, statistics.median(plain), statistics.median(logged), statistics.median(ratios),
                     min(ratios), max(ratios)))
    print("\n| model | no callback (tokens/s) | callback every 10 steps (tokens/s) | ratio (median) | ratio range |")
    print("|---|---|---|---|---|")
    for label, plain, logged, ratio, low, high in rows:
        print(f"| {label} | {plain:.0f} | {logged:.0f} | {ratio:.3f}x | {low:.3f}-{high:.3f} |")


if __name__ == "__main__":
    main()
