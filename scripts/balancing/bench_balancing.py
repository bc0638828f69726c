"""K/V balancing: what it buys for K/V compression, measured (the two tables of docs/results/balancing.md).

For the default model (SmolLM2-135M-Instruct, fp32) unbalanced, balanced per ``layer`` and per ``channel``, the
teacher-forced perplexity on held-out Shakespeare (Hamlet, then the Sonnets; never used for calibration) when
attention reads compressed K/V (``hf_knorm.balancing.codecs`` through ``KVTransform``):

1. joint low-rank [K; V] per layer, rank 25/50/75% of the 2 * H_kv * head_dim channels (PCA fitted per model on the
   calibration text);
2. per-token int4/int3/int2 quantization in groups of 64 channels, and fp8 (e4m3) with one absmax scale for K and V.

Calibration (balancing and PCA): the first tokens of the other Shakespeare works. Run with one thread to share the
machine: ``OMP_NUM_THREADS=1 python scripts/balancing/bench_balancing.py`` (about 15 minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import hf_knorm
from hf_knorm.assets.texts import shakespeare_split
from hf_knorm.attention.taps import KVTransform
from hf_knorm.balancing.balance import balance_kv, calibration_batches
from hf_knorm.balancing.codecs import JointLowRank, per_token_groups, shared_absmax_fp8
from hf_knorm.evaluation.perplexity import perplexity_of_windows, token_windows
from hf_knorm.recording.record_norms import routed_through_plugin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens scored (whole windows)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per forward pass")
    parser.add_argument("--calibration-tokens", type=int, default=2048, help="tokens for balancing and for the PCA")
    parser.add_argument("--alpha", type=float, default=0.5, help="migration strength of the channel mode")
    parser.add_argument("--variants", default="unbalanced,layer,channel", help="comma-separated subset to run")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_balancing"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    base, tokenizer = hf_knorm.load_default_model()
    train, held_out = shakespeare_split()
    windows = token_windows(tokenizer, held_out, args.window, args.eval_tokens)
    calibration = calibration_batches(base, tokenizer, train, 512, args.calibration_tokens)
    print(f"held-out: {sum(len(w) for w in windows)} tokens in {len(windows)} windows of {args.window}; "
          f"calibration: {args.calibration_tokens} tokens; threads: {torch.get_num_threads()}")

    wanted = args.variants.split(",")
    variants = {"unbalanced": base} if "unbalanced" in wanted else {}
    logit_change = {}
    for mode in [m for m in ("layer", "channel") if m in wanted]:
        model = copy.deepcopy(base)
        report = balance_kv(model, tokenizer, train, mode=mode, alpha=args.alpha, max_tokens=args.calibration_tokens)
        logit_change[mode] = report.max_logit_change
        variants[mode if mode == "layer" else f"channel (alpha={args.alpha})"] = model
        ratios = report.before.ratios()
        print(f"{mode}: max |logit change| {report.max_logit_change:.3g} (allowed {report.tolerance:.3g}); "
              f"K/V mean-norm ratio before {ratios.min():.2f}..{ratios.max():.2f}, "
              f"after {report.after.ratios().min():.3f}..{report.after.ratios().max():.3f}")

    channels = 2 * 3 * 64
    rows: dict[str, dict[str, float]] = {}
    for name, model in variants.items():
        pca = JointLowRank.fit(model, calibration)
        codecs = {"none (exact K/V)": None}
        codecs.update({f"joint low-rank r={int(f * channels)} ({int(f * 100)}%)": pca.with_rank(int(f * channels))
                       for f in (0.25, 0.5, 0.75)})
        codecs.update({f"per-token int{b}, group 64": per_token_groups(b, 64) for b in (4, 3, 2)})
        codecs["fp8 e4m3, one absmax scale for K and V"] = shared_absmax_fp8
        for label, codec in codecs.items():
            with routed_through_plugin(model), KVTransform(codec or (lambda m, k, v: (k, v))):
                result = perplexity_of_windows(model, windows, desc=f"{name}: {label}")
            rows.setdefault(label, {})[name] = result.perplexity
            print(f"{name:>10} | {label:<42} | ppl {result.perplexity:.3f}  ({time.time() - start:.0f} s)", flush=True)

    tables = _tables(rows, list(variants))
    print("\n" + tables)
    (args.out / "tables.md").write_text(tables + "\n")
    (args.out / "results.json").write_text(json.dumps({
        "eval_tokens": sum(len(w) for w in windows), "window": args.window,
        "calibration_tokens": args.calibration_tokens,
        "alpha": args.alpha, "max_logit_change": logit_change, "perplexity": rows, "seconds": time.time() - start,
    }, indent=2) + "\n")
    print(f"done in {time.time() - start:.0f} s; results in {args.out}")


def _tables(rows: dict[str, dict[str, float]], names: list[str]) -> str:
    lines = []
    for title, keep in (("Joint low-rank [K; V] (TransMLA)", lambda r: "low-rank" in r or r.startswith("none")),
                        ("Quantization", lambda r: "low-rank" not in r)):
        lines += [f"**{title}**: perplexity (lower is better)", "",
                  "| K/V codec | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for label, values in rows.items():
            if keep(label):
                shown = {n: f"{values[n]:.2f}" for n in names}
                best = min(shown.values(), key=float)
                unique = len(names) > 1 and list(shown.values()).count(best) == 1
                cells = [f"**{shown[n]}**" if unique and shown[n] == best else shown[n] for n in names]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
