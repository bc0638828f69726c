"""The default conversion's training step against the original model's: a forward and backward of the default model
patched with what ``hf-knorm convert`` converts to by default (``ConvertSettings().target()``: ``x/1 + softmax window
64 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters 600``, codebooks fitted on the essays as ``convert`` fits them;
a step's time does not depend on trained weights), and of the unpatched model,
on the same ``batch x block`` tokens (2 x 512: the recovery's micro-batch), in alternated rounds in one process, so
that drifting load hits both. What the recovery of ``hf-knorm convert`` pays per step for the composition.

Usage: ``OMP_NUM_THREADS=2 python scripts/conversion/bench_training_step.py --rounds 5`` (2 quiet cores; ~3 minutes)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import hf_knorm
from hf_knorm.assets.default_model import load_default_model
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.conversion.clusters import add_clusters
from hf_knorm.conversion.settings import DEFAULT_BATCH_SIZE, DEFAULT_BLOCK_SIZE, ConvertSettings
from hf_knorm.normalizations import with_clusters


def step(model, inputs: torch.Tensor) -> tuple[float, float]:
    """Seconds of one forward and backward of ``model`` on ``inputs`` (next-token loss), and the loss."""
    start = time.perf_counter()
    loss = model(inputs, labels=inputs).loss
    loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed steps of each model (after one warm-up each)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    args = parser.parse_args()
    torch.manual_seed(0)
    original, tokenizer = load_default_model()
    converted = copy.deepcopy(original)
    target = ConvertSettings().target()
    hf_knorm.patch(converted, with_clusters(target, 0))  # then the codebooks fitted, as convert does
    add_clusters(converted, tokenizer, target.clusters)
    original.train()
    converted.train()
    text = " ".join(paul_graham_essays()[:4])
    inputs = tokenizer(text, return_tensors="pt").input_ids[:, :args.block_size].repeat(args.batch_size, 1)
    models = {"original (SDPA)": original, "default conversion": converted}
    losses = {name: step(model, inputs)[1] for name, model in models.items()}  # the warm-up steps
    times = {name: [] for name in models}
    for round_ in range(args.rounds):  # alternated order
        for name in (list(models) if round_ % 2 == 0 else list(models)[::-1]):
            times[name].append(step(models[name], inputs)[0])
    base = statistics.median(times["original (SDPA)"])
    print(f"torch threads {torch.get_num_threads()}; {args.batch_size} x {args.block_size} tokens; median of "
          f"{args.rounds} alternated steps\n")
    print("| model | forward + backward (s) | x the original's | loss |\n|---|---:|---:|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} [{min(values):.2f}-{max(values):.2f}] | {median / base:.2f}x | "
              f"{losses[name]:.6f} |")


if __name__ == "__main__":
    main()
