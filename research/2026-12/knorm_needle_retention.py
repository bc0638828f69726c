"""Why KNorm loses the needle on SmolLM2-135M: which of the needle's digit tokens each layer keeps.

Builds the NIAH sample of ``hf-knorm niah`` (1000 tokens, depth 0.5, seed 0), prefills it once and, for each ratio,
prints per layer the number of KV heads (of 3) that keep all 7 digit tokens of the needle, and the fraction of
(head, digit) pairs kept. Exact copying of a 7-digit number needs the digits' keys; KNorm keeps a token only if its
key norm is among the lowest of its head. ``--scores`` repeats the count for other eviction scores
(``hf-knorm niah --scores`` entries) and ends with a one-line summary per score and ratio.

Usage: ``OMP_NUM_THREADS=1 python research/2026-12/knorm_needle_retention.py --ratios 0.25,0.5``
       ``OMP_NUM_THREADS=1 python research/2026-12/knorm_needle_retention.py --ratios 0.5 --scores key_norm,kv_diff``
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

import hf_knorm
from hf_knorm.evaluation.needle import haystack, make_sample, parse_score_spec
from hf_knorm.eviction.cache import KNormCache
from hf_knorm.eviction.pipeline import split_prompt
from hf_knorm.eviction.reconstruction import compress_by_reconstruction


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--depth", type=float, default=0.5)
    parser.add_argument("--rank-layers", default="5,23", help="layers whose digit-key norm percentiles to print")
    parser.add_argument("--scores", default="key_norm", help="comma-separated eviction scores (default key_norm)")
    args = parser.parse_args()
    model, tokenizer = hf_knorm.load_default_model()
    sample = make_sample("niah", tokenizer, haystack("niah", tokenizer), args.length, args.depth, seed=0)
    context, _ = split_prompt(tokenizer, sample["context"], sample["question"])
    encoded = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)
    start = context.index(sample["expected"])
    digits = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a >= start and start + 7 >= b > a]
    print(f"needle number {sample['expected']} at token positions {digits}")
    full = model(input_ids=torch.tensor([encoded["input_ids"]]), cache=DynamicCache(), use_cache=True).cache
    n = len(encoded["input_ids"])
    for layer in (int(x) for x in args.rank_layers.split(",")):
        norms = full.layers[layer].keys[0].norm(dim=-1)  # (H_kv, n)
        percentile = norms.argsort(-1).argsort(-1).float() / (n - 1)
        print(f"layer {layer}: norm percentile of the digit keys, per head:",
              [[round(float(percentile[h, d]), 2) for d in digits] for h in range(norms.shape[0])])
    summary = []
    for spec in (entry.strip() for entry in args.scores.split(",") if entry.strip()):
        for ratio in (float(r) for r in args.ratios.split(",")):
            cache = KNormCache.from_dynamic_cache(full, compression_ratio=ratio, **parse_score_spec(spec))
            if cache.awaits_importance():  # kvzip: scored by the context's reconstruction, after the prefill
                compress_by_reconstruction(model, cache, torch.tensor([encoded["input_ids"]]), tokenizer)
            heads_all, fractions = [], []
            for layer in range(len(cache.layers)):
                positions = cache.kept_positions(layer)[0]  # (H_kv, kept)
                kept = torch.stack([(positions == d).any(-1) for d in digits], dim=-1)  # (H_kv, 7)
                heads_all.append(int(kept.all(-1).sum()))
                fractions.append(round(float(kept.float().mean()), 2))
            print(f"{spec} r={ratio:g}: heads keeping all digits, per layer: {heads_all}")
            print(f"{spec} r={ratio:g}: fraction of digit tokens kept, per layer: {fractions}")
            first = [round(float(torch.stack([(cache.kept_positions(layer)[0] == p).any(-1) for p in range(4)],
                                             -1).float().mean()), 2) for layer in range(len(cache.layers))]
            print(f"{spec} r={ratio:g}: fraction of the first 4 tokens kept, per layer: {first}")
            summary.append(f"| {spec} | {ratio:g} | {sum(h > 0 for h in heads_all)} of {len(heads_all)} | "
                           f"{sum(heads_all)} of {kept.shape[0] * len(heads_all)} | "
                           f"{sum(fractions) / len(fractions):.2f} |")
    print("\n| score | ratio | layers with a head keeping all digits | heads keeping all digits | "
          "digit tokens kept (mean) |\n|---|---:|---:|---:|---:|")
    print("\n".join(summary))

if __name__ == "__main__":
    main()
