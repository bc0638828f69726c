r"""Recovery side by side: plain fine-tuning against attention transfer + full / LoRA recovery, per normalization.

Issue "Conversion", item 3. For each normalization, on the same token budget (``--steps`` optimizer steps of
``--batch-size`` x ``--block-size`` tokens, transfer steps included) and the same held-out text (Paul Graham essays
40-48, 8,192 tokens, the Trainer's evaluation):

- ``plain``: the patched model fine-tuned in full (``hf-knorm convert --transfer-steps 0 --recovery full``, which
  is plain next-token fine-tuning of the patched model: no scales, no teacher) at ``--plain-lr``;
- ``transfer``: attention transfer alone (``--transfer-steps``, recovery none): the starting point of the next two;
- ``transfer+full``: that transfer, then full fine-tuning for the rest of the budget at ``--full-lr``;
- ``transfer+lora``: that transfer, then LoRA (rank 8, merged) for the rest of the budget at ``--lora-lr``;

both recoveries distilled from the original model with ``--distill-weight`` (the ``convert`` default; 0: none);

with two reference lines: the original softmax model, and the original fine-tuned in softmax on the same data for the
same budget (``hf-knorm finetune --normalization softmax``), which separates domain adaptation from recovery. Every
arm is an ordinary run of the project's own commands in ``--out``; an arm whose summary exists is not run again, so
the script resumes after an interruption and can be split across processes (``--normalizations``, ``--no-softmax``).

Each finished arm gets the greedy continuations of :data:`PROMPTS` (12 new tokens). ``--report`` (no training)
gathers every arm in ``--out`` into ``results.json``, a markdown table and the figure (one panel per normalization).

``--throughput-steps N`` measures, in one process and interleaved (``--rounds`` rounds), the training tokens per
second of a plain fine-tuning step (which is also a full recovery step: the same computation), a transfer step and a
LoRA recovery step on the same model and batches: the ratios go into BENCHMARKS.md. Run it alone on the machine.

Usage (docs/research/2026-12-conversion.md, "Recovery side by side"; two processes of one thread each
share the 2 cores):
    OMP_NUM_THREADS=1 python research/2026-12/conversion_recovery.py --normalizations x/1,x^3/1 &
    OMP_NUM_THREADS=1 python research/2026-12/conversion_recovery.py --normalizations x^3/16,x/16,x^3/sqrtN --no-softmax
    OMP_NUM_THREADS=1 python research/2026-12/conversion_recovery.py --normalizations x^3/16 --no-softmax --sweep-only \
        --plain-sweep 1e-4,3e-4                      # the plain learning rate, tuned on x^3/16
    python research/2026-12/conversion_recovery.py --throughput-steps 4 --rounds 3              # alone on the machine
    python research/2026-12/conversion_recovery.py --report --figure docs/figures/conversion/recovery.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

NORMALIZATIONS = ("x/1", "x/16", "x^3/1", "x^3/16", "x^3/sqrtN")
ARMS = ("plain", "transfer", "transfer+full", "transfer+lora")
PROMPTS = ("The capital of France is", "Water freezes at a temperature of", "The opposite of hot is",
           "The best way to learn programming is")
COLOURS = {"plain": "tab:red", "transfer": "tab:gray", "transfer+full": "tab:blue", "transfer+lora": "tab:green"}


def folder_name(normalization: str) -> str:
    """``"x^3/16"`` -> ``"x3_16"``: a normalization's folder under ``--out``."""
    return normalization.replace("/", "_").replace("^", "")


def common(args) -> dict:
    return dict(dataset="paul-graham", block_size=args.block_size, batch_size=args.batch_size,
                eval_tokens=args.eval_tokens, eval_steps=args.eval_steps, report_to=("none",), save_steps=10_000,
                seed=args.seed)


def conversion_fields() -> dict:
    """What convert takes beyond :func:`common`: this script's protocol, one held-out text (the essays), no probe,
    each normalization trained as itself (``convert`` trains ``x^p/c`` as its twin ``x^p/1`` by default, a choice
    this comparison helped make: docs/research/2026-12-conversion.md, "Per normalization")."""
    return dict(eval_domains=("essays",), probe=False, fold_constant=False)


# --- the arms ----------------------------------------------------------------------------------------------------

def run_softmax(args, out: Path) -> None:
    from hf_knorm.jobs.finetune import FinetuneSettings, run_finetune

    folder = out / "softmax"
    if (folder / "finetune.json").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    settings = common(args)
    settings.pop("seed")
    run_finetune(FinetuneSettings(**settings, out=str(folder), normalization="softmax", max_steps=args.steps,
                                  learning_rate=args.softmax_lr, seed=args.seed))
    write_continuations(folder, "finetune.json")


def run_normalization(args, out: Path, normalization: str) -> None:
    from hf_knorm import convert

    root = out / folder_name(normalization)
    transfer = dict(transfer_steps=args.transfer_steps, transfer_learning_rate=args.transfer_lr,
                    distill_weight=args.distill_weight)
    rest = args.steps - args.transfer_steps  # recovery steps after the transfer: the same budget as plain
    arms = {
        "plain": dict(transfer_steps=0, recovery="full", recovery_steps=args.steps,
                      recovery_learning_rate=args.plain_lr, distill_weight=0.0),
        "transfer": dict(transfer, recovery="none"),
        "transfer+full": dict(transfer, recovery="full", recovery_steps=rest, recovery_learning_rate=args.full_lr),
        "transfer+lora": dict(transfer, recovery="lora", recovery_steps=rest, recovery_learning_rate=args.lora_lr),
    }
    for rate in args.plain_sweep:  # more learning rates for plain fine-tuning: the table takes the best
        arms[f"plain_lr{rate:g}"] = dict(arms["plain"], recovery_learning_rate=rate)
    if args.sweep_only:
        arms = {arm: fields for arm, fields in arms.items() if arm.startswith("plain_lr")}
    arms = {arm: fields for arm, fields in arms.items() if arm.split("_lr")[0] in args.arms}
    for arm, fields in arms.items():
        folder = root / arm
        if (folder / "convert.json").is_file():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        resume = False
        if arm.startswith("transfer+"):  # the transfer arm's finished stage, reused: the same starting point
            folder.mkdir(parents=True)
            os.symlink((root / "transfer" / "transfer").resolve(), folder / "transfer")
            shutil.copy(root / "transfer" / "convert_state.json", folder / "convert_state.json")
            resume = True
        print(f"=== {normalization} {arm}", flush=True)
        convert(**common(args), **conversion_fields(), normalization=normalization, out=str(folder), resume=resume,
                **fields)
        write_continuations(folder, "convert.json")


def write_continuations(folder: Path, summary_file: str) -> None:
    """Greedy continuations of :data:`PROMPTS` by the model saved in ``folder``, added to its summary."""
    import transformers

    import hf_knorm

    summary_path = folder / summary_file
    summary = json.loads(summary_path.read_text())
    model = hf_knorm.from_pretrained(folder, model_class=transformers.AutoModelForCausalLM).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    summary["continuations"] = {prompt: greedy(model, tokenizer, prompt) for prompt in PROMPTS}
    summary_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def greedy(model, tokenizer, prompt: str, new_tokens: int = 12) -> str:
    import torch

    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


# --- throughput ----------------------------------------------------------------------------------------------------

def measure_throughput(args, out: Path) -> dict:
    """Tokens per second of one optimizer step of each kind, interleaved rounds on the same batches (x^3/16)."""
    import copy

    import torch
    import transformers

    from hf_knorm import patch
    from hf_knorm.assets.default_model import default_model_dir
    from hf_knorm.conversion.stages import LORA_TARGETS
    from hf_knorm.conversion.trainers import distillation_kl
    from hf_knorm.conversion.transfer import AttentionTransfer

    model_dir = default_model_dir()
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(0, original.config.vocab_size, (args.batch_size, args.block_size), generator=generator)
    tokens = batch.numel()

    plain = patch(copy.deepcopy(original), "x^3/16").train()
    transferred = copy.deepcopy(original)
    transfer = AttentionTransfer(transferred, "qk")
    patch(transferred, "x^3/16")
    transfer.match_scale(transferred, batch[:2])
    transfer.freeze_all_but_trainable(transferred)
    transferred.train()
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(patch(copy.deepcopy(original), "x^3/16"), LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")).train()

    def next_token_step(model):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)  # same cost; weights kept

        def step():
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return step

    teacher = original.eval()

    def distilled_step():  # full recovery as convert runs it by default: next-token loss + KL to the original
        optimizer = torch.optim.AdamW(plain.parameters(), lr=0.0)  # same cost; weights kept

        def step():
            outputs = plain(input_ids=batch, labels=batch)
            with torch.no_grad():
                target = teacher(input_ids=batch, use_cache=False).logits
            (outputs.loss + distillation_kl(outputs.logits, target)).backward()
            optimizer.step()
            optimizer.zero_grad()
        return step

    def transfer_step():
        optimizer = torch.optim.AdamW(transfer.trainable_parameters(), lr=0.0)  # same cost; weights kept

        def step():
            with transfer.teaching():
                transferred(input_ids=batch, use_cache=False, logits_to_keep=1)
                loss = transfer.loss()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return step

    plain_name = "plain fine-tuning = full recovery (every weight)"  # the same computation on the patched model
    steps = {plain_name: next_token_step(plain),
             "full recovery distilled from the original (convert's default)": distilled_step(),
             "attention transfer (q, k; teachers beside)": transfer_step(),
             "LoRA recovery (rank 8, q/k/v/o)": next_token_step(lora)}
    seconds = {name: [] for name in steps}
    for name in seconds:
        steps[name]()  # warm-up: allocations, optimizer state
    for _ in range(args.rounds):
        for name in seconds:
            started = time.perf_counter()
            for _ in range(args.throughput_steps):
                steps[name]()
            seconds[name].append((time.perf_counter() - started) / args.throughput_steps)
    baseline = sorted(seconds[plain_name])[len(seconds[plain_name]) // 2]
    result = {"tokens_per_step": tokens, "threads": torch.get_num_threads(), "rounds": args.rounds,
              "steps_per_round": args.throughput_steps, "stages": {}}
    for name, values in seconds.items():
        median = sorted(values)[len(values) // 2]
        result["stages"][name] = {"seconds_per_step": median, "tokens_per_second": tokens / median,
                                  "vs_plain": baseline / median, "all_rounds": values}
    (out / "throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# --- report --------------------------------------------------------------------------------------------------------

def gather(out: Path) -> dict:
    """Every finished arm in ``out``: curves (training tokens, perplexity), finals, continuations, throughput."""
    results = {"normalizations": {}}
    softmax = out / "softmax" / "finetune.json"
    if softmax.is_file():
        summary = json.loads(softmax.read_text())
        evaluation = summary["evaluation"]
        results["original_perplexity"] = evaluation["original_perplexity"]
        results["softmax_finetune"] = {"final": evaluation["perplexity"], "curve": evaluation["stages"]["fine-tuning"],
                                       "continuations": summary.get("continuations", {})}
    for normalization in NORMALIZATIONS:
        arms = {}
        root = out / folder_name(normalization)
        sweep = sorted(path.name for path in root.glob("plain_lr*")) if root.is_dir() else []
        for arm in [*ARMS, *sweep]:
            path = root / arm / "convert.json"
            if not path.is_file():
                continue
            summary = json.loads(path.read_text())
            curve, offset = [], 0
            for stage in ("transfer", "recovery"):
                record = summary["stages"].get(stage)
                if record and "curve" in record:
                    curve += [(offset + tokens, value) for _, tokens, value in record["curve"]]
                    offset += record["tokens"]
            evaluation = summary["evaluation"]
            if not curve or curve[-1][0] < offset:  # the run's own final measurement, when no evaluation fell there
                curve.append((offset, evaluation["perplexity"]))
            results.setdefault("original_perplexity", evaluation["original_perplexity"])
            arms[arm] = {"final": evaluation["perplexity"], "tokens": offset, "curve": curve,
                         "start": curve[0][1] if curve else None,
                         "tokens_per_second": {stage: record.get("tokens_per_second")
                                               for stage, record in summary["stages"].items()},
                         "settings": {key: summary["settings"][key] for key in (
                             "transfer_steps", "recovery", "recovery_steps", "recovery_learning_rate", "scale_fold",
                             "distill_weight")},
                         "continuations": summary.get("continuations", {})}
        if arms:
            results["normalizations"][normalization] = arms
    original = out / "original_continuations.json"
    if not original.is_file():  # the original model's answers, beside the converted ones
        import transformers

        from hf_knorm.assets.default_model import default_model_dir

        model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir()).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir())
        original.write_text(json.dumps({prompt: greedy(model, tokenizer, prompt) for prompt in PROMPTS}, indent=2))
    results["original_continuations"] = json.loads(original.read_text())
    throughput = out / "throughput.json"
    if throughput.is_file():
        results["throughput"] = json.loads(throughput.read_text())
    return results


def markdown_table(results: dict) -> str:
    original = results.get("original_perplexity", float("nan"))
    softmax = results.get("softmax_finetune", {}).get("final", float("nan"))
    lines = [f"Original (softmax): {original:.2f}; softmax fine-tuned on the same budget: {softmax:.2f}.", "",
             "| normalization | patched | plain fine-tuning | transfer only | transfer + full | transfer + LoRA "
             "| best / softmax | plain / best |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for normalization, arms in results["normalizations"].items():
        finals = {arm: arms[arm]["final"] for arm in ARMS if arm in arms}
        plain = {arm: record for arm, record in arms.items() if arm.startswith("plain")}
        if plain:  # plain fine-tuning at its best learning rate
            best_plain = min(plain, key=lambda arm: plain[arm]["final"])
            finals["plain"] = plain[best_plain]["final"]
        patched = arms.get("plain", {}).get("start")
        converted = [finals[arm] for arm in ("transfer+full", "transfer+lora") if arm in finals]
        best = min(converted) if converted else float("nan")
        cells = [_number(patched)] + [_number(finals.get(arm)) for arm in ARMS]
        ratio = best / original if converted else float("nan")
        gain = finals.get("plain", float("nan")) / best if converted else float("nan")
        lines.append(f"| `{normalization}` | " + " | ".join(cells) + f" | {ratio:.1f}x | {gain:.1f}x |")
    sweeps = {name: {record["settings"]["recovery_learning_rate"]: record["final"]
                     for arm, record in arms.items() if arm.startswith("plain")}
              for name, arms in results["normalizations"].items()}
    lines += ["", "Plain fine-tuning, final held-out perplexity by learning rate: " + "; ".join(
        f"`{name}` " + ", ".join(f"{rate:g}: {_number(value)}" for rate, value in sorted(rates.items()))
        for name, rates in sweeps.items() if rates)]
    return "\n".join(lines)


def continuations_table(results: dict, arm: str = "transfer+full") -> str:
    """Greedy continuations (12 new tokens) of the original, the softmax fine-tune and each ``arm`` model."""
    rows = [("original (softmax)", results["original_continuations"])]
    if "softmax_finetune" in results:
        rows.append(("softmax, fine-tuned", results["softmax_finetune"]["continuations"]))
    rows += [(f"`{name}`, {arm}", arms[arm]["continuations"])
             for name, arms in results["normalizations"].items() if arm in arms]
    lines = ["| model | " + " | ".join(PROMPTS) + " |", "|---" * (len(PROMPTS) + 1) + "|"]
    for label, answers in rows:
        cells = [repr(answers.get(prompt, ""))[1:-1].replace("|", "\\|") for prompt in PROMPTS]
        lines.append(f"| {label} | " + " | ".join(f"`{cell}`" for cell in cells) + " |")
    return "\n".join(lines)


def throughput_table(results: dict) -> str:
    """Tokens per second of each kind of step and its ratio to a plain fine-tuning step, from ``throughput.json``."""
    throughput = results.get("throughput")
    if not throughput:
        return "(no throughput.json: run --throughput-steps N)"
    lines = ["| step | seconds per step | training tokens / s | x plain fine-tuning |", "|---|---:|---:|---:|"]
    for name, stage in throughput["stages"].items():
        lines.append(f"| {name} | {stage['seconds_per_step']:.2f} | {stage['tokens_per_second']:.0f} | "
                     f"{stage['vs_plain']:.2f}x |")
    return "\n".join(lines)


def _number(value) -> str:
    if value is None or not math.isfinite(value):
        return "-" if value is None else "inf"
    return f"{value:.3g}" if value >= 1e4 else f"{value:.1f}"


def plot(results: dict, path: Path) -> Path:
    """One panel per normalization: held-out perplexity over training tokens, each arm a line, softmax lines."""
    import matplotlib
    import numpy as np
    from matplotlib.figure import Figure

    matplotlib.use("Agg")
    names = list(results["normalizations"])
    fig = Figure(figsize=(4.2 * len(names), 4.0))
    axes = fig.subplots(1, len(names), sharey=True, squeeze=False)[0]
    softmax = results.get("softmax_finetune", {})
    for ax, name in zip(axes, names):
        arms = results["normalizations"][name]
        plain = [arm for arm in arms if arm.startswith("plain")]
        best_plain = min(plain, key=lambda arm: arms[arm]["final"]) if plain else None
        for arm, record in arms.items():
            points = [(x, y) for x, y in record["curve"] if np.isfinite(y) and y > 0]
            if not points:
                continue
            x, y = zip(*points)
            if arm in plain:  # the best learning rate drawn in full, the others thin
                label = f"plain, lr {record['settings']['recovery_learning_rate']:g}"
                style = dict(lw=1.4, ms=3) if arm == best_plain else dict(lw=0.8, ms=2, ls="-.", alpha=0.6)
                ax.plot(x, y, marker="o", color=COLOURS["plain"], label=label, **style)
            else:
                ax.plot(x, y, marker="o", ms=3, lw=1.4, color=COLOURS[arm], label=arm)
        ax.axhline(results.get("original_perplexity", np.nan), ls="--", color="black", lw=1.1,
                   label="original (softmax)")
        if softmax.get("curve"):
            x, y = zip(*[(tokens, value) for _, tokens, value in softmax["curve"]])
            ax.plot(x, y, ls=":", color="tab:orange", lw=1.6, label="softmax fine-tuned")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("training tokens")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("held-out perplexity (PG essays 40-48)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("Recovery after patching SmolLM2-135M-Instruct: plain fine-tuning vs attention transfer + recovery",
                 fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


SEED_COLOURS = {"softmax": "tab:orange", "x/1": "gold", "x/16": "tab:green", "x^3/1": "tab:blue",
                "x^3/16": "tab:purple", "x^3/sqrtN": "tab:pink"}
"""The seed figure's colours (softmax orange, x/1 yellow, x/16 green, x^3/1 blue, x^3/16 purple)."""


def plot_seed_figure(out: Path, path: Path, arm: str = "transfer+full", layers: int = 12) -> Path:
    """Per-layer ||A||_F during conversion (the transfer, then the recovery of ``arm``), first ``layers`` layers,
    one line per normalization, with the softmax fine-tune's: the seed figure on the language model."""
    import numpy as np

    from hf_knorm.plots import plot_layer_curves
    from hf_knorm.training.history import read_norm_history

    def curve(histories_and_offsets):
        steps, values = [], []
        for history, offset in histories_and_offsets:
            for record in history:
                steps.append(record["step"] + offset)
                values.append([layer["attn_fro"] for layer in record["layers"][:layers]])
        return steps, np.array(values, dtype=float).T

    runs, colours = [], []
    softmax = out / "softmax" / "norms.jsonl"
    if softmax.is_file():
        runs.append(("softmax (fine-tuned)", *curve([(read_norm_history(softmax), 0)])))
        colours.append(SEED_COLOURS["softmax"])
    for normalization in NORMALIZATIONS:
        folder = out / folder_name(normalization) / arm
        if not (folder / "convert.json").is_file():
            continue
        summary = json.loads((folder / "convert.json").read_text())
        transfer_steps = summary["stages"]["transfer"]["steps"]
        parts = [(read_norm_history(folder / "transfer" / "norms.jsonl"), 0),
                 (read_norm_history(folder / "recovery" / "norms.jsonl"), transfer_steps)]
        runs.append((normalization, *curve(parts)))
        colours.append(SEED_COLOURS[normalization])
    return plot_layer_curves(runs, path, xlabel="conversion step (transfer, then recovery)", colors=colours,
                             title=f"||A||_F per layer while converting SmolLM2-135M-Instruct ({arm}), "
                                   f"first {layers} layers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/recovery")
    parser.add_argument("--normalizations", default=",".join(NORMALIZATIONS))
    parser.add_argument("--no-softmax", action="store_true", help="skip the softmax fine-tune reference")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per arm, transfer included")
    parser.add_argument("--transfer-steps", type=int, default=15)
    parser.add_argument("--plain-lr", type=float, default=1e-3,
                        help="best of 1e-4, 3e-4, 1e-3 on x^3/16; 3e-3 was better there (BENCHMARKS.md)")
    parser.add_argument("--transfer-lr", type=float, default=1e-3)
    parser.add_argument("--full-lr", type=float, default=1e-3)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--distill-weight", type=float, default=1.0,
                        help="KL weight to the original model in both recoveries (the convert default; 0: none)")
    parser.add_argument("--plain-sweep", type=lambda text: [float(rate) for rate in text.split(",")], default=[],
                        help="more learning rates for plain fine-tuning, comma-separated (arms plain_lr<rate>)")
    parser.add_argument("--sweep-only", action="store_true", help="run only the --plain-sweep arms")
    parser.add_argument("--arms", type=lambda text: text.split(","), default=list(ARMS),
                        help=f"the arms to run, comma-separated (default: {','.join(ARMS)})")
    parser.add_argument("--softmax-lr", type=float, default=5e-5)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--eval-steps", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--throughput-steps", type=int, default=0, help="measure throughput instead of training")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--report", action="store_true", help="gather the finished arms: table, results.json, figure")
    parser.add_argument("--figure", default=None, help="where --report writes the figure (default: OUT/recovery.png)")
    args = parser.parse_args()
    if set(args.arms) - set(ARMS):
        parser.error(f"--arms takes {', '.join(ARMS)}; got {','.join(args.arms)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        results = gather(out)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        print(markdown_table(results))
        print()
        print(continuations_table(results))
        print()
        print(throughput_table(results))
        figure = Path(args.figure) if args.figure else out / "recovery.png"
        print("figure:", plot(results, figure))
        print("seed figure:", plot_seed_figure(out, figure.with_name("seed_norms.png")))
        return
    if args.throughput_steps:
        print(json.dumps(measure_throughput(args, out)["stages"], indent=2))
        return
    unknown = [name for name in args.normalizations.split(",") if name not in NORMALIZATIONS]
    if unknown:
        parser.error(f"unknown normalization(s) {unknown}; choose from {', '.join(NORMALIZATIONS)}")
    if not 0 < args.transfer_steps < args.steps:
        parser.error("--transfer-steps must be between 0 and --steps (exclusive)")
    if not args.no_softmax:
        run_softmax(args, out)
    for normalization in args.normalizations.split(","):
        run_normalization(args, out, normalization)


if __name__ == "__main__":
    main()
