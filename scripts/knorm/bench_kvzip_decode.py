"""Decode time per token through a KVzip cache under its own budget (one threshold over every layer and head, arXiv
2505.23416) against the recommended ``kv_diff`` cache, at the same ratio, where users call it.

For each length, the context (Paul Graham essays in the default model's chat template, as the
``knorm-text-generation`` pipeline compresses it) is prefilled into:

- ``kv_diff``: ``KNormCache(r, score="kv_diff")``, the uniform budget (the baseline);
- ``kvzip global``: ``KNormCache(r, score="kvzip", head_budget="heads", head_floor=0, layer_budget="global",
  sink_tokens=4)``, then ``compress_by_reconstruction``: each head keeps its own count, stored compactly
  (:mod:`hf_knorm.eviction.ragged`), decoded through the ``knorm_ragged`` attention;
- ``uncompressed``: a ``DynamicCache``, for scale.

Then single-token forwards, interleaved token by token (each cache takes one token in turn, the order rotated each
step, so the load of a shared machine hits them alike), each inside ``ragged_attention_for`` as ``knorm_generate``
runs it. Reported per length: the median ms/token of each cache, and the median [range over rounds] of the per-token
ratio to ``kv_diff``'s, by the wall clock; and the pairs each cache holds.

Usage: ``OMP_NUM_THREADS=1 python scripts/knorm/bench_kvzip_decode.py --lengths 2000,4000 --rounds 3``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import hf_knorm
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.compat import cache_kwargs
from hf_knorm.eviction.cache import KNormCache
from hf_knorm.eviction.pipeline import encode_prompt
from hf_knorm.eviction.ragged import ragged_attention_for
from hf_knorm.eviction.reconstruction import compress_by_reconstruction

CACHES = ("kv_diff", "kvzip global", "uncompressed")


@torch.no_grad()
def prefilled(model, tokenizer, ids: torch.Tensor, name: str, ratio: float):
    """The cache ``name`` holding the (1, n) context ``ids``, compressed as ``knorm_generate`` leaves it."""
    if name == "uncompressed":
        cache = DynamicCache()
    elif name == "kv_diff":
        cache = KNormCache(ratio, score="kv_diff", config=model.config)
    else:
        cache = KNormCache(ratio, score="kvzip", head_budget="heads", head_floor=0.0, layer_budget="global",
                           sink_tokens=4, config=model.config)
    with ragged_attention_for(model, cache):
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    if name == "kvzip global":
        compress_by_reconstruction(model, cache, ids, tokenizer)
    return cache


def held_pairs(cache) -> int:
    if isinstance(cache, KNormCache):
        return sum(int(cache.stored_per_head(index).sum()) for index in range(len(cache.layers)))
    return sum(layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] for layer in cache.layers)


@torch.no_grad()
def decode_round(model, caches: dict, start: int, steps: int) -> dict[str, list[float]]:
    """Per cache, the seconds of each of ``steps`` single-token forwards, interleaved token by token."""
    token = torch.tensor([[42]])
    seconds = {name: [] for name in caches}
    names = list(caches)
    for step in range(steps):
        for name in names[step % len(names):] + names[:step % len(names)]:
            with ragged_attention_for(model, caches[name]):
                began = time.perf_counter()
                model(input_ids=token, position_ids=torch.tensor([[start + step]]), **cache_kwargs(caches[name]),
                      use_cache=True)
                seconds[name].append(time.perf_counter() - began)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="2000,4000", help="context lengths in tokens")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each from freshly prefilled caches")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per cache and round")
    args = parser.parse_args()
    model, tokenizer = hf_knorm.load_default_model()
    body = tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]
    warm = encode_prompt(tokenizer, tokenizer.decode(body[:64]), "?")[0]
    decode_round(model, {name: prefilled(model, tokenizer, warm, name, args.ratio) for name in CACHES},
                 warm.shape[1], 2)  # first-call overheads stay out of the timings
    print(f"torch threads {torch.get_num_threads()}; SmolLM2-135M-Instruct fp32; r={args.ratio:g}; {args.rounds} "
          f"rounds of {args.steps} interleaved decode steps; ratio = median [range over rounds] of the per-round "
          "median of per-token ratios to kv_diff\n")
    print("| tokens | cache | pairs held | decode ms/token | x kv_diff |")
    print("|---:|---|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = encode_prompt(tokenizer, tokenizer.decode(body[:n]), "?")[0]
        per_token = {name: [] for name in CACHES}
        ratios = {name: [] for name in CACHES}
        pairs = {}
        for _ in range(args.rounds):
            caches = {name: prefilled(model, tokenizer, ids, name, args.ratio) for name in CACHES}
            pairs = {name: held_pairs(cache) for name, cache in caches.items()}
            seconds = decode_round(model, caches, ids.shape[1], args.steps)
            for name in CACHES:
                per_token[name].append(statistics.median(seconds[name]))
                ratios[name].append(statistics.median(t / b for t, b in zip(seconds[name], seconds["kv_diff"])))
        for name in CACHES:
            ratio = ratios[name]
            print(f"| {ids.shape[1]} | {name} | {pairs[name]:,} | {1000 * statistics.median(per_token[name]):.1f} | "
                  f"{statistics.median(ratio):.3f} [{min(ratio):.3f}, {max(ratio):.3f}] |", flush=True)


if __name__ == "__main__":
    main()
