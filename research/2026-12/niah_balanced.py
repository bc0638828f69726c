"""KNorm on a K/V-balanced model: which basis to score in (the cached keys, or the original ones)?

Per-channel balancing (``hf_knorm.balance_kv(mode="channel")``) stores keys as ``k / s``, an exact reparametrization
that changes key norms channel by channel, hence KNorm's ranking. This runs the needle grid on the default model
balanced per channel (calibrated on Shakespeare, disjoint from the Paul Graham haystack) with rows: uncompressed,
r=0.5 scored on the cached (balanced) keys, r=0.5 scored in the original basis (``||k * s||``). The unbalanced
model's r=0.5 row on the same cells comes from the main ``hf-knorm niah`` run (same seeds, same contexts). Last,
the fraction of kept (layer, head, token) entries the two bases share, on a 2000-token NIAH context.

Usage: ``OMP_NUM_THREADS=1 python research/2026-12/niah_balanced.py --lengths 1000,2000 --out outputs/niah_balanced``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_knorm
from hf_knorm.assets.texts import shakespeare_split
from hf_knorm.evaluation.needle import Variant, haystack, make_sample, run_needle, write_report
from hf_knorm.eviction.cache import KNormCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--tasks", default="niah")
    parser.add_argument("--out", type=Path, default=Path("outputs/niah_balanced"))
    args = parser.parse_args()
    model, tokenizer = hf_knorm.load_default_model()
    train, _ = shakespeare_split()
    report = hf_knorm.balance_kv(model, tokenizer, train[:8], mode="channel")
    print(f"balanced per channel (alpha {report.alpha}); max logit change {report.max_logit_change:.2e}")
    variants = [Variant("balanced r=0"),
                Variant("balanced r=0.5 cached basis", {"compression_ratio": 0.5}),
                Variant("balanced r=0.5 original basis", {"compression_ratio": 0.5}, score_basis="original")]
    records = run_needle(model, tokenizer, args.out, tasks=tuple(args.tasks.split(",")), variants=variants,
                         lengths=[int(n) for n in args.lengths.split(",")],
                         depths=[float(d) for d in args.depths.split(",")], seeds=args.seeds)
    print(write_report(records, args.out).read_text())
    print(f"kept-token overlap, cached vs original basis at r=0.5: {kept_overlap(model, tokenizer):.3f}")


@torch.no_grad()
def kept_overlap(model, tokenizer, length: int = 2000) -> float:
    """Fraction of the (layer, head, token) entries kept in the original basis that the cached basis keeps too."""
    sample = make_sample("niah", tokenizer, haystack("niah", tokenizer), length, 0.5, seed=0)
    ids = tokenizer(sample["context"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    full = model(input_ids=ids, cache=DynamicCache(), use_cache=True).cache
    original = KNormCache.from_dynamic_cache(full, compression_ratio=0.5, key_scales=hf_knorm.balancing.balance.key_scales(model.config))
    cached = KNormCache.from_dynamic_cache(full, compression_ratio=0.5)
    common = total = 0
    for layer in range(len(full.layers)):
        a, b = original.kept_positions(layer), cached.kept_positions(layer)  # (1, H_kv, kept)
        common += int((a[..., :, None] == b[..., None, :]).any(-1).sum())
        total += a.numel()
    return common / total


if __name__ == "__main__":
    main()
