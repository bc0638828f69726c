"""Why KVzap's score works only with KVzip's budget on the default model: what each budget keeps of one context.

On a 2,000-token Paul Graham prefix in the chat template (the needle grid's haystack and protocol), prefilled into a
``KNormCache(score="kvzap")`` at ratios 0.5 and 0.75: under the uniform per-head budget without sinks, how many of the
30 x 3 KV heads keep the first token; under KVzip's budget without sinks (``head_budget="heads"``, ``head_floor=0``,
``layer_budget="global"``), the pairs each head keeps (min, median, max). Written up in docs/results/knorm.md, "KVzap".

Usage: ``OMP_NUM_THREADS=1 python research/2026-12/kvzap_budgets.py``
"""

from __future__ import annotations

import torch

import hf_knorm
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.compat import cache_kwargs
from hf_knorm.eviction.pipeline import encode_prompt, knorm_cache_for


@torch.no_grad()
def prefilled(model, ids: torch.Tensor, **options):
    cache = knorm_cache_for(model, recorded_defaults=False, score="kvzap", **options)
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    return cache


def main() -> None:
    model, tokenizer = hf_knorm.load_default_model()
    body = tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]
    ids = encode_prompt(tokenizer, tokenizer.decode(body[:2000]), "?")[0]
    print(f"{ids.shape[1]} context tokens\n")
    print("| ratio | uniform: heads keeping the first token | global: pairs per head, min / median / max |")
    print("|---:|---:|---:|")
    for ratio in (0.5, 0.75):
        uniform = prefilled(model, ids, compression_ratio=ratio)
        first = sum(int((layer.positions[0, head] == 0).any()) for layer in uniform.layers
                    for head in range(layer.positions.shape[1]))
        heads = sum(layer.positions.shape[1] for layer in uniform.layers)
        shared = prefilled(model, ids, compression_ratio=ratio, head_budget="heads", head_floor=0.0,
                           layer_budget="global")
        counts = torch.stack([shared.stored_per_head(index)[0] for index in range(len(shared.layers))]).float()
        print(f"| {ratio:g} | {first} of {heads} | {counts.min():.0f} / {counts.median():.0f} / {counts.max():.0f} |")


if __name__ == "__main__":
    main()
