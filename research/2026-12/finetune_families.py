r"""Which normalization family the pretrained default model accepts best: the same short fine-tune per family.

For each ``--families`` entry (softmax as the control), one ordinary ``hf-knorm finetune`` run
(:func:`hf_knorm.jobs.finetune.run_finetune`) of the default model (SmolLM2-135M-Instruct, embedded), the same for
all: the same data (``--dataset``, its first ``steps * batch`` blocks), the same seed, steps, block size, batch and
learning rate; NormLoggerCallback writes each run's ``norms.jsonl``. Around it, the held-out perplexity of the four
domains (:mod:`hf_knorm.evaluation.domains`: essays, plays, technical, conversation; each its first
``--eval-tokens`` tokens in blocks of ``--block-size``, as ``hf-knorm convert`` evaluates them) is measured on the
model patched with the family **before** training (the swap alone, nothing learned: the family's learnable values at
their initial values) and **after** (the saved run reloaded with ``hf_knorm.from_pretrained``, its learned values
included). Runs one after the other (never two at once on 2 cores); a family whose ``family_result.json`` exists is
not run again, so the script resumes; ``--report`` only gathers the folders into ``summary.md``/``summary.json`` and
the figure (``--figure``: a few layers' ``||A||_F`` during fine-tuning, one line per family).

The fine-tuned weights are removed after they are measured (``--keep-models`` keeps them): 0.5 GB a run.

Usage (docs/research/2026-12-training.md, "Normalization families on the pretrained model: a short fine-tune"):
    OMP_NUM_THREADS=1 python research/2026-12/finetune_families.py --out outputs/finetune_families
    python research/2026-12/finetune_families.py --out outputs/finetune_families --report \
        --figure docs/figures/training/finetune_families.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

FAMILIES = ("softmax", "x^3/16", "relu(x)^2/n", "sigmoid(bias=-log n)", "softmax(sink=learned)", "softpick",
            "ssmax(scale=learned)", "stick-breaking", "relu(x)^3/16")
"""Softmax (the control) and one or two spellings per other family (the project's default x^3/16; rectified at p = 2
with c = n and, last, at the default's p = 3, c = 16), in the order they run: the last ones are the first to prune."""
DOMAIN_NAMES = ("essays", "plays", "technical", "conversation")
RESULT_FILE = "family_result.json"


def slug(normalization: str) -> str:
    """A folder name: ``relu(x)^2/n`` -> ``relu-x-2-n``, ``sigmoid(bias=-log n)`` -> ``sigmoid-bias-log-n``."""
    return re.sub(r"[^A-Za-z0-9.+]+", "-", normalization.replace("^", "").replace("/", "-")).strip("-")


def domain_perplexities(model, blocks: dict) -> dict[str, float]:
    from hf_knorm.data.heldout import held_out_perplexity

    return {name: held_out_perplexity(model, blocks[name], desc=name) for name in blocks}


def run_family(normalization: str, args, blocks: dict) -> dict:
    """Measure before, fine-tune, measure after; returns the family's result (also written to its folder)."""
    import torch
    import transformers

    import hf_knorm
    from hf_knorm.jobs.finetune import FinetuneSettings, run_finetune
    from hf_knorm.runs.sources import causal_lm_source

    folder = Path(args.out) / slug(normalization)
    model_dir, _ = causal_lm_source("default", args.block_size)
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if normalization != "softmax":
        hf_knorm.patch(model, normalization)
    before = domain_perplexities(model, blocks)
    before_seconds = time.perf_counter() - start
    del model

    settings = FinetuneSettings(
        dataset=args.dataset, out=str(folder / "run"), model="default", normalization=normalization,
        block_size=args.block_size, batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed,
        logging_steps=args.logging_steps, save_steps=10 * args.steps, max_blocks=args.steps * args.batch_size,
        eval_tokens=args.block_size, eval_steps=args.steps, report_to=("none",))
    start = time.perf_counter()
    summary = run_finetune(settings)
    finetune_seconds = time.perf_counter() - start

    start = time.perf_counter()
    model = hf_knorm.from_pretrained(settings.out, model_class=transformers.AutoModelForCausalLM)
    after = domain_perplexities(model, blocks)
    after_seconds = time.perf_counter() - start
    learned = {}
    for name in hf_knorm.parse_normalization(normalization).learnable():
        from hf_knorm.models.parameters import learned_values

        values = torch.stack(learned_values(model, name))
        learned[name] = {"min": float(values.min()), "mean": float(values.mean()), "max": float(values.max())}
    del model
    if not args.keep_models:
        for weights in Path(settings.out).glob("*.safetensors"):
            weights.unlink()
    result = {
        "normalization": normalization, "before": before, "after": after, "learned": learned,
        "train_loss": summary["train_loss"], "global_step": summary["global_step"],
        "first_nonfinite": summary["first_nonfinite"], "stopped_at_step": summary["stopped_at_step"],
        "finetune_seconds": finetune_seconds, "before_seconds": before_seconds, "after_seconds": after_seconds,
        "threads": torch.get_num_threads(), "settings": vars(args),
    }
    partial = folder / (RESULT_FILE + ".partial")
    partial.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(partial, folder / RESULT_FILE)
    return result


def report(out: Path, families: list[str], figure: Path | None, layers: list[int] | None) -> str:
    results = [json.loads((out / slug(f) / RESULT_FILE).read_text()) for f in families
               if (out / slug(f) / RESULT_FILE).is_file()]
    control = next((r for r in results if r["normalization"] == "softmax"), None)
    head = ["family"] + [f"{d} before / after" for d in DOMAIN_NAMES] + ["after / softmax's after, per domain",
                                                                         "fine-tune time"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in results:
        cells = [f"{_ppl(r['before'][d])} / {_ppl(r['after'][d])}" for d in DOMAIN_NAMES]
        ratios = (", ".join(_number(r['after'][d] / control['after'][d]) if math.isfinite(r['after'][d]) else "nan"
                            for d in DOMAIN_NAMES) if control else "-")
        lines.append(f"| {r['normalization']} | " + " | ".join(cells) + f" | {ratios} | {r['finetune_seconds']:.0f} s |")
    table = "\n".join(lines)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    if figure is not None and results:
        draw(out, [r["normalization"] for r in results], figure, layers)
    return table


def draw(out: Path, families: list[str], path: Path, layers: list[int] | None) -> Path:
    """A few layers' ``||A||_F`` against the fine-tuning step, one panel per layer, one line per family, log y."""
    import numpy as np

    from hf_knorm.plots import LINE_COLORS
    from hf_knorm.training.history import read_norm_history
    from matplotlib.figure import Figure

    histories = {f: read_norm_history(out / slug(f) / "run") for f in families}
    total = len(next(iter(histories.values()))[0]["layers"])
    layers = layers or sorted({0, total // 3, 2 * total // 3, total - 1})
    columns = min(2, len(layers))
    rows = -(-len(layers) // columns)
    legend_rows = -(-len(histories) // 5)
    height = 3.0 * rows + 0.5 + 0.3 * legend_rows
    fig = Figure(figsize=(5.2 * columns, height))
    axes = list(np.atleast_1d(fig.subplots(rows, columns, sharex=True, squeeze=False)).ravel())
    for number, (family, history) in enumerate(histories.items()):
        steps = [record["step"] for record in history]
        for ax, layer in zip(axes, layers):
            values = np.array([record["layers"][layer]["attn_fro"] for record in history], dtype=float)
            ax.plot(steps, values, marker="o", ms=3, lw=1.2, color=LINE_COLORS[number % len(LINE_COLORS)],
                    ls="-" if family == "softmax" else "--", label=family if ax is axes[0] else None)
    for number, ax in enumerate(axes):
        if number >= len(layers):
            ax.set_visible(False)
            continue
        ax.set_yscale("log")
        ax.set_title(f"Layer {layers[number] + 1} of {total}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        if number % columns == 0:
            ax.set_ylabel("||A||_F")
        if number >= len(layers) - columns:
            ax.set_xlabel("fine-tuning step")
    fig.legend(loc="lower center", ncol=min(len(histories), 5), frameon=False)
    fig.suptitle("||A||_F during a short fine-tune of SmolLM2-135M-Instruct, one line per normalization")
    fig.tight_layout(rect=(0, (0.15 + 0.3 * legend_rows) / height, 1, 1 - 0.35 / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _ppl(value: float) -> str:
    return _number(value) if math.isfinite(value) else "nan"


def _number(value: float) -> str:
    """Three significant figures; scientific notation from 10^4 on (a swapped model's perplexity reaches 10^11)."""
    return f"{value:.3g}" if value < 1e4 else f"{value:.2e}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/finetune_families")
    parser.add_argument("--families", default=",".join(FAMILIES), help="normalizations, separated by ';'"
                        " or ',' (a spelling holds no comma)")
    parser.add_argument("--dataset", default="shakespeare", help="hf-knorm finetune's --dataset (its default)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="hf-knorm finetune's default")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tokens", type=int, default=512, help="held-out tokens per domain")
    parser.add_argument("--keep-models", action="store_true")
    parser.add_argument("--report", action="store_true", help="only gather the finished runs")
    parser.add_argument("--figure", type=Path, default=None, help="also draw the norm figure here")
    parser.add_argument("--layers", default=None, help="comma-separated 1-based layers for the figure")
    args = parser.parse_args(argv)
    families = [f.strip() for f in re.split(r"[;,]", args.families) if f.strip()]
    out = Path(args.out)
    layers = [int(layer) - 1 for layer in args.layers.split(",")] if args.layers else None
    if not args.report:
        import transformers

        from hf_knorm.data.heldout import held_out_domain_blocks
        from hf_knorm.runs.sources import causal_lm_source

        tokenizer = transformers.AutoTokenizer.from_pretrained(causal_lm_source("default", args.block_size)[0])
        blocks = held_out_domain_blocks(DOMAIN_NAMES, tokenizer, args.block_size, args.eval_tokens)
        for family in families:
            if (out / slug(family) / RESULT_FILE).is_file():
                print(f"{family}: done already", flush=True)
                continue
            result = run_family(family, args, blocks)
            print(f"{family}: before {result['before']}, after {result['after']}, "
                  f"{result['finetune_seconds']:.0f} s", flush=True)
    print(report(out, families, args.figure or out / "finetune_families.png", layers))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
