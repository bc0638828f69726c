"""Bounded memory at the prompt: the default conversion's prefill against the original model's under ``KNormCache``.

Issue 67 asks whether the conversion earns its place beside eviction, which bounds the memory of the original model
without training it. Both sides here hold a bounded cache after a prompt of ``n`` tokens (essays in the default
model's chat template):

- ``original + KNormCache``: SmolLM2-135M-Instruct under its own attention (SDPA), one forward of the prompt into
  ``KNormCache(budget=W + S + K, score="kv_diff")`` (the recommended score; the same pairs the conversion keeps per KV
  head), which attends the whole prompt, then keeps ``W + S + K`` pairs per layer and KV head;
- ``converted``: the same weights patched with ``hf-knorm convert``'s default (``x/1 + softmax window 64 + sinks 4 +
  sparse 256 (prefix_kv_diff) + clusters 600``; the codebooks fitted on the essays as ``convert`` fits them; the
  time of a forward does not depend on trained weights), one forward of the prompt into the
  ``RecurrentStateCache`` ``generate`` decodes it with (the linear path in blocks, the window, the sinks, the sparse
  cache, the clusters and the ``x/1`` state).

The baseline is the original model's plain prefill (``DynamicCache``) in the same run. In interleaved rounds (the
order alternates so a drifting load hits every entry), medians over rounds; each entry as a multiple of the baseline
of the same length. Also printed: the bytes each cache holds after the prompt (``nbytes()``: keys and values, and
for the conversion its state, clusters and score statistics; positions not counted), as a share of the full K/V
cache's.

Usage: ``OMP_NUM_THREADS=2 python scripts/conversion/bench_bounded_prefill.py --lengths 2000,4000,8000 --rounds 3``
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
from hf_knorm.conversion.clusters import calibration_ids
from hf_knorm.eviction.pipeline import encode_prompt
from hf_knorm.conversion.settings import (DEFAULT_ATTENTION_SINKS, DEFAULT_CLUSTERS, DEFAULT_SOFTMAX_WINDOW,
                                          DEFAULT_SPARSE_CACHE, DEFAULT_SPARSE_SCORE)
from hf_knorm.models.cluster_codebook import fit_cluster_codebook
from hf_knorm.recurrent.cache import RecurrentStateCache

ENTRIES = ("original", "original + KNormCache", "converted")
DEFAULT = (f"x/1 + softmax window {DEFAULT_SOFTMAX_WINDOW} + sinks {DEFAULT_ATTENTION_SINKS} + sparse "
           f"{DEFAULT_SPARSE_CACHE} ({DEFAULT_SPARSE_SCORE}) + clusters {DEFAULT_CLUSTERS}")
PAIRS = DEFAULT_SOFTMAX_WINDOW + DEFAULT_ATTENTION_SINKS + DEFAULT_SPARSE_CACHE
WARM_UP = 512


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    """(1, ~length) ids: the essays' first ``length`` tokens in the chat template's user turn (what the
    ``knorm-text-generation`` pipeline compresses)."""
    body = tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]
    return encode_prompt(tokenizer, tokenizer.decode(body[:length]), "?")[0]


def prefill(model, cache, ids) -> tuple[float, int]:
    """Seconds of one forward of ``ids`` into ``cache``, and the bytes the cache holds after it."""
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(cache))
    seconds = time.perf_counter() - started
    return seconds, cache_bytes(cache)


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2000,4000,8000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if min(int(text) for text in args.lengths.split(",")) < WARM_UP:
        parser.error(f"--lengths: at least {WARM_UP} tokens (the warm-up's; the KNormCache keeps {PAIRS})")
    original, tokenizer = hf_knorm.load_default_model()
    converted = hf_knorm.patch(hf_knorm.load_default_model()[0], DEFAULT)
    fit_cluster_codebook(converted, calibration_ids(tokenizer, DEFAULT_CLUSTERS))
    caches = {
        "original": lambda: (original, DynamicCache()),
        "original + KNormCache": lambda: (original, hf_knorm.KNormCache(budget=PAIRS, score="kv_diff",
                                                                       config=original.config)),
        "converted": lambda: (converted, RecurrentStateCache(config=converted.config)),
    }
    print(f"SmolLM2-135M-Instruct, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}; converted: "
          f"{DEFAULT}; KNormCache: kv_diff, {PAIRS} pairs per layer and KV head")
    print("| prompt tokens | entry | prefill s (median) | x original | cache MB after | share of the full K/V |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in (int(text) for text in args.lengths.split(",")):
        ids = prompt_ids(tokenizer, length)
        for name in ENTRIES:  # warm-up, outside the timings (longer than the KNormCache budget)
            prefill(*caches[name](), ids[:, :WARM_UP])
        seconds = {name: [] for name in ENTRIES}
        held = {}
        for round_index in range(args.rounds):
            order = ENTRIES if round_index % 2 == 0 else ENTRIES[::-1]
            for name in order:
                model, cache = caches[name]()
                took, held[name] = prefill(model, cache, ids)
                seconds[name].append(took)
        base = statistics.median(seconds["original"])
        for name in ENTRIES:
            median = statistics.median(seconds[name])
            print(f"| {ids.shape[-1]} | {name} | {median:.2f} | {median / base:.2f}x | {held[name] / 2**20:.1f} | "
                  f"{held[name] / held['original']:.1%} |", flush=True)


if __name__ == "__main__":
    main()
