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
    demo.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a checkpoint folder")
    demo.add_argument("--normalizations", default="softmax,x/1,x/16,x^3/1,x^3/16,x^3/sqrtN",
                      help="comma-separated normalizations (default: the paper's legend plus x^3/sqrtN)")
    demo.add_argument("--out", type=Path, default=Path("outputs/demo"), help="output folder")
    demo.set_defaults(run=_run_demo)

    # --- further subcommands are added below this line, one block each ---

    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.model, args.normalizations.split(","), args.out)
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
