"""The job behind ``hf-knorm attention-norms``: the paper's "attention norms across 12 layers" figure, reproduced.

The same 12-layer ViT (:mod:`hf_knorm.data.digits_vit`) is trained from the same initial weights, on the same
data in the same order, once per normalization, with :class:`~hf_knorm.training.callback.NormLoggerCallback`
writing each run's ``norms.jsonl``. By default every family of :mod:`hf_knorm.normalizations` is trained: the paper's
five (softmax, x/1, x/16, x^3/1, x^3/16) and one spelling per other family (:data:`OTHER_FAMILIES`), twelve runs. The
figure is drawn from the history files: 3 x 4 panels, one per layer, log y, one line per normalization, x in epochs;
twelve colours, the paper's normalizations solid and the other families dashed, the legend below the panels. The
softmax run keeps Transformers' own attention (the callback reads it through hf_knorm's softmax on logging steps
only); every other run is patched, its learnable values (a sink logit, SSMax's scale) trained with the weights.

The ``16`` of ``x/16`` and ``x^3/16`` is kept as the paper's legend spells it (there it is sqrt(256) tokens); here a
sequence has N = 17 tokens, so sqrt(N) would be 4.1.

Each run folder holds ``norms.jsonl`` and ``result.json`` (held-out accuracy, time); a run whose ``result.json``
exists is not trained again, so an interrupted job resumes run by run. ``summary.json`` and ``summary.md`` gather
the runs (accuracy, time, and per layer each normalization's median ``||A||_F`` over the second half of training,
with their order); ``attention_norms.png`` is the figure.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..normalizations import parse_normalization
from ..training.history import read_norm_history
from ..training.norm_figure import plot_norm_history

PAPER_NORMALIZATIONS = ("softmax", "x/1", "x/16", "x^3/1", "x^3/16")
"""The paper's legend."""
OTHER_FAMILIES = ("relu(x)/n", "relu(x)^2/n", "sigmoid(bias=-log n)", "softmax(sink=learned)", "softpick",
                  "ssmax(scale=learned)", "stick-breaking")
"""One spelling per other family of :mod:`hf_knorm.normalizations`, chosen for this encoder (N = 17 keys in every
row, attending both ways): the rectified family with ``c = n`` at p = 1 and 2, the sigmoid with its ``-log n`` bias,
softmax with a learned sink logit, softpick, SSMax with a learned scale, stick-breaking."""
FIGURE_NORMALIZATIONS = PAPER_NORMALIZATIONS + OTHER_FAMILIES


@dataclass
class AttentionNormsSettings:
    """Settings of the figure job: each field is a flag of ``hf-knorm attention-norms``, with its help in
    ``metadata["help"]``.

    Defaults (twelve runs, one per line of the figure; the times are in BENCHMARKS.md): ViT-Tiny's 12
    layers, width 192 and 3 heads; 20 epochs of batches of 64 (the paper: 200 epochs, by
    ``epochs``); AdamW, learning rate 1e-3 with 5% warmup and cosine decay, weight decay 0.05, gradient clipping
    at 1.0 (Transformers' default), norms logged every 5 steps (about 4.6 times per epoch).
    """

    out: str = field(default="outputs/attention_norms", metadata={
        "help": "output folder: one run folder per normalization, the figure, summary.json/md"})
    normalizations: tuple[str, ...] = field(default=FIGURE_NORMALIZATIONS, metadata={
        "help": "comma-separated normalizations, one run each (default: the paper's five and one spelling "
                "per other family)"})
    epochs: float = field(default=20, metadata={"help": "epochs per run (the paper: 200)"})
    layers: int = field(default=12, metadata={"help": "transformer layers (ViT-Tiny: 12)"})
    hidden: int = field(default=192, metadata={"help": "width (ViT-Tiny: 192)"})
    heads: int = field(default=3, metadata={"help": "attention heads (ViT-Tiny: 3)"})
    batch_size: int = field(default=64, metadata={"help": "images per step"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate (AdamW, cosine decay)"})
    weight_decay: float = field(default=0.05, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = field(default=0.05, metadata={"help": "warmup, as a fraction of the steps"})
    logging_steps: int = field(default=5, metadata={"help": "per-layer norms every N steps"})
    seed: int = field(default=0, metadata={"help": "seed of the weights, the split and the order (same for all runs)"})
    max_steps: int = field(default=-1, metadata={"help": "stop each run after N steps (-1: run the epochs)"})


def run_slug(normalization: str) -> str:
    """A folder name for a normalization: ``x^3/16`` -> ``x3-16``, ``softmax`` -> ``softmax``,
    ``sigmoid(bias=-log n)`` -> ``sigmoid-bias-log-n``, ``relu(x)^2/n`` -> ``relu-x-2-n``."""
    name = parse_normalization(normalization).name.replace("^", "").replace("/", "-")
    return re.sub(r"[^A-Za-z0-9.+]+", "-", name).strip("-")


def run_attention_norms(settings: AttentionNormsSettings) -> dict:
    """Train one ViT per normalization, then draw the figure; returns the summary (also written as JSON and MD).

    Raises:
        ValueError: an unknown normalization (checked before anything trains).
    """
    names = [parse_normalization(spelling).name for spelling in settings.normalizations]
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        run_dir = out / run_slug(name)
        result_file = run_dir / "result.json"
        if result_file.is_file():
            print(f"{name}: already trained ({result_file})")
        else:
            _write_json(result_file, train_digits_vit(name, run_dir, settings))
        results.append(json.loads(result_file.read_text()))
        print(f"{name}: accuracy {results[-1]['test_accuracy']:.3f}, {results[-1]['seconds']:.0f} s")
    figure = plot_norm_history(
        [out / run_slug(name) for name in names], out / "attention_norms.png", statistic="attn_fro", labels=names,
        x="epoch", title=f"Attention-matrix Frobenius norm per layer, {settings.layers}-layer ViT on 8x8 digits",
        linestyles=["-" if name in PAPER_NORMALIZATIONS else "--" for name in names],
    )
    medians = late_medians({name: read_norm_history(out / run_slug(name)) for name in names})
    summary = {"settings": asdict(settings), "figure": str(figure), "runs": results, "late_medians": medians}
    _write_json(out / "summary.json", summary)
    (out / "summary.md").write_text(summary_table(results) + "\n\n" + ordering_table(medians) + "\n")
    return summary


def train_digits_vit(normalization: str, run_dir: Path, settings: AttentionNormsSettings) -> dict:
    """Train one ViT with ``normalization`` into ``run_dir``; returns its result (accuracy, final norms, time)."""
    import torch
    import transformers

    from ..models.patching import patch
    from ..training.callback import NormLoggerCallback
    from ..data.digits_vit import accuracy, digits_splits, digits_vit_config

    train, test = digits_splits(settings.seed)
    transformers.set_seed(settings.seed)  # the same initial weights for every normalization
    model = transformers.ViTForImageClassification(
        digits_vit_config(settings.layers, settings.hidden, settings.heads)
    )
    if name_is_polynomial(normalization):
        patch(model, normalization)
    args = transformers.TrainingArguments(
        output_dir=str(run_dir),
        num_train_epochs=settings.epochs,
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        weight_decay=settings.weight_decay,
        warmup_steps=settings.warmup_ratio,
        lr_scheduler_type="cosine",
        logging_steps=settings.logging_steps,
        save_strategy="no",
        report_to="none",
        seed=settings.seed,
        data_seed=settings.seed,
        disable_tqdm=True,
        dataloader_drop_last=True,
        dataloader_pin_memory=False,
    )
    callback = NormLoggerCallback()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train, callbacks=[callback],
                                   data_collator=_collate)
    start = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - start
    history = read_norm_history(run_dir)
    last = history[-1]
    return {
        "normalization": normalization,
        "test_accuracy": accuracy(model, test),
        "train_loss": output.training_loss,
        "global_step": trainer.state.global_step,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "first_nonfinite": callback.first_nonfinite,
        "final_epoch": last.get("epoch"),
        "final_attn_fro": [layer["attn_fro"] for layer in last["layers"]],
        "peak_attn_fro": [max((r["layers"][i]["attn_fro"] for r in history), default=math.nan, key=_finite_key)
                          for i in range(len(last["layers"]))],
    }


def name_is_polynomial(normalization: str) -> bool:
    return not parse_normalization(normalization).is_softmax


def summary_table(results: list[dict]) -> str:
    """A Markdown table: per normalization, held-out accuracy, the training loss (mean over the run), the final
    ``||A||_F`` range over layers, the first non-finite statistic, time."""
    lines = ["| normalization | held-out accuracy | training loss, mean over the run "
             "| final Frobenius norm of A, min - max over layers | first non-finite | time |", "|---|---|---|---|---|---|"]
    for result in results:
        finals = [value for value in result["final_attn_fro"] if math.isfinite(value)]
        span = f"{min(finals):.3g} - {max(finals):.3g}" if finals else "non-finite"
        first = result["first_nonfinite"]
        lines.append(f"| {result['normalization']} | {result['test_accuracy']:.3f} | {result['train_loss']:.3g} | {span} | "
                     f"{'step %s, %s' % tuple(first) if first else '-'} | {result['seconds']:.0f} s |")
    return "\n".join(lines)


def late_medians(histories: dict[str, list[dict]], statistic: str = "attn_fro") -> list[dict[str, float]]:
    """Per layer, each run's median ``statistic`` over the second half of its logging steps (NaN when none is finite).

    The second half leaves out the early transients; a run that went non-finite has NaN from there on.
    """
    layers = max(len(history[0]["layers"]) for history in histories.values() if history)
    medians = []
    for layer in range(layers):
        row = {}
        for name, history in histories.items():
            late = [record["layers"][layer][statistic] for record in history[len(history) // 2:]]
            finite = sorted(value for value in late if math.isfinite(value))
            row[name] = finite[len(finite) // 2] if finite and len(finite) == len(late) else math.nan
        medians.append(row)
    return medians


def ordering_table(medians: list[dict[str, float]]) -> str:
    """A Markdown table: per layer, each normalization's late median ``||A||_F`` and their order, largest first."""
    names = list(medians[0])
    lines = ["| layer | " + " | ".join(names) + " | order, largest first |", "|---" * (len(names) + 2) + "|"]
    for layer, row in enumerate(medians, start=1):
        order = sorted((name for name in names if math.isfinite(row[name])), key=lambda name: -row[name])
        cells = " | ".join(f"{row[name]:.3g}" if math.isfinite(row[name]) else "non-finite" for name in names)
        lines.append(f"| {layer} | {cells} | {' > '.join(order)} |")
    return "\n".join(lines)


def _collate(examples: list[dict]) -> dict:
    import torch

    return {"pixel_values": torch.stack([example["pixel_values"] for example in examples]),
            "labels": torch.tensor([example["labels"] for example in examples])}


def _finite_key(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(partial, path)
