"""Benchmark: decoding on the default model against the context length, softmax's K/V cache against x/1's state.

SmolLM2-135M-Instruct, batch 1, fp32: for each context length the cache is filled (random content: the cost of a step
does not depend on it) and the model decodes ``--new-tokens`` tokens, one forward each; reported are the median time
per token, the cache bytes, and both as ratios to the shortest context (the targets: x/1's bytes constant within 1%,
its time per token at 32k at most 1.1x that at 1k). The same measurement (:func:`hf_knorm.evaluation.decoding_cost.
decoding_cost`) draws the demo's decoding figure.

Usage:
    python scripts/attention/bench_decoding.py --lengths 1024,2048,4096,8192,16384,32768 --figure docs/figures/linear/decoding.png
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_knorm import load_default_model
from hf_knorm.evaluation.decoding_cost import decoding_cost, plot_decoding_cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: timings on a shared machine measure the code, not the load)")
    parser.add_argument("--figure", help="draw cache size and time per token against the context")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    model, _ = load_default_model()
    rows = decoding_cost(model, lengths, new_tokens=args.new_tokens)
    print(f"SmolLM2-135M-Instruct, batch 1, fp32, torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"median of {args.new_tokens} tokens")
    print("| normalization | context | cache MiB | vs shortest | ms per token | vs shortest |")
    print("|---|---|---|---|---|---|")
    for name in dict.fromkeys(row["normalization"] for row in rows):
        picked = [row for row in rows if row["normalization"] == name]
        first = picked[0]
        for row in picked:
            print(f"| {name} | {row['context']} | {row['cache_bytes'] / 2**20:.2f} | "
                  f"{row['cache_bytes'] / first['cache_bytes']:.3f}x | {row['seconds_per_token'] * 1e3:.1f} | "
                  f"{row['seconds_per_token'] / first['seconds_per_token']:.2f}x |")
    if args.figure:
        print(f"figure: {plot_decoding_cost(rows, args.figure)}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
