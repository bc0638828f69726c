"""Retrieval beyond the window: converted models against the baselines a user would pick instead (issue 47's table).

Reads the ``convert.json`` of one or more ``hf-knorm convert`` runs of one configuration (seeds), and measures on the
same passkey/needle cells the original model under a ``KNormCache`` that holds as many key/value pairs per KV head as
the converted model's softmax part (``kv_diff`` + its sinks + its window, ``budget = decoding_budget = W + S + K``):
the compression a user would choose instead of converting. Prints one markdown table, median [min-max] over the runs:

- passkey/needle hits per length: the original, ``KNormCache kv_diff`` at the same pairs, the converted model, its
  window-only ablation (the part beside the window off: ``distant_part_off``; a sparse cache stays on);
- perplexity beyond the window (worst domain, as a multiple of the original) of the converted model and of its
  window-only ablation, the distant part's gain over that ablation, the worst held-out domain and the probe;
- the key/value pairs held per KV head at the longest length: the original's (the whole context), the converted
  model's ``W + S + K`` and its state counted in pairs (``D x D_v + D`` floats over ``D + D_v`` per pair).

Usage:
    python scripts/conversion/conversion_retrieval.py --runs runs/sparse_s0,runs/sparse_s1,runs/sparse_s2 --out runs/retrieval
    python scripts/conversion/conversion_retrieval.py --runs runs/sparse_s0 --tasks niah --out runs/retrieval  # + the needle
The baseline's and the extra tasks' records are cached in ``--out`` (``knorm_baseline.json``) and reused by the next call.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import transformers

import hf_knorm
from hf_knorm.evaluation.retrieval import hits_by_length, retrieval_records
from hf_knorm.eviction.pipeline import knorm_generate
from hf_knorm.models.window_mix import distant_part_off, window_mixes
from hf_knorm.normalizations import Polynomial, parse_normalization


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """``median [min-max]`` (one value: itself)."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def hits_spread(tables: list[dict], task: str, length: str) -> str:
    """``hits/cells`` of every run at one length, median [min-max] of the hits."""
    cells = [table[task][length] for table in tables if task in table and length in table[task]]
    if not cells:
        return "-"
    hits = [hit for hit, _ in cells]
    total = cells[0][1]
    if len(set(hits)) == 1:
        return f"{hits[0]}/{total}"
    return f"{statistics.median(hits):g}/{total} [{min(hits)}-{max(hits)}]"


def knorm_baseline(tasks: list[str], lengths: list[int], pairs: int, sinks: int, window: int, out: Path) -> dict:
    """``{task: {length: [hits, cells]}}`` of the original model under ``KNormCache(kv_diff)`` holding ``pairs`` pairs
    (``sinks`` first and ``window`` last kept), on :func:`hf_knorm.evaluation.retrieval.retrieval_records`' cells;
    cached in ``out``."""
    path = out / "knorm_baseline.json"
    key = f"pairs={pairs} sinks={sinks} window={window}"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    table = cached.get(key, {})
    todo = [(task, length) for task in tasks for length in lengths if str(length) not in table.get(task, {})]
    if not todo:
        return table
    model, tokenizer = hf_knorm.load_default_model()

    def generate(ids):
        return knorm_generate(model, ids, attention_mask=torch.ones_like(ids), score="kv_diff", budget=pairs,
                              decoding_budget=pairs, sink_tokens=sinks, recent_window=window, max_new_tokens=10,
                              do_sample=False, pad_token_id=tokenizer.eos_token_id)

    for task, length in todo:
        records = retrieval_records(model, tokenizer, (task,), (length,), desc=f"KNormCache, {task} {length}",
                                    generate=generate)
        table.setdefault(task, {}).update(hits_by_length(records)[task])
        cached[key] = table
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    return table


@torch.no_grad()
def measured_here(run: Path, task: str, lengths: list[int], out: Path) -> dict:
    """``{"original" | "converted" | "window_only": {task: {length: [hits, cells]}}}`` of a task the run did not
    measure (e.g. ``niah``), on :func:`hf_knorm.evaluation.retrieval.retrieval_records`' cells; cached in ``out``."""
    path = out / f"{run.name}_{task}.json"
    if path.is_file():
        return json.loads(path.read_text())
    original, tokenizer = hf_knorm.load_default_model()
    converted = hf_knorm.from_pretrained(run).eval()
    tables = {"original": original_hits(original, tokenizer, task, lengths, out),
              "converted": hits_by_length(retrieval_records(converted, tokenizer, (task,), lengths))}
    if parse_normalization(hf_knorm.patched_normalization(converted)).window:
        if all(mix == 0 for layer in window_mixes(converted) for mix in layer):
            tables["window_only"] = tables["converted"]  # the distant part is off already: the same model
        else:
            with distant_part_off(converted):
                tables["window_only"] = hits_by_length(retrieval_records(converted, tokenizer, (task,), lengths))
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tables, indent=1))
    return tables


def original_hits(original, tokenizer, task: str, lengths: list[int], out: Path) -> dict:
    """The original model's ``{task: {length: [hits, cells]}}`` (greedy, so the same for every run: cached in ``out``)."""
    path = out / f"original_{task}_{'-'.join(map(str, lengths))}.json"
    if path.is_file():
        return json.loads(path.read_text())
    table = hits_by_length(retrieval_records(original, tokenizer, (task,), lengths))
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", required=True, help="comma-separated convert run folders (one configuration)")
    parser.add_argument("--out", default="runs/conversion_retrieval", help="where the baseline's records are cached")
    parser.add_argument("--no-baseline", action="store_true", help="skip the KNormCache baseline")
    parser.add_argument("--tasks", default="", help="retrieval tasks to measure here beside the runs' own "
                        "(comma-separated, e.g. niah), at the runs' lengths, for every model of the table")
    args = parser.parse_args()
    records = [json.loads((Path(run) / "convert.json").read_text()) for run in args.runs.split(",")]
    names = {record["normalization"] for record in records}
    if len(names) != 1:
        raise SystemExit(f"--runs mixes configurations: {sorted(names)}; give the seeds of one.")
    normalization = parse_normalization(names.pop())
    beyond = [record["beyond_window"] for record in records]
    settings = records[0]["settings"]
    tasks, lengths = list(settings["retrieval_tasks"]), [int(n) for n in settings["retrieval_lengths"]]
    extra = [task for task in args.tasks.split(",") if task and task not in tasks]
    for task in extra:  # measured here, merged into each run's tables
        for record, run in zip(beyond, args.runs.split(",")):
            for name, table in measured_here(Path(run), task, lengths, Path(args.out)).items():
                record["retrieval"].setdefault(name, {}).update(table)
    tasks += extra
    pairs = normalization.window + normalization.sinks + normalization.sparse
    rows = {"original": [b["retrieval"]["original"] for b in beyond]}
    if not args.no_baseline and pairs:
        rows[f"original, KNormCache kv_diff, {pairs} pairs"] = [
            knorm_baseline(tasks, lengths, pairs, normalization.sinks, normalization.window, Path(args.out))]
    rows["converted"] = [b["retrieval"]["converted"] for b in beyond]
    if all("window_only" in b["retrieval"] for b in beyond):
        rows["converted, window only"] = [b["retrieval"]["window_only"] for b in beyond]

    print(f"`{normalization.name}`, {len(records)} run(s), seeds {[r['settings']['seed'] for r in records]}\n")
    header = [f"{task} {length}" for task in tasks for length in lengths]
    print("| model | " + " | ".join(header) + " |\n|---|" + "---:|" * len(header))
    for label, tables in rows.items():
        print(f"| {label} | " + " | ".join(hits_spread(tables, task, str(length)) for task in tasks
                                           for length in lengths) + " |")
    worst = [b["worst_ratio"] for b in beyond]
    alone = [b.get("window_only_worst_ratio") for b in beyond]
    print(f"\n- beyond the window, worst domain / original: converted {spread(worst)}x", end="")
    if all(a is not None for a in alone):
        gains = [1 - w / a for w, a in zip(worst, alone)]
        print(f", window only {spread(alone)}x; the distant part's gain {spread([100 * g for g in gains], '{:.1f}')}%")
    else:
        print()
    print(f"- worst held-out domain / original: {spread([r['evaluation']['ratio_to_original'] for r in records])}x")
    if all("probe" in r for r in records):
        print(f"- probe agreement: {spread([100 * r['probe']['agreement'] for r in records], '{:.1f}')}%")
    print(f"- conversion time: {spread([r['seconds'] / 60 for r in records], '{:.1f}')} min")
    longest = max(lengths)
    if not is_linear(normalization):  # the distant part reads every older pair: the cache holds them all
        print(f"- pairs held per KV head at {longest} tokens: all {longest} (the part beside the window is quadratic)")
        return
    config = transformers.AutoConfig.from_pretrained(records[0]["model_dir"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    state_pairs = (head_dim * head_dim + head_dim) / (2 * head_dim)  # D x D_v + D floats; a pair is D + D_v
    print(f"- pairs held per KV head at {longest} tokens: original {longest}; converted {pairs} + the state "
          f"({state_pairs:.1f} pairs' bytes) = {100 * (pairs + state_pairs) / longest:.1f}% of the original's")


def is_linear(normalization) -> bool:
    """Whether the part beside the window is ``x/c`` with a constant ``c``: decoded from a constant-size state."""
    base = normalization.without_window
    return isinstance(base, Polynomial) and base.power == 1 and not base.sqrt_n


if __name__ == "__main__":
    main()
