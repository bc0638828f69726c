"""KNorm KV-cache compression: prefill overhead, per-token decode time and cache bytes, with and without compression.

Everything is measured in one run against the uncompressed ``DynamicCache`` baseline, interleaved (baseline and
compressed alternate), medians reported:

- prefill: a full forward over an N-token prompt (Paul Graham essays) with a ``DynamicCache`` vs a ``KNormCache``;
  and, separately, the scoring + eviction step alone (``KNormCache.from_dynamic_cache`` on the filled cache, which is
  exactly the work KNorm adds to prefill), as a fraction of the prefill;
- decode: seconds per generated token (single-token forwards) on the full cache vs the compressed caches;
- bytes: keys + values actually held vs the arithmetic limit ``2 x layers x kv_heads x head_dim x kept x bytes``;
- with ``--scores``: the scoring + eviction time and the decode time of each eviction score at the first ratio, against
  ``key_norm`` in the same run (interleaved rounds, score order rotated each round);
- with ``--head-budgets``: the uniform ``KNormCache`` against ``head_budget="heads"`` and ``head_budget="heads",
  layer_budget="dispersion"`` at the first ratio and the first ``--scores`` entry (default ``kv_diff``), through the
  public entry (prefill: a forward on the empty cache; decode: single-token forwards, both inside
  ``ragged_attention_for``): prefill against a ``DynamicCache``'s (rounds, order rotated), decode ms/token interleaved
  token by token (the three caches take one token each in turn) as the ratio to the uniform cache, by the wall clock
  and by the process's CPU time (median and range over rounds), and the bytes held (``cache.nbytes()``) against the
  kept pairs' arithmetic size.

Usage: ``OMP_NUM_THREADS=1 python scripts/knorm/bench_knorm.py --lengths 4000,8000 --ratios 0.5,0.75,0.9``
       ``OMP_NUM_THREADS=1 python scripts/knorm/bench_knorm.py --lengths 4000,8000 --ratios 0.5 --scores key_norm,key_diff``
       ``OMP_NUM_THREADS=1 python scripts/knorm/bench_knorm.py --lengths 2000 --ratios 0.5 --head-budgets --rounds 5``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import hf_knorm
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.eviction.cache import KNormCache, kept_count


def clone(cache) -> DynamicCache:
    return DynamicCache([(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])


@torch.no_grad()
def decode_time(model, cache, start: int, steps: int) -> float:
    """Median seconds of one single-token forward on ``cache`` (which it extends by ``steps`` tokens)."""
    token = torch.tensor([[42]])
    times = []
    for step in range(steps):
        began = time.perf_counter()
        model(input_ids=token, position_ids=torch.tensor([[start + step]]), cache=cache, use_cache=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


@torch.no_grad()
def bench_length(model, ids: torch.Tensor, ratios, reps: int, decode_steps: int) -> dict:
    n = ids.shape[1]
    prefill = {"dynamic": [], "knorm": []}
    full = None
    for rep in range(reps):  # A B, then B A: drift in machine load hits both
        order = ("dynamic", "knorm") if rep % 2 == 0 else ("knorm", "dynamic")
        for kind in order:
            cache = DynamicCache() if kind == "dynamic" else KNormCache(ratios[0])
            began = time.perf_counter()
            model(input_ids=ids, cache=cache, use_cache=True)
            prefill[kind].append(time.perf_counter() - began)
            if kind == "dynamic":
                full = cache
    evict = {}
    for ratio in ratios:
        times = []
        for _ in range(5):
            began = time.perf_counter()
            KNormCache.from_dynamic_cache(full, compression_ratio=ratio)
            times.append(time.perf_counter() - began)
        evict[ratio] = statistics.median(times)
    copy_time = statistics.median(_timed(lambda: KNormCache.from_dynamic_cache(full)) for _ in range(5))
    decode = {r: [] for r in (0.0, *ratios)}
    for _ in range(2):  # two interleaved rounds
        for ratio in decode:
            cache = clone(full) if ratio == 0.0 else KNormCache.from_dynamic_cache(full, compression_ratio=ratio)
            decode[ratio].append(decode_time(model, cache, n, decode_steps))
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size //
                                                                             config.num_attention_heads) * 4
    sizes = {}
    for ratio in (0.0, *ratios):
        cache = clone(full) if ratio == 0.0 else KNormCache.from_dynamic_cache(full, compression_ratio=ratio)
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        positions = cache.nbytes(include_positions=True) - held if ratio else 0
        sizes[ratio] = (held, per_token * kept_count(n, ratio), positions)
    return dict(n=n, prefill={k: statistics.median(v) for k, v in prefill.items()}, evict=evict,
                copy=copy_time, decode={k: min(v) for k, v in decode.items()}, sizes=sizes)


@torch.no_grad()
def bench_scores(model, ids: torch.Tensor, ratio: float, specs: list[str], rounds: int, decode_steps: int) -> dict:
    """Per ``--scores`` entry at ``ratio``: median scoring + eviction time (``from_dynamic_cache``, 5 per round) and
    the best per-round median decode time; rounds interleave the entries (order rotated) so drifting load hits all."""
    from hf_knorm.evaluation.needle import parse_score_spec

    n = ids.shape[1]
    began = time.perf_counter()
    full = model(input_ids=ids, cache=DynamicCache(), use_cache=True).cache
    prefill = time.perf_counter() - began
    options = {spec: parse_score_spec(spec) for spec in specs}
    evict = {spec: [] for spec in specs}
    decode = {spec: [] for spec in specs}
    for round_ in range(rounds):
        order = specs[round_ % len(specs):] + specs[:round_ % len(specs)]
        for spec in order:
            for _ in range(5):
                evict[spec].append(_timed(lambda: KNormCache.from_dynamic_cache(full, compression_ratio=ratio,
                                                                                **options[spec])))
            cache = KNormCache.from_dynamic_cache(full, compression_ratio=ratio, **options[spec])
            decode[spec].append(decode_time(model, cache, n, decode_steps))
    return dict(n=n, prefill=prefill, evict={k: statistics.median(v) for k, v in evict.items()},
                decode={k: min(v) for k, v in decode.items()})


HEAD_BUDGETS = {"uniform": {}, "heads": {"head_budget": "heads"},
                "heads+dispersion": {"head_budget": "heads", "layer_budget": "dispersion"}}


def kept_pair_bytes(cache) -> int:
    """The arithmetic size of the keys and values a KNormCache keeps: 2 x kept pairs x head_dim x itemsize."""
    total = 0
    for index, layer in enumerate(cache.layers):
        dim, itemsize = layer.keys.shape[-1], layer.keys.element_size()
        total += 2 * int(cache.stored_per_head(index).sum()) * dim * itemsize
    return total


@torch.no_grad()
def bench_head_budgets(model, ids: torch.Tensor, ratio: float, score: dict, rounds: int, decode_steps: int) -> dict:
    """Per :data:`HEAD_BUDGETS` entry at ``ratio``: prefill seconds (a forward on the empty cache, beside a
    ``DynamicCache``'s; entries in rotated order each round), decode seconds per token, and the bytes held after
    decoding against the kept pairs' arithmetic size.

    Decoding is interleaved token by token: each round the entries' caches (from that round's prefill) take one
    single-token forward each in turn (order rotated), so the load of a shared machine hits neighbours alike; each
    forward is timed by the wall clock and by the process's CPU time (which leaves out time spent waiting for a core).
    Returns per entry the per-round medians, and per round the median of the per-token ratios to the uniform cache."""
    from hf_knorm.eviction.ragged import ragged_attention_for

    n = ids.shape[1]
    names = ["dynamic", *HEAD_BUDGETS]
    prefill = {name: [] for name in names}
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    decode = {clock: {name: [] for name in HEAD_BUDGETS} for clock in clocks}
    paired = {clock: {name: [] for name in HEAD_BUDGETS} for clock in clocks}
    sizes = {}
    token = torch.tensor([[42]])
    for round_ in range(rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        caches = {}
        for name in order:
            cache = DynamicCache() if name == "dynamic" else KNormCache(ratio, config=model.config, **score,
                                                                        **HEAD_BUDGETS[name])
            with ragged_attention_for(model, cache):
                prefill[name].append(_timed(lambda: model(input_ids=ids, cache=cache, use_cache=True)))
            caches[name] = cache
        steps = {clock: {name: [] for name in HEAD_BUDGETS} for clock in clocks}
        for step in range(decode_steps):
            entries = list(HEAD_BUDGETS)
            for name in entries[step % len(entries):] + entries[:step % len(entries)]:
                with ragged_attention_for(model, caches[name]):
                    began = {clock: read() for clock, read in clocks.items()}
                    model(input_ids=token, position_ids=torch.tensor([[n + step]]), cache=caches[name], use_cache=True)
                    for clock, read in clocks.items():
                        steps[clock][name].append(read() - began[clock])
        for clock in clocks:
            for name in HEAD_BUDGETS:
                decode[clock][name].append(statistics.median(steps[clock][name]))
                paired[clock][name].append(statistics.median(
                    t / u for t, u in zip(steps[clock][name], steps[clock]["uniform"])))
        sizes = {name: (caches[name].nbytes(), kept_pair_bytes(caches[name])) for name in HEAD_BUDGETS}
    return dict(n=n, prefill={k: statistics.median(v) for k, v in prefill.items()}, decode=decode, paired=paired,
                sizes=sizes)


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4000,8000")
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--reps", type=int, default=2, help="prefill repetitions per cache kind (interleaved)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--scores", default=None,
                        help="compare eviction scores at the first ratio instead (entries as in hf-knorm niah --scores; "
                        "the first is the baseline, e.g. key_norm,key_diff+sinks4+window64)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the --scores comparison")
    parser.add_argument("--head-budgets", action="store_true",
                        help="compare the uniform cache against head_budget='heads' (and + layer_budget='dispersion') "
                        "at the first ratio, scored by the first --scores entry (default kv_diff)")
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    model, tokenizer = hf_knorm.load_default_model()
    text = "\n\n".join(paul_graham_essays())
    all_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():  # warm-up: first-call overheads stay out of the timings
        model(input_ids=all_ids[:, :64], cache=DynamicCache(), use_cache=True)
    print(f"torch threads: {torch.get_num_threads()}; model: SmolLM2-135M-Instruct fp32, sdpa\n")
    if args.head_budgets:
        from hf_knorm.evaluation.needle import parse_score_spec

        spec = (args.scores or "kv_diff").split(",")[0].strip()
        print(f"{spec}, r={ratios[0]:g}, {args.rounds} rounds of {args.decode_steps} decode steps, interleaved token by "
              "token; decode = median over rounds of the per-round median ms/token; vs uniform = median [min, max] "
              "over rounds of the per-round median of per-token ratios to the uniform cache; wall clock and process "
              "CPU time\n")
        print("| tokens | budget | prefill (s) | vs DynamicCache | decode ms/token wall | vs uniform wall | decode "
              "ms/token CPU | vs uniform CPU | bytes held | kept pairs' size | held / size |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in args.lengths.split(","):
            score = {k: v for k, v in parse_score_spec(spec).items() if k not in ("head_budget", "layer_budget")}
            r = bench_head_budgets(model, all_ids[:, :int(n)], ratios[0], score, args.rounds, args.decode_steps)
            for name in HEAD_BUDGETS:
                cells = []
                for clock in ("wall", "cpu"):
                    ratio = r["paired"][clock][name]
                    cells.append(f"{1000 * statistics.median(r['decode'][clock][name]):.1f} | "
                                 f"{statistics.median(ratio):.3f} [{min(ratio):.3f}, {max(ratio):.3f}]")
                held, size = r["sizes"][name]
                prefill = r["prefill"][name]
                print(f"| {r['n']} | {name} | {prefill:.2f} | {prefill / r['prefill']['dynamic']:.3f} | {cells[0]} | "
                      f"{cells[1]} | {held:,} | {size:,} | {held / size:.4f} |", flush=True)
        return
    if args.scores:
        specs = [s.strip() for s in args.scores.split(",") if s.strip()]
        print(f"| tokens | score (r={ratios[0]:g}) | scoring + eviction (ms) | of prefill | vs {specs[0]} | "
              f"decode ms/token | vs {specs[0]} |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for n in args.lengths.split(","):
            r = bench_scores(model, all_ids[:, :int(n)], ratios[0], specs, args.rounds, args.decode_steps)
            base_evict, base_decode = r["evict"][specs[0]], r["decode"][specs[0]]
            for spec in specs:
                e, d = r["evict"][spec], r["decode"][spec]
                print(f"| {r['n']} | {spec} | {1000 * e:.1f} | {100 * e / r['prefill']:.2f}% | {e / base_evict:.2f} | "
                      f"{1000 * d:.1f} | {d / base_decode:.3f} |", flush=True)
        return
    results = [bench_length(model, all_ids[:, :int(n)], ratios, args.reps, args.decode_steps)
               for n in args.lengths.split(",")]
    print("| tokens | prefill DynamicCache (s) | prefill KNormCache r=%g (s) | ratio | scoring+eviction alone (ms) "
          "| of prefill |" % ratios[0])
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        p = r["prefill"]
        print(f"| {r['n']} | {p['dynamic']:.2f} | {p['knorm']:.2f} | {p['knorm'] / p['dynamic']:.3f} | "
              f"{1000 * r['evict'][ratios[0]]:.1f} (copy alone {1000 * r['copy']:.1f}) | "
              f"{100 * r['evict'][ratios[0]] / p['dynamic']:.2f}% |")
    print("\n| tokens | ratio | decode ms/token | vs uncompressed | KV bytes held | arithmetic limit | "
          "position table |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        base = r["decode"][0.0]
        for ratio, seconds in r["decode"].items():
            held, limit, positions = r["sizes"][ratio]
            print(f"| {r['n']} | {ratio:g} | {1000 * seconds:.1f} | {seconds / base:.3f} | {held:,} | {limit:,} | "
                  f"{positions:,} |")


if __name__ == "__main__":
    main()
