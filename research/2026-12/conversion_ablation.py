r"""Does the default conversion earn every part? Each part removed in turn, on several seeds (issue 67, item 4).

The default ``hf-knorm convert`` (``x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters 600``)
has four parts beside its softmax window (:data:`PARTS`): the ``x/1`` part (every older key the softmax part leaves,
scaled by the per-head window mix), the 4 attention sinks, the sparse cache of 256 older pairs and the 600 cluster
means of the pairs the cache leaves (which need the cache: removing the cache removes them too). Each part is
removed in two ways:

- **at evaluation** (every seed's default model, trained once, read with the part switched off): the mix set to 0,
  or the model patched again without the sinks, the cache or the clusters (its learned values and codebooks kept:
  :func:`hf_knorm.models.sparse_cache_size.repatch`); cheap, but the weights were trained with the part;
- **retrained** (``--retrain``): ``hf-knorm convert`` with the part's flag (:attr:`Part.flags`), the defaults
  otherwise, so the recovery adapts to its absence (every part of the default acts in its 512-token training
  blocks). The ``x/1`` part has no flag of its own: its retrained ablation is not run.

Every model, the original's included, is measured alike (:func:`measure`): perplexity beyond the window in 1,024- and
4,096-token blocks (positions >= 256 scored, ``convert``'s held-out domains and blocks, each domain against the
original), the passkey and the needle at 1,000, 2,000 and 4,000 tokens (4 depths x 2 seeds each,
:func:`hf_knorm.evaluation.retrieval.retrieval_records`, answered by the model's own ``generate``). A part earns its
place when its removal raises a domain's perplexity by 2% or more in either block length (the median over seeds of
the largest rise) or loses retrieval (passkeys and needles found, over all seeds).

Everything is resumable: a finished conversion (its ``convert.json``) is not run again and a measured model (its
JSON in ``OUT/measures``) is not measured again; ``--report`` only gathers what is there.

Usage (its table, ``OUT/ablation.md``, is for docs/results/conversion.md; not run on the default model yet):
    OMP_NUM_THREADS=2 python research/2026-12/conversion_ablation.py --out runs/ablation --seeds 0,1,2
    OMP_NUM_THREADS=2 python research/2026-12/conversion_ablation.py --out runs/ablation --seeds 0,1,2 \
        --retrain sinks,clusters
    python research/2026-12/conversion_ablation.py --out runs/ablation --seeds 0,1,2 --retrain sinks,clusters --report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conversion_spread import convert  # noqa: E402  (sibling script)

BLOCKS = (1024, 4096)
"""Tokens per block of the beyond-window perplexities (``convert``'s own, and the length where 25% of the pairs no
longer hold the whole block: docs/results/conversion.md, "At 4,096 tokens")."""
TASKS = ("passkey", "niah")
LENGTHS = (1000, 2000, 4000)
EARNS = 0.02
"""The perplexity rise (a fraction) from which a part earns its place (the issue's 2%)."""


@dataclass(frozen=True)
class Part:
    """One part of the default beside its window: how to switch it off in a trained model (``remove(model)``, in
    place), and the ``convert`` flags that train without it (empty: no retrained ablation)."""

    name: str
    what: str
    remove: Callable
    flags: tuple[str, ...] = ()


def _mix_off(model) -> None:
    from hf_knorm.models.window_mix import set_window_mix, window_mixes

    set_window_mix(model, [[0.0] * len(layer) for layer in window_mixes(model)])


def _repatched(**changes) -> Callable:
    def remove(model) -> None:
        from hf_knorm.models.patching import held_normalization
        from hf_knorm.models.sparse_cache_size import repatch

        normalization = held_normalization(model)
        repatch(model, normalization, dataclasses.replace(normalization, **changes))
    return remove


PARTS = {part.name: part for part in (
    Part("x1", "the x/1 part (the window mix at 0)", _mix_off),
    Part("sinks", "the 4 attention sinks", _repatched(sinks=0), ("--attention-sinks", "0")),
    Part("sparse", "the sparse cache of 256 pairs (and the clusters, which need it)", _repatched(sparse=0, clusters=0),
         ("--sparse-cache", "0", "--clusters", "0")),
    Part("clusters", "the 600 clusters", _repatched(clusters=0), ("--clusters", "0")),
)}
"""The parts beside the window, by the name ``--retrain`` takes."""


def measure(model, tokenizer, blocks: dict) -> dict:
    """``{"perplexity": {block: {domain: perplexity}}, "retrieval": {task: {length: [hits, cells]}}, "answers": [...]}``
    of ``model`` (:data:`BLOCKS`, :data:`TASKS`, :data:`LENGTHS`)."""
    from hf_knorm.conversion.beyond_window import beyond_window_perplexities
    from hf_knorm.evaluation.retrieval import hits_by_length, retrieval_records

    model.eval()
    perplexity = {str(block): beyond_window_perplexities(model, blocks[block], f"{block}-token blocks")
                  for block in BLOCKS}
    records = retrieval_records(model, tokenizer, TASKS, LENGTHS)
    return {"perplexity": perplexity, "retrieval": hits_by_length(records), "answers": records}


def measured(path: Path, build: Callable, tokenizer, blocks: dict) -> dict:
    """The measures in ``path``, or those of ``build()``'s model, written there first (atomically)."""
    if path.is_file():
        return json.loads(path.read_text())
    import hf_knorm

    model = build()
    record = {"normalization": hf_knorm.patched_normalization(model), **measure(model, tokenizer, blocks)}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1))
    partial.replace(path)
    return record


def variants(seeds: list[int], retrained: list[str]) -> list[tuple[str, int, str | None, Part | None]]:
    """``(label, seed, run folder name, part removed at evaluation)`` of every model to measure but the original."""
    listed = []
    for seed in seeds:
        listed.append(("default", seed, f"default_s{seed}", None))
        listed += [(f"without {name}, at evaluation", seed, f"default_s{seed}", part) for name, part in PARTS.items()]
        listed += [(f"without {name}, retrained", seed, f"no_{name}_s{seed}", None) for name in retrained]
    return listed


def measures_path(out: Path, label: str, seed: int) -> Path:
    """Where the measures of one variant and seed are kept (``OUT/measures/without_sinks_at_evaluation_s0.json``)."""
    return out / "measures" / f"{label.replace(',', '').replace(' ', '_')}_s{seed}.json"


def rises(record: dict, reference: dict) -> float:
    """The largest relative perplexity rise of ``record`` over ``reference``, over the domains and block lengths."""
    return max(record["perplexity"][block][domain] / reference["perplexity"][block][domain] - 1
               for block in reference["perplexity"] for domain in reference["perplexity"][block])


def found(record: dict) -> int:
    """Passkeys and needles found, every length."""
    return sum(hits for lengths in record["retrieval"].values() for hits, _ in lengths.values())


def _spread(values: list[float], form: str) -> str:
    if len(values) == 1:
        return form.format(values[0])
    return f"{form.format(statistics.median(values))} [{form.format(min(values))}-{form.format(max(values))}]"


def markdown(original: dict, records: dict[str, dict[int, dict]]) -> str:
    """One row per variant: each block length's worst domain against the original (median [range] over seeds), the
    hits per task and length (summed over seeds), the rise over the default and the verdict."""
    header = ["model", "seeds"] + [f"{block:,}-token blocks, worst" for block in BLOCKS] + [
        f"{task} {length}" for task in TASKS for length in LENGTHS] + ["largest rise over the default",
                                                                       "retrieval lost", "earns its place"]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * (len(header) - 2)]
    defaults = records.get("default", {})
    for label, by_seed in records.items():
        seeds = sorted(by_seed)
        cells = []
        for block in map(str, BLOCKS):
            worst = [max(by_seed[seed]["perplexity"][block][domain] / perplexity
                         for domain, perplexity in original["perplexity"][block].items()) for seed in seeds]
            cells.append(_spread(worst, "{:.3f}x"))
        for task in TASKS:
            for length in map(str, LENGTHS):
                pairs = [by_seed[seed]["retrieval"].get(task, {}).get(length, [0, 0]) for seed in seeds]
                cells.append(f"{sum(hits for hits, _ in pairs)}/{sum(count for _, count in pairs)}")
        paired = [seed for seed in seeds if seed in defaults]
        if label == "default" or not paired:
            cells += ["-", "-", "-"]
        else:
            rise = [rises(by_seed[seed], defaults[seed]) for seed in paired]
            lost = sum(found(defaults[seed]) - found(by_seed[seed]) for seed in paired)
            earns = statistics.median(rise) >= EARNS or lost > 0
            cells += [_spread(rise, "{:+.1%}"), str(lost), "yes" if earns else "**no**"]
        lines.append(f"| {label} | {', '.join(map(str, seeds))} | " + " | ".join(cells) + " |")
    originals = ["/".join(map(str, original["retrieval"].get(task, {}).get(str(length), [0, 0]))) for task in TASKS
                 for length in LENGTHS]
    lines.append("| the original (every pair) | - | " + " | ".join("1x" for _ in BLOCKS) + " | " + " | ".join(originals)
                 + " | - | - | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="folder of the runs and their measures")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--retrain", default="", help=f"parts to retrain without, of {','.join(PARTS)} "
                        f"(x1 has no flag of its own; default: none)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each conversion (default: 2)")
    parser.add_argument("--report", action="store_true", help="gather what is measured only, run nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    retrained = [name.strip() for name in args.retrain.split(",") if name.strip()]
    wrong = [name for name in retrained if name not in PARTS or not PARTS[name].flags]
    if wrong:
        parser.error(f"no retrained ablation for {wrong}; choose from "
                     f"{', '.join(name for name, part in PARTS.items() if part.flags)}")
    listed = variants(seeds, retrained)
    records: dict[str, dict[int, dict]] = {}
    if args.report:
        if not (out / "measures" / "original.json").is_file():
            parser.error(f"{out / 'measures'} holds no measures yet: run without --report first.")
        original = json.loads((out / "measures" / "original.json").read_text())
        for label, seed, _, _ in listed:
            path = measures_path(out, label, seed)
            if path.is_file():
                records.setdefault(label, {})[seed] = json.loads(path.read_text())
    else:
        import hf_knorm
        from hf_knorm.conversion.beyond_window import beyond_window_blocks
        from hf_knorm.conversion.settings import ConvertSettings

        out.mkdir(parents=True, exist_ok=True)
        for _, seed, folder, _ in listed:  # every conversion first: the measures below read them
            flags = next((part.flags for name, part in PARTS.items() if folder == f"no_{name}_s{seed}"), ())
            convert(out / folder, seed, args.threads, list(flags))
        model, tokenizer = hf_knorm.load_default_model()
        domains = ConvertSettings().domains()
        blocks = {block: beyond_window_blocks(domains, tokenizer, 4 * block, block) for block in BLOCKS}
        original = measured(out / "measures" / "original.json", lambda: model, tokenizer, blocks)
        del model
        for label, seed, folder, part in listed:
            def build(folder=folder, part=part):
                loaded = hf_knorm.from_pretrained(out / folder)
                if part is not None:
                    part.remove(loaded)
                return loaded
            path = measures_path(out, label, seed)
            records.setdefault(label, {})[seed] = measured(path, build, tokenizer, blocks)
            print(label, seed, "done", flush=True)
    table = markdown(original, records)
    (out / "ablation.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
