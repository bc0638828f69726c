"""``hf_knorm.convert`` / ``hf-knorm convert``: a pretrained softmax model converted to another normalization.

The recipe is LoLCATs' (Zhang et al., arXiv 2410.10254) applied to "Rethinking Softmax"'s normalizations
(arXiv 2410.18613); the paper itself only trains from scratch. Steps, in order (everything that can be wrong with
the input is checked before the model is loaded):

1. the settings, the data sources, the model folder and the run folder are checked: an unknown normalization or
   ``softmax`` (nothing to convert), a model already patched (conversion starts from the softmax original), a
   finished run in ``out``, an interrupted one without ``resume``;
2. the texts are split into training and held-out texts (:mod:`hf_knorm.training.heldout`) and packed into blocks;
   a held-out text too short for ``eval_tokens`` is refused;
3. the original model's held-out perplexity is measured: the reference line of every curve;
4. **attention transfer** (``out/transfer``, :mod:`.transfer`): the model is patched, each head's output scale is
   matched in closed form, then the chosen attention projections train to reproduce the original attention output
   layer by layer; a Trainer run with :class:`~hf_knorm.NormLoggerCallback` and held-out evaluation. The
   transferred model is saved in ``out/transfer/model``, with the transfer error per layer and position;
5. **recovery** (``out/recovery``): next-token training of the whole model or through LoRA adapters on q/k/v/o
   (peft), distilled from the original model (``distill_weight``; 0 turns it off); LoRA adapters are merged before
   saving;
6. ``out`` ends with the converted model (an ordinary hf_knorm checkpoint: ``hf_knorm.from_pretrained(out)``), its
   tokenizer, its model card with the held-out perplexities, ``norms.png`` and ``convert.json`` (settings,
   each stage's curve, tokens, trainable parameters, throughput). ``convert.json`` is written last: its presence
   means the run finished.

``resume=True`` continues an interrupted run: a finished stage is not run again (the transfer's model is reloaded
from ``out/transfer/model``), an interrupted one continues from its last checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict
from pathlib import Path

from ..attention.normalizations import parse_normalization
from ..training.finetune import check_sources
from .settings import RECOVERY_MODES, SCALE_FOLDS, ConvertSettings
from .state import STATE_FILE, read_state, write_state

RESULT_FILE = "convert.json"


def check_settings(settings: ConvertSettings) -> None:
    """The checks that need neither the model nor the data.

    Raises:
        ValueError: an unknown or softmax normalization, a bad number, a run folder in the wrong state.
        FileNotFoundError: a missing data file or model folder.
    """
    if parse_normalization(settings.normalization).is_softmax:
        raise ValueError("Converting to softmax changes nothing: the original model is softmax. Pass another "
                         "--normalization (x/1, x/16, x^3/1, x^3/16, x^3/sqrtN, x^p/c).")
    if settings.recovery not in RECOVERY_MODES:
        raise ValueError(f"recovery must be one of {', '.join(RECOVERY_MODES)}, not {settings.recovery!r}.")
    if settings.scale_fold not in SCALE_FOLDS:
        raise ValueError(f"scale_fold must be one of {', '.join(SCALE_FOLDS)}, not {settings.scale_fold!r}.")
    for name in ("block_size", "batch_size", "eval_tokens", "eval_steps", "logging_steps", "save_steps", "lora_rank"):
        if getattr(settings, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(settings, name)}.")
    for name in ("transfer_steps", "recovery_steps", "warmup_steps"):
        if getattr(settings, name) < 0:
            raise ValueError(f"{name} must be >= 0, not {getattr(settings, name)}.")
    if settings.transfer_steps == 0 and (settings.recovery == "none" or settings.recovery_steps == 0):
        raise ValueError("Both stages are off (transfer_steps 0, no recovery): there is nothing to convert.")
    if settings.distill_weight < 0:
        raise ValueError(f"distill_weight must be >= 0, not {settings.distill_weight}.")
    check_sources(settings.dataset, settings.eval_dataset, settings.model)
    out = Path(settings.out)
    finished = (out / RESULT_FILE).is_file()
    started = (out / STATE_FILE).is_file()
    if finished:
        raise ValueError(f"{out} holds a finished conversion ({RESULT_FILE}); pass another --out.")
    if started and not settings.resume:
        raise ValueError(f"{out} holds an interrupted conversion: pass --resume to continue it, or another --out.")
    if settings.resume and not started:
        raise ValueError(f"--resume: {out} holds no conversion to continue ({STATE_FILE} is missing).")


def convert(settings: ConvertSettings | None = None, **fields) -> dict:
    """Convert a pretrained softmax causal LM to another normalization (the Python side of ``hf-knorm convert``).

    Example:
        >>> summary = hf_knorm.convert(normalization="x^3/16", out="runs/x3-16")     # the embedded default model
        >>> model = hf_knorm.from_pretrained("runs/x3-16")
        >>> summary["evaluation"]["perplexity"], summary["evaluation"]["original_perplexity"]

    Args:
        settings: a :class:`~hf_knorm.conversion.settings.ConvertSettings`; default: its defaults.
        **fields: settings fields to change (``model=``, ``dataset=``, ``recovery="full"``, ...).

    Returns:
        What ``convert.json`` records (see :func:`run_convert`).
    """
    from dataclasses import replace

    return run_convert(replace(settings or ConvertSettings(), **fields))


def run_convert(settings: ConvertSettings) -> dict:
    """Convert as ``settings`` say (see the module docstring); returns what ``convert.json`` records.

    Raises:
        ValueError, FileNotFoundError: bad input, always before the first training step.
    """
    import transformers

    from ..training.finetune import causal_lm_source
    from ..training.heldout import held_out_perplexity, training_and_held_out

    check_settings(settings)
    normalization = parse_normalization(settings.normalization).name
    model_dir, config = causal_lm_source(settings.model, settings.block_size, "convert converts")
    already = (getattr(config, "hf_knorm", None) or {}).get("normalization")
    if already is not None:
        raise ValueError(f"{model_dir} is already patched with {already}. Conversion starts from the original softmax "
                         "model: pass the model it was made from.")

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    _, train, eval_blocks, eval_description = training_and_held_out(
        settings.dataset, tokenizer, settings.block_size, settings.eval_tokens, settings.text_column, settings.split,
        settings.eval_dataset, settings.eval_fraction, settings.max_blocks)

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    state = read_state(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    if "original_perplexity" not in state:
        state["original_perplexity"] = held_out_perplexity(model, eval_blocks, desc="original model")
        state["settings"] = asdict(settings)
        write_state(out, state)
    teacher = copy.deepcopy(model).eval() if settings.distill_weight > 0 and settings.recovery != "none" else None

    from .stages import run_recovery, run_transfer

    model = run_transfer(model, settings, normalization, train, eval_blocks, out, state)
    model = run_recovery(model, settings, train, eval_blocks, out, state, teacher)

    model.eval()
    final = held_out_perplexity(model, eval_blocks, desc="converted model")
    summary = _summary(settings, normalization, model_dir, eval_description, eval_blocks, len(train), state, final)
    _save(model, tokenizer, out, summary)
    return summary


def _summary(settings, normalization, model_dir, eval_description, eval_blocks, train_blocks, state, final) -> dict:
    from ..training.heldout import evaluation_record

    return {
        "settings": asdict(settings),
        "model_dir": str(model_dir),
        "normalization": normalization,
        "evaluation": evaluation_record(eval_description, eval_blocks, settings.block_size,
                                        state["original_perplexity"], final),
        "training_blocks": train_blocks,
        "stages": {name: state[name] for name in ("transfer", "recovery") if name in state},
    }


def _save(model, tokenizer, out: Path, summary: dict) -> None:
    from ..hub.saving import save_pretrained
    from ..training.norm_figure import plot_norm_history

    runs = [out / name for name in ("transfer", "recovery") if (out / name / "norms.jsonl").is_file()]
    figure = None
    if runs:
        figure = plot_norm_history(runs, out / "norms.png", labels=[run.name for run in runs],
                                   title=f"||A||_F per layer, conversion to {summary['normalization']}")
    summary["perplexity_figure"] = str(plot_conversion_curve(summary, out / "perplexity.png"))
    evaluation = dict(summary["evaluation"], stages={
        name: stage.get("curve", []) for name, stage in summary["stages"].items()})
    save_pretrained(model, out, tokenizer=tokenizer, norm_history=figure, evaluation=evaluation)
    partial = out / (RESULT_FILE + ".partial")
    partial.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    os.replace(partial, out / RESULT_FILE)


def plot_conversion_curve(summary: dict, path: Path) -> Path:
    """Held-out perplexity over training tokens, transfer then recovery, against the original model's line."""
    from ..plots import plot_perplexity_curves

    curves, offset = {}, 0
    for name in ("transfer", "recovery"):
        stage = summary["stages"].get(name)
        if stage:
            curves[name] = [(offset + tokens, value) for _, tokens, value in stage["curve"]]
            offset += stage["tokens"]
    evaluation = summary["evaluation"]
    return plot_perplexity_curves(
        curves, path, references={"original model (softmax)": evaluation["original_perplexity"]},
        title=f"Conversion to {summary['normalization']}: held-out perplexity ({evaluation['tokens']} tokens)")
