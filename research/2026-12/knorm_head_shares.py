"""How far AdaKV's head budget moves KNorm's selection on the default model, and what its scoring step costs.

On a 2000-token Paul Graham prefix (prefilled once into a ``DynamicCache``), for ``key_norm``, ``kv_diff`` and
``key_diff`` at ratios 0.5 and 0.9: each head's kept count under ``head_budget="heads"`` as a multiple of its uniform
share, and the overlap of its kept positions with the uniform cache's. Then, on a 4000-token prefix, the scoring and
eviction step alone (``KNormCache.from_dynamic_cache``, ``kv_diff`` r=0.5) uniform vs heads vs heads + the dispersion
schedule, 7 interleaved rounds, as a share of that prefill. Written up in docs/results/knorm.md, "Head- and
layer-adaptive budgets".

Usage: ``OMP_NUM_THREADS=1 python research/2026-12/knorm_head_shares.py``
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

import hf_knorm
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.eviction.cache import KNormCache


def prefill(model, ids: torch.Tensor) -> tuple[DynamicCache, float]:
    with torch.no_grad():
        cache, began = DynamicCache(), time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache, time.perf_counter() - began


def head_shares(model, full: DynamicCache) -> None:
    layers = model.config.num_hidden_layers
    for score in ("key_norm", "kv_diff", "key_diff"):
        for ratio in (0.5, 0.9):
            options = dict(config=model.config, compression_ratio=ratio, score=score)
            heads = KNormCache.from_dynamic_cache(full, head_budget="heads", **options)
            uniform = KNormCache.from_dynamic_cache(full, **options)
            counts = torch.stack([heads.stored_per_head(layer)[0].float() for layer in range(layers)])  # (L, H_kv)
            share = counts / counts.mean(dim=1, keepdim=True)
            overlap = []
            for layer in range(layers):
                kept, base = heads.kept_positions(layer)[0], uniform.kept_positions(layer)[0]
                for head in range(kept.shape[0]):
                    ours, theirs = set(kept[head][kept[head] >= 0].tolist()), set(base[head].tolist())
                    overlap.append(len(ours & theirs) / len(theirs))
            moved = int(((share - 1).abs() > 0.1).sum())
            print(f"{score} r={ratio}: head share of uniform {share.min():.2f}-{share.max():.2f}, {moved}/{share.numel()} "
                  f"heads off by >10%; kept-set overlap median {statistics.median(overlap):.2f}, min {min(overlap):.2f}")


def eviction_cost(model, full: DynamicCache, prefill_seconds: float) -> None:
    variants = {"uniform": {}, "heads": {"head_budget": "heads"},
                "heads+dispersion": {"head_budget": "heads", "layer_budget": "dispersion"}}
    times = {name: [] for name in variants}
    for _ in range(7):
        for name, options in variants.items():
            began = time.perf_counter()
            KNormCache.from_dynamic_cache(full, config=model.config, compression_ratio=0.5, score="kv_diff", **options)
            times[name].append(time.perf_counter() - began)
    base = statistics.median(times["uniform"])
    print(f"prefill of {full.get_seq_length()} tokens: {prefill_seconds:.1f} s")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name}: {1000 * median:.0f} ms [{1000 * min(samples):.0f}-{1000 * max(samples):.0f}], "
              f"{median / base:.2f}x uniform, {100 * median / prefill_seconds:.2f}% of the prefill")


def main() -> None:
    model, tokenizer = hf_knorm.load_default_model()
    ids = tokenizer("\n\n".join(paul_graham_essays()), return_tensors="pt").input_ids
    head_shares(model, prefill(model, ids[:, :2000])[0])
    eviction_cost(model, *prefill(model, ids[:, :4000]))


if __name__ == "__main__":
    main()
