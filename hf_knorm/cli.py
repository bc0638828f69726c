"""The ``hf-knorm`` command line: runs the plugin's jobs on the embedded default model (or a local checkpoint).

Each subcommand is one function ``_run_<name>(args)`` plus its parser in ``_build_parser``; the work itself lives in
the library, so everything the CLI does is also one Python call away.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-knorm",
        description="Attention-norm tools for Hugging Face Transformers (runs offline on SmolLM2-135M-Instruct by default).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="patch the model with each normalization; compare next-token predictions and perplexity",
        description="Patch the model with each normalization in turn and print its next-token predictions and its "
        "perplexity on a built-in text; writes demo.json to --out.",
    )
    _add_model_argument(demo)
    demo.add_argument("--normalizations", default="softmax,x/1,x/16,x^3/1,x^3/16,x^3/sqrtN",
                      help="comma-separated normalizations (default: the paper's legend plus x^3/sqrtN)")
    demo.add_argument("--out", type=Path, default=Path("outputs/demo"), help="output folder")
    demo.set_defaults(run=_run_demo)

    # --- further subcommands are added below this line, one block each ---

    kv_norms = commands.add_parser(
        "kv-norms",
        help="K/V balancing: per-channel key/value norms before and after (TransMLA's 'Original vs. Balanced kv-norm')",
        description="Balance the model's keys and values exactly (hf_knorm.balance_kv) on Shakespeare's works and write "
        "the figure for one layer, the K/V mean-norm ratio of every layer before and after, and the numbers as JSON.",
    )
    _add_model_argument(kv_norms)
    kv_norms.add_argument("--mode", choices=("layer", "channel"), default="layer", help="one scale per layer or per channel")
    kv_norms.add_argument("--alpha", type=float, default=0.5, help="migration strength of --mode channel, in (0, 1]")
    kv_norms.add_argument("--layer", type=int, default=None, help="layer of the figure (default: the one with the largest K/V norm ratio)")
    kv_norms.add_argument("--calibration-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    kv_norms.add_argument("--out", type=Path, default=Path("outputs/kv_norms"), help="output folder")
    kv_norms.set_defaults(run=_run_kv_norms)

    niah = commands.add_parser(
        "niah",
        help="needle-in-a-haystack and passkey retrieval under KNorm KV-cache compression; heatmaps per ratio",
        description="Needle-in-a-haystack (Paul Graham essays) and passkey retrieval with the context's KV cache "
        "compressed by KNorm (kvpress protocol: context compressed, question not). Writes results.json/csv "
        "(resumable), one heatmap per task and ratio, and summary.md to --out.",
    )
    _add_model_argument(niah)
    niah.add_argument("--ratios", default="0,0.5,0.75,0.9",
                      help="comma-separated compression ratios (0 = uncompressed)")
    niah.add_argument("--scores", default="key_norm",
                      help="comma-separated eviction scores, one row per ratio and score: key_norm (the paper's, the "
                      "default), value_over_key, key_diff, kv_diff, recent, random; append +sinksK / +windowW to "
                      "protect the first K / last W tokens (e.g. recent+sinks4 is StreamingLLM, "
                      "kv_diff+sinks4+window64), +poolP to set the window of key_diff / kv_diff")
    niah.add_argument("--lengths", default="1000,2000,4000,8000", help="comma-separated context lengths (tokens)")
    niah.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="comma-separated needle depths in [0, 1]")
    niah.add_argument("--seeds", type=int, default=1, help="needle seeds per cell (default 1: ~40 min on 2 CPU cores)")
    niah.add_argument("--passkey-seeds", type=int, default=1, help="passkey seeds per cell (default 1; 0 = skip)")
    niah.add_argument("--no-options", dest="options", action="store_false",
                      help="skip the extra rows at ratio 0.5 (sinks+window, layers 0-1 kept, authors' protocol)")
    niah.add_argument("--out", type=Path, default=Path("outputs/niah"), help="output folder (a rerun resumes)")
    niah.set_defaults(run=_run_niah)

    return parser


def _add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a checkpoint folder")


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.model, args.normalizations.split(","), args.out)
    return 0


def _run_niah(args: argparse.Namespace) -> int:
    from .evaluation.needle import run_niah_job

    def floats(text: str) -> list[float]:
        return [float(item) for item in text.split(",") if item.strip()]

    run_niah_job(args.model, floats(args.ratios), [int(n) for n in floats(args.lengths)], floats(args.depths),
                 args.seeds, args.passkey_seeds, args.options, args.out,
                 scores=[spec for spec in args.scores.split(",") if spec.strip()])
    return 0


def _run_kv_norms(args: argparse.Namespace) -> int:
    from .assets.texts import shakespeare_split
    from .balancing.balance import balance_kv
    from .models.persistence import load_model

    model, tokenizer = load_model(args.model)
    layers = model.config.num_hidden_layers
    if args.layer is not None and not 0 <= args.layer < layers:  # checked before the minute of calibration
        raise ValueError(f"--layer {args.layer} is out of range: the model has layers 0..{layers - 1}.")
    texts, _ = shakespeare_split()  # calibrate on the training split; Hamlet and the sonnets stay held out
    report = balance_kv(model, tokenizer, texts, args.mode, alpha=args.alpha, max_tokens=args.calibration_tokens)
    for name, path in report.save(args.out, args.layer).items():
        print(f"{name}: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"hf-knorm {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
