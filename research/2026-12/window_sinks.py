"""How much of the original model a softmax window keeps on its own, with and without attention sinks, untrained.

A converted hybrid ``x^p/c + softmax window W`` (hf_knorm.attention.window) starts from the original's softmax on the
window's keys. This measures that start: the default model patched with the window and its polynomial part switched
off (``m_h = 0``, :func:`hf_knorm.models.window_mix.distant_part_off`: each query's last ``W`` keys, and the
sequence's first ``S`` with sinks, by softmax over them alone), no training, against the original in the same run, on
the conversion's held-out domains: 256-token blocks (every position) and beyond the window (1,024-token blocks,
positions >= 256), as ``hf-knorm convert`` evaluates. StreamingLLM (Xiao et al., arXiv 2309.17453) found that a
softmax model parks much of its attention on the first tokens and that a window without them breaks down; this says
how much that holds for the default model at W = 64.

    python research/2026-12/window_sinks.py --windows 64 --sinks 0,1,4 --out runs/window_sinks.json

Prints a table (perplexity and ratio to the original per domain, the worst) and writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hf_knorm import patch, unpatch
from hf_knorm.assets.default_model import load_default_model
from hf_knorm.conversion.beyond_window import beyond_window_blocks
from hf_knorm.data.heldout import held_out_domain_blocks, held_out_perplexity
from hf_knorm.models.window_mix import distant_part_off

DOMAINS = ("essays", "plays", "technical", "conversation")


def _integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=_integers, default=[64], help="softmax windows W, comma-separated")
    parser.add_argument("--sinks", type=_integers, default=[0, 1, 4], help="attention sinks S, comma-separated")
    parser.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens per domain (as convert)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    model, tokenizer = load_default_model()
    model.eval()
    sets = {"256-token blocks": held_out_domain_blocks(DOMAINS, tokenizer, 256, args.eval_tokens),
            "beyond the window": beyond_window_blocks(list(DOMAINS), tokenizer, args.eval_tokens)}

    def measure(label: str) -> dict:
        return {name: {domain: held_out_perplexity(model, data, desc=f"{label}, {name}, {domain}")
                       for domain, data in blocks.items()} for name, blocks in sets.items()}

    started = time.perf_counter()
    original = measure("original")
    rows = []
    for window in args.windows:
        for sinks in args.sinks:
            patch(model, "x^3/16", softmax_window=window, attention_sinks=sinks)
            with distant_part_off(model):
                figures = measure(f"W={window} S={sinks}")
            unpatch(model)
            rows.append({"window": window, "sinks": sinks, "perplexity": figures,
                         "ratio": {name: {d: figures[name][d] / original[name][d] for d in DOMAINS} for name in sets}})
    result = {"original": original, "windows_alone": rows, "eval_tokens": args.eval_tokens,
              "seconds": time.perf_counter() - started}

    for name in sets:
        print(f"\n{name} (original: " + ", ".join(f"{d} {original[name][d]:.2f}" for d in DOMAINS) + ")")
        print("| window alone | " + " | ".join(DOMAINS) + " | worst |")
        print("|---|" + "---:|" * (len(DOMAINS) + 1))
        for row in rows:
            ratios = row["ratio"][name]
            cells = " | ".join(f"{row['perplexity'][name][d]:.2f} ({ratios[d]:.2f}x)" for d in DOMAINS)
            print(f"| W={row['window']}, S={row['sinks']} | {cells} | {max(ratios.values()):.2f}x |")
    print(f"\n{result['seconds']:.0f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
