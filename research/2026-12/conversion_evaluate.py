r"""Evaluate a converted model as `hf-knorm convert` does, after the fact: every held-out domain and the ability probe.

For models converted before the held-out domains existed (their `convert.json` has one held-out text), or on more
tokens than the run used: held-out perplexity of the model and of the original on each domain
(`hf_knorm.evaluation.domains`), each ratio, the worst, and the ability probe (`hf_knorm.evaluation.probe`) against the
original's answers. Writes `evaluation.json` beside the model unless `--out` says otherwise.

Usage:
    python research/2026-12/conversion_evaluate.py runs/x3-16 --eval-tokens 8192
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the converted model's folder (hf_knorm.from_pretrained)")
    parser.add_argument("--original", default="default", help="the original model: 'default' or a folder")
    parser.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens of each domain")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per block")
    parser.add_argument("--out", help="the JSON to write (default: MODEL/evaluation.json)")
    args = parser.parse_args(argv)

    import transformers

    import hf_knorm
    from hf_knorm.evaluation.domains import DOMAINS
    from hf_knorm.evaluation.probe import ask, compare
    from hf_knorm.data.heldout import domains_record, held_out_domain_blocks, held_out_perplexity

    if args.original == "default":
        from hf_knorm.assets.default_model import default_model_dir

        original_dir = default_model_dir()
    else:
        original_dir = Path(args.original)
    tokenizer = transformers.AutoTokenizer.from_pretrained(original_dir)
    blocks = held_out_domain_blocks([d.name for d in DOMAINS], tokenizer, args.block_size, args.eval_tokens)
    original = transformers.AutoModelForCausalLM.from_pretrained(original_dir).eval()
    before = {name: held_out_perplexity(original, sets, desc=f"original, {name}") for name, sets in blocks.items()}
    reference = ask(original, tokenizer)
    del original
    converted = hf_knorm.from_pretrained(args.model, model_class=transformers.AutoModelForCausalLM).eval()
    after = {name: held_out_perplexity(converted, sets, desc=f"converted, {name}") for name, sets in blocks.items()}
    result = {"model": str(args.model), "normalization": hf_knorm.patched_normalization(converted),
              "evaluation": domains_record(blocks, args.block_size, before, after),
              "probe": compare(ask(converted, tokenizer), reference),
              "original_probe": [asdict(answer) for answer in reference]}
    out = Path(args.out) if args.out else Path(args.model) / "evaluation.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, record in result["evaluation"]["domains"].items():
        print(f"{name:>12}: {record['perplexity']:9.4g} (original {record['original_perplexity']:.4g}, "
              f"{record['ratio_to_original']:.2f}x)")
    print(f"worst: {result['evaluation']['worst_domain']} {result['evaluation']['ratio_to_original']:.2f}x; "
          f"probe: {result['probe']['agreement']:.0%} of the original's answers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
