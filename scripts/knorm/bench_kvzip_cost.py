"""KVzip's scoring cost (arXiv 2505.23416), and its surrogate KVzap's: prefill with ``score="kvzip"`` (or
``"kvzap"``) as a multiple of the uncompressed prefill.

For each length, the context (Paul Graham essays in the default model's chat template, what the
``knorm-text-generation`` pipeline compresses) is run, in interleaved rounds (the order alternates so drifting load
hits every entry), through:

- ``uncompressed``: one forward into a ``DynamicCache`` (the baseline);
- ``kv_diff``: one forward into ``KNormCache(r, score="kv_diff")`` (the recommended state-only score, for scale);
- ``kvzap``: one forward into ``KNormCache(r, score="kvzap")``: KVzap's surrogate of KVzip's score (arXiv 2601.07891;
  :mod:`hf_knorm.eviction.surrogate`), no reconstruction;
- ``kvzip``: one forward into ``KNormCache(r, score="kvzip")`` then
  ``hf_knorm.eviction.reconstruction.compress_by_reconstruction`` (the reconstruction forwards with their
  scored attention, the eviction): what the pipeline runs before the question;
- ``kvzip reconstruction``: the reconstruction's forwards alone (``reconstruction_importance``), to split the cost;
  ``of which scored attention``: the time spent in ``attention_with_max_weights`` during it (the scored layers'
  attention output and importance in one pass over the scores; it replaces their SDPA call).

Medians over rounds; each entry as a multiple of the median uncompressed prefill of the same run.

Usage: ``OMP_NUM_THREADS=1 python scripts/knorm/bench_kvzip_cost.py --lengths 1000,2000,4000 --rounds 3``
       (``--device cuda --dtype bfloat16`` on a GPU; ``--entries kv_diff,kvzap`` times only those beside the
       uncompressed prefill)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import hf_knorm
import hf_knorm.eviction.reconstruction as reconstruction
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.compat import cache_kwargs
from hf_knorm.eviction.cache import KNormCache
from hf_knorm.eviction.pipeline import encode_prompt
from hf_knorm.eviction.reconstruction import (compress_by_reconstruction, reconstruction_chunks,
                                              reconstruction_importance, reconstruction_prompt)

ENTRIES = ("uncompressed", "kv_diff", "kvzap", "kvzip", "kvzip reconstruction")
KERNEL = "of which scored attention"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def run_entry(model, tokenizer, ids: torch.Tensor, entry: str, ratio: float, device: str, kernel=None) -> float:
    """Seconds of one ``entry`` (module docstring) on the (1, n) context ``ids``; for ``"kvzip reconstruction"``
    the seconds spent in the scored layers' one-pass attention are appended to ``kernel``."""
    if entry == "kvzip reconstruction":  # prefill outside the clock, then the reconstruction alone
        cache = KNormCache(ratio, score="kvzip", config=model.config)
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
        chunks = reconstruction_chunks(ids, reconstruction_prompt(tokenizer), cache.settings.score.chunk_size,
                                       cache.settings.score.tail)
        spent, original = [], reconstruction.attention_with_max_weights

        def timed(*args, **kwargs):
            _sync(device)
            began = time.perf_counter()
            out = original(*args, **kwargs)
            _sync(device)
            spent.append(time.perf_counter() - began)
            return out

        reconstruction.attention_with_max_weights = timed
        try:
            _sync(device)
            began = time.perf_counter()
            reconstruction_importance(model, cache, chunks)
            _sync(device)
            elapsed = time.perf_counter() - began
        finally:
            reconstruction.attention_with_max_weights = original
        if kernel is not None:
            kernel.append(sum(spent))
        return elapsed
    cache = DynamicCache() if entry == "uncompressed" else KNormCache(ratio, score=entry, config=model.config)
    _sync(device)
    began = time.perf_counter()
    model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    if entry == "kvzip":
        compress_by_reconstruction(model, cache, ids, tokenizer)
    _sync(device)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1000,2000,4000", help="context lengths in tokens")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--entries", default=",".join(ENTRIES),
                        help=f"comma-separated entries to time (default: all: {','.join(ENTRIES)}); "
                             "uncompressed always")
    args = parser.parse_args()
    entries = tuple(dict.fromkeys(("uncompressed", *(e.strip() for e in args.entries.split(",") if e.strip()))))
    unknown = [entry for entry in entries if entry not in ENTRIES]
    if unknown:
        parser.error(f"unknown entries {unknown}; choose from {', '.join(ENTRIES)}")
    columns = (*entries, KERNEL) if "kvzip reconstruction" in entries else entries
    model, tokenizer = hf_knorm.load_default_model(dtype=getattr(torch, args.dtype))
    model.to(args.device)
    text = "\n\n".join(paul_graham_essays())
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():  # warm-up: first-call overheads stay out of the timings
        for entry in entries:
            run_entry(model, tokenizer, encode_prompt(tokenizer, tokenizer.decode(body[:64]), "?")[0].to(args.device),
                      entry, args.ratio, args.device)
    print(f"device {args.device}, {args.dtype}, torch threads {torch.get_num_threads()}; SmolLM2-135M-Instruct, "
          f"sdpa; r={args.ratio:g}; median of {args.rounds} interleaved rounds\n")
    print("| tokens | " + " | ".join(f"{e} (s) | x uncompressed" for e in columns) + " |")
    print("|---:|" + "---:|---:|" * len(columns))
    for n in (int(x) for x in args.lengths.split(",")):
        context = tokenizer.decode(body[:n])
        ids = encode_prompt(tokenizer, context, "?")[0].to(args.device)  # template prefix + n essay tokens
        times = {entry: [] for entry in (*entries, KERNEL)}
        for round_ in range(args.rounds):
            order = entries if round_ % 2 == 0 else entries[::-1]
            for entry in order:
                times[entry].append(run_entry(model, tokenizer, ids, entry, args.ratio, args.device, times[KERNEL]))
        medians = {entry: statistics.median(values) for entry, values in times.items() if values}
        base = medians["uncompressed"]
        cells = " | ".join(f"{medians[e]:.3f} | {medians[e] / base:.2f}" for e in columns)
        print(f"| {ids.shape[1]} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
