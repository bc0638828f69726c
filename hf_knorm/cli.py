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
        help="the main job: normalizations, K/V balancing, KNorm needle test, fine-tuning with the norm callback, "
        "the model saved with its card; one HTML report",
        description="Run every capability on the model, one step each: (1) the normalizations side by side, (2) K/V "
        "balancing and its figure, (3) a needle-in-a-haystack grid with and without KNorm, (4) a short fine-tuning run "
        "with NormLoggerCallback and TensorBoard, (5) the fine-tuned model saved with its model card exactly as "
        "push_to_hub would send it. Writes report.html (self-contained), demo.json and each step's files to --out. "
        "Minutes on a 2-core CPU at the defaults (BENCHMARKS.md); --fast shrinks every step to seconds.",
    )
    _add_model_argument(demo)
    demo.add_argument("--out", type=Path, default=Path("outputs/demo"), help="output folder")
    demo.add_argument("--fast", action="store_true", help="shrink every step (for tests and a first look)")
    demo.add_argument("--normalizations", default=None,
                      help="step 1: comma-separated normalizations (default: softmax,x/1,x/16,x^3/1,x^3/16,x^3/sqrtN)")
    demo.add_argument("--balance-mode", choices=("layer", "channel"), default=None, help="step 2 (default: layer)")
    demo.add_argument("--calibration-tokens", type=int, default=None, help="step 2 (default 4096)")
    demo.add_argument("--niah-lengths", default=None, help="step 3: comma-separated context lengths (default 1000,2000)")
    demo.add_argument("--niah-depths", default=None, help="step 3: comma-separated needle depths (default 0,0.25,0.5,0.75,1)")
    demo.add_argument("--niah-ratio", type=float, default=None, help="step 3: KNorm compression ratio (default 0.5)")
    demo.add_argument("--niah-score", default=None,
                      help="step 3: eviction score shown beside the paper's key_norm (default kv_diff, the recommended)")
    demo.add_argument("--train-normalization", default=None, help="step 4: normalization to fine-tune (default x^3/16)")
    demo.add_argument("--train-steps", type=int, default=None, help="step 4: optimizer steps (default 30)")
    demo.add_argument("--push-to", default=None, metavar="REPO_ID",
                      help="step 5: also push the fine-tuned model and its card to this Hub repo (needs a token)")
    demo.add_argument("--token", default=None, help="Hub token for --push-to (default: HF_TOKEN or the saved login)")
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
                      "default), kv_diff (the recommended one), value_over_key, key_diff, recent, random; append +sinksK / +windowW to "
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

    push = commands.add_parser(
        "push",
        help="push a saved model folder to the Hugging Face Hub with its model card, in one commit",
        description="Push MODEL_DIR (saved by hf_knorm.save_pretrained or Transformers) to REPO_ID: every file, the "
        "model card rendered for REPO_ID (text written outside its generated block is kept), in one commit. "
        "The token comes from --token, else HF_TOKEN, else `hf auth login`.",
    )
    push.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="the saved model folder")
    push.add_argument("repo_id", metavar="REPO_ID", help="namespace/name on the Hub (created if missing)")
    push.add_argument("--private", action="store_true",
                      help="create the repo private (an existing repo keeps its visibility)")
    push.add_argument("--token", default=None,
                      help="a Hugging Face write token (default: HF_TOKEN, else the saved login)")
    push.add_argument("--commit-message", default=None, help="the commit message (default: what is pushed)")
    push.add_argument("--no-tokenizer", action="store_true",
                      help="push a causal LM whose folder has no tokenizer (refused otherwise)")
    push.set_defaults(run=_run_push)

    finetune = commands.add_parser(
        "finetune",
        help="fine-tune a causal LM with a normalization on any text dataset; per-layer norms logged while it trains",
        description="Fine-tune the model (default: SmolLM2-135M-Instruct) with --normalization on a text dataset: "
        "an embedded corpus (shakespeare, paul-graham), local files (.txt, .json/.jsonl, .csv, .parquet) or a "
        "datasets name, packed into blocks. Per-layer attention and K/V norms go to TensorBoard and norms.jsonl; "
        "checkpoints to --out, which ends with the model saved so that it reloads with its normalization. Bad input "
        "is refused before training starts.",
    )
    _add_model_argument(finetune)
    finetune.add_argument("--dataset", default="shakespeare",
                          help="shakespeare | paul-graham | local file(s), comma-separated | a datasets name")
    finetune.add_argument("--text-column", default="text", help="the column holding the text (default: text)")
    finetune.add_argument("--split", default="train", help="the split to read (default: train)")
    finetune.add_argument("--normalization", default="x^3/16", help="attention normalization (default x^3/16)")
    finetune.add_argument("--balance", choices=("layer", "channel"), default=None,
                          help="balance keys and values (exact) before fine-tuning")
    finetune.add_argument("--block-size", type=int, default=256, help="tokens per example (default 256)")
    finetune.add_argument("--batch-size", type=int, default=4, help="examples per device and step (default 4)")
    finetune.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches per step")
    finetune.add_argument("--max-steps", type=int, default=200, help="optimizer steps (default 200)")
    finetune.add_argument("--learning-rate", type=float, default=5e-5, help="peak learning rate (default 5e-5)")
    finetune.add_argument("--logging-steps", type=int, default=10, help="log loss and norms every N steps")
    finetune.add_argument("--save-steps", type=int, default=50, help="checkpoint every N steps")
    finetune.add_argument("--max-blocks", type=int, default=None, help="use at most N blocks of the dataset")
    finetune.add_argument("--seed", type=int, default=0, help="random seed")
    finetune.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", help="no TensorBoard logs")
    finetune.add_argument("--keep-going-on-nonfinite", dest="stop_on_nonfinite", action="store_false",
                          help="do not stop at the first non-finite loss")
    finetune.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    finetune.add_argument("--out", type=Path, default=Path("outputs/finetune"), help="run folder")
    finetune.set_defaults(run=_run_finetune)

    attention_norms = commands.add_parser(
        "attention-norms",
        help="the 'attention norms across 12 layers' figure: one 12-layer ViT per normalization on 8x8 digits",
        description="Train the same 12-layer ViT (ViT-Tiny width, patches of 2 on scikit-learn's 8x8 digits) once per "
        "normalization, same seed and data, logging per-layer norms; then draw the 3 x 4 panel figure (log y, one "
        "line per normalization). Runs already finished in --out are not trained again.",
    )
    attention_norms.add_argument("--normalizations", default=",".join(("softmax", "x/1", "x/16", "x^3/1", "x^3/16")),
                                 help="comma-separated normalizations (default: the paper's legend)")
    attention_norms.add_argument("--epochs", type=float, default=20, help="epochs per run (default 20; paper: 200)")
    attention_norms.add_argument("--layers", type=int, default=12, help="transformer layers (default 12)")
    attention_norms.add_argument("--hidden", type=int, default=192, help="width (default 192, ViT-Tiny)")
    attention_norms.add_argument("--heads", type=int, default=3, help="attention heads (default 3, ViT-Tiny)")
    attention_norms.add_argument("--batch-size", type=int, default=64, help="images per step (default 64)")
    attention_norms.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    attention_norms.add_argument("--logging-steps", type=int, default=5, help="norms every N steps (default 5)")
    attention_norms.add_argument("--max-steps", type=int, default=-1, help="stop each run after N steps (-1: epochs)")
    attention_norms.add_argument("--seed", type=int, default=0, help="seed of the weights, the split and the order")
    attention_norms.add_argument("--out", type=Path, default=Path("outputs/attention_norms"), help="output folder")
    attention_norms.set_defaults(run=_run_attention_norms)

    return parser


def _add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a checkpoint folder")


def _run_demo(args: argparse.Namespace) -> int:
    from .demo.job import run_demo
    from .demo.settings import DemoSettings

    base = DemoSettings.fast() if args.fast else DemoSettings()
    settings = base.with_overrides(
        normalizations=_items(args.normalizations, str), balance_mode=args.balance_mode,
        calibration_tokens=args.calibration_tokens, niah_lengths=_items(args.niah_lengths, int),
        niah_depths=_items(args.niah_depths, float), niah_ratio=args.niah_ratio, niah_score=args.niah_score,
        train_normalization=args.train_normalization, train_steps=args.train_steps,
    )
    run_demo(args.model, args.out, settings, push_to=args.push_to, token=args.token)
    return 0


def _items(text: str | None, kind) -> tuple | None:
    """A comma-separated flag as a tuple of ``kind``; ``None`` when the flag was not given."""
    if text is None:
        return None
    return tuple(kind(item.strip()) for item in text.split(",") if item.strip())


def _run_niah(args: argparse.Namespace) -> int:
    from .evaluation.needle import run_niah_job

    run_niah_job(args.model, _items(args.ratios, float), _items(args.lengths, int), _items(args.depths, float),
                 args.seeds, args.passkey_seeds, args.options, args.out, scores=list(_items(args.scores, str)))
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


def _run_push(args: argparse.Namespace) -> int:
    from .hub.push import push_folder

    commit = push_folder(args.model_dir, args.repo_id, private=args.private or None, token=args.token,
                         commit_message=args.commit_message, without_tokenizer=args.no_tokenizer)
    print(f"pushed {args.model_dir} to {args.repo_id}: {commit.commit_url}")
    return 0


def _run_finetune(args: argparse.Namespace) -> int:
    from .training.finetune import FinetuneSettings, run_finetune

    settings = FinetuneSettings(
        dataset=args.dataset, out=str(args.out), model=args.model, normalization=args.normalization,
        balance=args.balance, text_column=args.text_column, split=args.split, block_size=args.block_size,
        batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps, learning_rate=args.learning_rate, logging_steps=args.logging_steps,
        save_steps=args.save_steps, max_blocks=args.max_blocks, seed=args.seed,
        report_to=("tensorboard",) if args.tensorboard else (), stop_on_nonfinite_loss=args.stop_on_nonfinite,
        resume=args.resume,
    )
    summary = run_finetune(settings)
    print(f"model ({summary['normalization']}): {args.out}; norms: {args.out / 'norms.jsonl'}; "
          f"TensorBoard: tensorboard --logdir {args.out}")
    return 0


def _run_attention_norms(args: argparse.Namespace) -> int:
    from .training.attention_norms import AttentionNormsSettings, run_attention_norms

    settings = AttentionNormsSettings(
        out=str(args.out), normalizations=tuple(n.strip() for n in args.normalizations.split(",") if n.strip()),
        epochs=args.epochs, layers=args.layers, hidden=args.hidden, heads=args.heads, batch_size=args.batch_size,
        learning_rate=args.learning_rate, logging_steps=args.logging_steps, max_steps=args.max_steps, seed=args.seed,
    )
    summary = run_attention_norms(settings)
    print(f"figure: {summary['figure']}")
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
