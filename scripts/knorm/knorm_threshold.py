"""KVzap's threshold pruning on the default model: the share of the cache it evicts and the perplexity it costs, beside
KVzap's fixed ratios with KVzip's budget.

Windows of ``--context + --continuation`` tokens cut from the Paul Graham essays (the NIAH haystack), as
``knorm_perplexity.py`` cuts them. Per window the context is prefilled once and compressed by every row
(:func:`hf_knorm.evaluation.perplexity.perplexity_after_compression`); the continuation is then read teacher-forced
through the cache, one token per forward. A ``threshold`` row keeps evicting as it reads (each pair that leaves the last
``--window`` tokens below the threshold goes); a ratio row compresses the context only. Columns: the share of the pairs
seen that the cache no longer holds after the last token (``KNormCache.compression_achieved``, mean over windows) and
the perplexity against the uncompressed model's. Every row protects the first 4 tokens and the last ``--window``.

Usage: ``OMP_NUM_THREADS=1 python scripts/knorm/knorm_threshold.py --thresholds -6.1,-5.3,-4.3,-2.4 --windows 4``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import hf_knorm
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.evaluation.perplexity import perplexity_after_compression, token_windows

SINKS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--thresholds", default="-6.1,-5.3,-4.3,-2.4",
                        help="thresholds on KVzap's predicted log importance (default: about the 25th, 50th, 75th "
                             "and 90th percentiles of the default model's on one essay window)")
    parser.add_argument("--ratios", default="0.25,0.5,0.75,0.9", help="KVzap's fixed ratios beside them")
    parser.add_argument("--window", type=int, default=128, help="recent tokens never evicted (KVzap's: 128)")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("outputs/knorm_threshold"))
    args = parser.parse_args()
    protect = dict(score="kvzap", head_budget="heads", sink_tokens=SINKS, recent_window=args.window)
    variants = {"uncompressed": {}}
    for threshold in args.thresholds.split(","):
        variants[f"threshold {float(threshold):g}"] = dict(protect, threshold=float(threshold))
    for ratio in args.ratios.split(","):
        variants[f"ratio {float(ratio):g}, global budget"] = dict(protect, compression_ratio=float(ratio),
                                                                  head_floor=0.0, layer_budget="global")
    model, tokenizer = hf_knorm.load_default_model()
    windows = token_windows(tokenizer, "\n\n".join(paul_graham_essays()), window=args.context + args.continuation,
                            max_tokens=(args.context + args.continuation) * args.windows)
    began = time.time()
    results = perplexity_after_compression(model, windows, args.context, variants, tokenizer=tokenizer)
    base = results["uncompressed"].perplexity
    lines = [f"KVzap on the default model: {len(windows)} windows of {args.context} context + {args.continuation} "
             f"continuation tokens, sinks {SINKS}, window {args.window}; uncompressed perplexity {base:.2f}", "",
             "| row (`score=\"kvzap\"`) | pairs gone after the last token | perplexity |", "|---|---:|---:|"]
    for name, result in results.items():
        if name != "uncompressed":
            lines.append(f"| {name} | {result.compression:.1%} | {result.perplexity:.2f} "
                         f"({result.perplexity / base:.2f}x) |")
    table = "\n".join(lines)
    print(table)
    print(f"\n{time.time() - began:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "threshold.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
