"""Needle-in-a-haystack and passkey retrieval of a converted x/1 model decoding with its state, against the original.

Each cell (task x context length x depth x seed) is the needle benchmark's sample (``hf_knorm.evaluation.needle``:
Paul Graham essays with "The special magic number for {city} is {7 digits}.", or the passkey filler), prompted through
the chat template with the answer started, and answered by plain ``model.generate`` (greedy, 10 new tokens): the
original model with its K/V cache, the converted ``p = 1`` model with the recurrent state its ``generate`` uses (the
script checks that every decoding call ran on the state). A cell is correct when the first number of the answer is
the needle's. A linear state of d x d per head is known to retrieve worse than a K/V cache: this measures by how much.

Usage:
    python research/2026-12/linear_retrieval.py outputs/convert_x1 --lengths 1000,2000,4000 --seeds 2 --out outputs/linear_retrieval
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import hf_knorm
from hf_knorm import RecurrentStateCache, attention_paths
from hf_knorm.evaluation.needle import haystack, is_correct, make_sample
from hf_knorm.evaluation.retrieval import answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("converted", help="folder of a model converted to x/1 or x/16 (hf-knorm convert's --out folder)")
    parser.add_argument("--lengths", default="1000,2000,4000")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--tasks", default="niah,passkey")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", default="outputs/linear_retrieval")
    args = parser.parse_args()
    original, tokenizer = hf_knorm.load_default_model()
    converted = hf_knorm.from_pretrained(args.converted).eval()
    normalization = hf_knorm.patched_normalization(converted)
    models = {"original (softmax, K/V cache)": original, f"converted ({normalization}, state)": converted}
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    records = []
    for task in args.tasks.split(","):
        hay = haystack(task, tokenizer)
        for length in lengths:
            for depth in depths:
                for seed in range(args.seeds):
                    sample = make_sample(task, tokenizer, hay, length, depth, seed)
                    for label, model in models.items():
                        with attention_paths() as taken:
                            text, cache = answer(model, tokenizer, sample)
                        if model is converted and (cache != RecurrentStateCache.__name__ or "quadratic" in taken):
                            raise RuntimeError(f"The converted model did not decode with its state ({cache}, {taken}).")
                        records.append(dict(task=task, model=label, length=length, depth=depth, seed=seed,
                                            expected=sample["expected"], answer=text,
                                            correct=is_correct(text, sample["expected"])))
            done = [r for r in records if r["task"] == task and r["length"] == length]
            print(f"{task} {length}: " + ", ".join(
                f"{label} {sum(r['correct'] for r in done if r['model'] == label)}/{len(depths) * args.seeds}"
                for label in models), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(records, indent=1))
    print("\n| task | length | " + " | ".join(models) + " |")
    print("|---|---|" + "---|" * len(models))
    for task in args.tasks.split(","):
        for length in lengths:
            cells = []
            for label in models:
                picked = [r for r in records if r["model"] == label and r["task"] == task and r["length"] == length]
                cells.append(f"{sum(r['correct'] for r in picked)}/{len(picked)}")
            print(f"| {task} | {length} | " + " | ".join(cells) + " |")
    print(f"\nanswers: {out / 'results.json'}")


if __name__ == "__main__":
    main()
