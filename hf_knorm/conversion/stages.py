"""The two stages of a conversion, each a Trainer run in its own folder with held-out evaluation and norm logging.

Each stage records in the run's state (``convert_state.json``) what it measured: its held-out perplexity curve per
held-out set (``curves``: ``{set: [[step, training tokens, perplexity], ...]}``), its gradient norms, trainable
parameters, training tokens and tokens per second (training time without the evaluations). A finished stage saves its
model (``transfer/model``, ``recovery/model``), then is marked ``done``, and is not run again on resume.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import transformers
from transformers.trainer_utils import get_last_checkpoint

from ..normalizations import Normalization
from ..models.patching import patch
from ..runs.arguments import job_arguments
from ..runs.run_folder import is_main_process
from ..training.callback import NormLoggerCallback
from ..training.finite_gradients import StopOnNonFiniteGradient
from ..training.window_dropout import WindowDropoutCallback, window_dropout_steps
from ..data.heldout import mean_example_tokens, perplexity_curve
from .learned_values import LearnedValuesCheckpoint, restore_learned_values, train_learned_values
from .settings import ConvertSettings, default_teacher_top_k
from .state import write_state
from .trainers import DistillationTrainer, TransferTrainer
from .transfer import AttentionTransfer

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
CALIBRATION_BLOCKS = 8
"""Training blocks the closed-form head scales are solved on."""


def run_transfer(model, settings: ConvertSettings, normalization: Normalization, train, eval_sets: dict, out: Path,
                 state: dict, collator=transformers.default_data_collator):
    """Stage 1: patch ``model`` with ``normalization`` and train its attention to match the original's.

    Before training, the closed-form head scales (pure normalizations) or the window's mix (a softmax window:
    :meth:`~.transfer.AttentionTransfer.match_mix`); after it, the mix is solved again for the trained projections.
    With ``transfer_steps == 0`` the model is only patched. Returns the patched (transferred) model. ``collator``
    batches ``train`` (:func:`~hf_knorm.jobs.convert.examples_collator`).
    """
    from ..models.persistence import from_pretrained, save_weights_and_config

    folder = out / "transfer"
    record = state.get("transfer", {})
    if record.get("done"):
        transferred = from_pretrained(folder / "model", model_class=transformers.AutoModelForCausalLM)
        transferred.config.name_or_path = model.config.name_or_path  # its origin: the model the run started from
        return transferred
    if settings.transfer_steps == 0:
        return patch(model, normalization)
    transfer = AttentionTransfer(model, settings.transfer_trainable)  # teachers copied before patching
    patch(model, normalization)
    checkpoint = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    calibration = _calibration_rows(train, settings.block_size)
    if normalization.window and checkpoint is not None:
        pass  # the mix solved when the stage started comes back with the checkpoint's weights (a parameter)
    elif normalization.window:
        record["initial_window_mix"] = [mix.tolist() for mix in transfer.match_mix(model, calibration)]
    elif checkpoint is None:  # a checkpoint holds the scaled weights already
        scales = transfer.match_scale(model, calibration, fold=settings.scale_fold)
        record["output_scales"] = [scale.tolist() for scale in scales]
        record["scale_fold"] = settings.scale_fold
    trainable = transfer.freeze_all_but_trainable(model)
    model.train()
    trainer = TransferTrainer(
        model=model, args=_arguments(settings, folder, settings.transfer_steps, settings.transfer_learning_rate),
        train_dataset=train, eval_dataset=eval_sets, data_collator=collator,
        callbacks=[NormLoggerCallback(), StopOnNonFiniteGradient(_advice("--transfer-learning-rate"))],
        transfer=transfer,
    )
    measured = _train(trainer, checkpoint, settings)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    if normalization.window:  # the closed form again, for the projections the transfer trained
        model.eval()
        record["window_mix"] = [mix.tolist() for mix in transfer.match_mix(model, calibration)]
    record.update(measured, trainable_parameters=trainable, trainable=settings.transfer_trainable,
                  errors=transfer.errors_by_layer_and_position(model, _error_sample(eval_sets)))
    if is_main_process():  # the stage is marked done (write_state) after its model is saved
        save_weights_and_config(model, folder / "model")
    record["done"] = True
    state["transfer"] = record
    write_state(out, state)
    return model


def run_recovery(model, settings: ConvertSettings, train, eval_sets: dict, out: Path, state: dict, teacher=None,
                 collator=transformers.default_data_collator, evaluate_at_start: bool = False):
    """Stage 2: next-token training of the patched model, through LoRA (merged at the end) or in full, distilled from
    ``teacher``. The recovered model is saved in ``out/recovery/model`` before the stage is marked done.
    ``evaluate_at_start``: the model changed since the transfer's last evaluation (clusters given to it), so the
    recovery's step 0 is evaluated rather than copied from it (:func:`transferred_evaluation`)."""
    from ..models.persistence import from_pretrained, save_weights_and_config

    if settings.recovery == "none" or settings.scheduled_recovery_steps() == 0:
        return model
    folder = out / "recovery"
    record = state.get("recovery", {})
    if record.get("done"):
        recovered = from_pretrained(folder / "model", model_class=transformers.AutoModelForCausalLM)
        recovered.config.name_or_path = model.config.name_or_path
        return recovered
    _set_recovery_trainable(model, settings.recovery_trainable)
    if settings.recovery == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=settings.lora_rank, lora_alpha=2 * settings.lora_rank, lora_dropout=0.0,
                          target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    # LoRA freezes the family's learned values, and the mix a dropped step scales the base family by: train them,
    # checkpoint them beside LoRA's adapters (full recovery trains them with the weights)
    learned_values = settings.recovery == "lora" and train_learned_values(model, mix=bool(settings.window_dropout)) > 0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    top_k, k = None, settings.teacher_top_k
    if k is None:  # the default: on where the recovery reads most of the training set
        from accelerate import PartialState

        drawn = settings.examples_drawn(settings.scheduled_recovery_steps(), PartialState().num_processes)
        k = default_teacher_top_k(drawn, len(train))
    if k and teacher is not None:  # the teacher's top k once, then no teacher forward per step
        top_k, record["teacher_top_k"] = _teacher_top_k(teacher, train, k, state["inputs"]["model"])
        teacher = None
    model.train()
    checkpoint = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    start = None if evaluate_at_start else transferred_evaluation(state, eval_sets)  # else not evaluated again
    arguments = _arguments(settings, folder, settings.scheduled_recovery_steps(), settings.recovery_learning_rate,
                           evaluate_at_start=start is None)
    callbacks = [NormLoggerCallback(), StopOnNonFiniteGradient(_advice("--recovery-learning-rate"))]
    if settings.window_dropout:  # steps without the window, drawn from the seed (hf_knorm.training.window_dropout)
        callbacks.append(WindowDropoutCallback(settings.window_dropout, settings.window_dropout_schedule))
    if learned_values:
        callbacks.append(LearnedValuesCheckpoint())
        if checkpoint is not None:
            restore_learned_values(model, checkpoint)
    trainer = DistillationTrainer(
        model=model, args=arguments,
        train_dataset=train, eval_dataset=eval_sets, data_collator=collator,
        callbacks=callbacks,
        teacher=teacher, teacher_top_k=top_k, distill_weight=settings.distill_weight,
        next_token_weight=settings.next_token_weight, non_attention_lr_scale=settings.non_attention_lr_scale,
    )
    measured = _train(trainer, checkpoint, settings)
    if start is not None:
        measured["curves"] = with_start(measured["curves"], start)
    if settings.recovery == "lora":
        model = model.merge_and_unload()  # an ordinary model again: the adapters folded into q/k/v/o
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    if is_main_process():  # the stage is marked done (write_state) after its model is saved
        save_weights_and_config(model, folder / "model")
    if settings.window_dropout:  # the steps drawn: a function of the seed and the schedule, resumed or not
        record["window_dropout"] = {
            "probability": settings.window_dropout, "schedule": settings.window_dropout_schedule,
            "dropped_steps": window_dropout_steps(settings.window_dropout, settings.window_dropout_schedule,
                                                  settings.seed, settings.scheduled_recovery_steps())}
    record.update(measured, trainable_parameters=trainable, mode=settings.recovery, done=True)
    state["recovery"] = record
    write_state(out, state)
    return model


def transferred_evaluation(state: dict, eval_sets: dict) -> dict[str, float] | None:
    """The held-out perplexity per set of the model the recovery starts from, where the transfer's last evaluation
    already measured it; ``None`` where the recovery must evaluate at its start.

    The recovery starts from the transferred model unchanged (LoRA's adapters start at zero), and the transfer
    evaluates at its last step: that evaluation is the recovery's step 0 (the same perplexities to the last bit), except
    where the transfer solved the window's mix again after its last evaluation and it moved, or did not train at all.
    """
    transfer = state.get("transfer", {})
    curves = transfer.get("curves", {})
    if not transfer.get("done") or set(curves) != set(eval_sets):
        return None
    if transfer.get("window_mix") != transfer.get("initial_window_mix"):  # both absent without a window
        return None
    if any(not curve or curve[-1][0] != transfer.get("steps") for curve in curves.values()):
        return None
    return {name: curve[-1][2] for name, curve in curves.items()}


def with_start(curves: dict, start: dict[str, float]) -> dict:
    """``curves`` (``{set: [[step, tokens, perplexity], ...]}``) with ``start``'s perplexity as step 0 of each set
    that has none: a recovery resumed from a checkpoint of a release that still evaluated at its start has one."""
    return {name: curve if curve and curve[0][0] == 0 else [[0, 0, start[name]], *curve]
            for name, curve in curves.items()}


def _teacher_top_k(teacher, train, k: int, model_fingerprint: str):
    """``(the teacher's top-k of every training example, what it cost)``: read from the cache or computed on the main
    process first (the others then read its cache). ``k`` is at most the vocabulary size - 1, already the exact KL
    (the default 256 on a model of fewer tokens). The cache is keyed by ``model_fingerprint``, the run's fingerprint
    of the model folder the teacher was loaded from (``state["inputs"]["model"]``)."""
    from accelerate import PartialState

    from .teacher_logits import teacher_top_k

    k = min(k, teacher.get_output_embeddings().weight.shape[0] - 1)
    started = time.perf_counter()
    with PartialState().main_process_first():
        cache = teacher_top_k(teacher, train, k, teacher_id=model_fingerprint)
    return cache, {"k": k, "positions": len(cache.rest), "seconds": round(time.perf_counter() - started, 1)}


def _advice(learning_rate_flag: str) -> str:
    """What a conversion stopped on a non-finite gradient can do (its settings cannot change on ``--resume``)."""
    return (f"convert again into another --out with a lower {learning_rate_flag} or --max-grad-norm, or another "
            "--seed (a conversion resumes only with the settings it started with)")


def _error_sample(eval_sets: dict) -> list[torch.Tensor]:
    """Up to 8 held-out examples of one length for the transfer's error by position: the first set of blocks, or
    (every set one example per record) the first set's first examples cut to the shortest of them."""
    sets = list(eval_sets.values())
    chosen = next((s for s in sets if len({len(ids) for ids in s["input_ids"]}) == 1), sets[0])
    rows = [chosen[i]["input_ids"] for i in range(min(len(chosen), 8))]
    length = min(map(len, rows))
    return [torch.tensor(row[:length]) for row in rows]


def _calibration_rows(train, block_size: int) -> torch.Tensor:
    """``(CALIBRATION_BLOCKS, N)`` ids the head scales are solved on: the first blocks, or the first examples'
    tokens joined and cut into rows of ``block_size`` (one row of all of them when they are fewer)."""
    first = [train[i]["input_ids"] for i in range(min(len(train), 64))]
    if len({len(ids) for ids in first}) == 1:
        return torch.tensor(first[:CALIBRATION_BLOCKS])
    tokens = [token for ids in first for token in ids]
    rows = len(tokens) // block_size
    if rows == 0:
        return torch.tensor([tokens])
    return torch.tensor(tokens[:rows * block_size]).view(rows, block_size)[:CALIBRATION_BLOCKS]


def _set_recovery_trainable(model, trainable: str) -> None:
    """Mark what full recovery trains: ``all``, ``no-embeddings`` (the token embeddings, and a tied output layer,
    stay) or ``attention`` (the attention modules' weights alone). LoRA then trains its adapters alone."""
    from ..models.architectures import attention_modules

    for parameter in model.parameters():
        parameter.requires_grad_(trainable != "attention")
    if trainable == "no-embeddings":
        model.get_input_embeddings().weight.requires_grad_(False)  # a tied output layer shares this weight
    elif trainable == "attention":
        for _, module in attention_modules(model):
            module.requires_grad_(True)


def _arguments(settings: ConvertSettings, folder: Path, steps: int, learning_rate: float,
               evaluate_at_start: bool = True):
    return transformers.TrainingArguments(**job_arguments(
        folder, steps=steps, batch_size=settings.batch_size, learning_rate=learning_rate,
        eval_on_start=evaluate_at_start, warmup_steps=settings.warmup_steps, logging_steps=settings.logging_steps,
        save_steps=settings.save_steps,
        eval_steps=settings.eval_steps, report_to=settings.integrations(), seed=settings.seed, bf16=settings.bf16,
        fp16=settings.fp16, save_total_limit=1, lr_scheduler_type="cosine", weight_decay=0.0,
        max_grad_norm=settings.max_grad_norm,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        # Every trainable weight takes part in every step. The transfer's loss comes from hooks, not from the model's
        # output, so DDP's search for unused weights (the Trainer's default) would find them all "unused", mark
        # them ready, then meet them again in the backward pass ("marked as ready twice")
        ddp_find_unused_parameters=False))


def _train(trainer, checkpoint: str | None, settings: ConvertSettings) -> dict:
    """Train, then read the held-out curve and the throughput off the Trainer's log history."""
    started = time.perf_counter()
    output = trainer.train(resume_from_checkpoint=checkpoint)
    elapsed = time.perf_counter() - started
    history = trainer.state.log_history
    tokens_per_step = round(settings.batch_size * mean_example_tokens(trainer.train_dataset)
                            * trainer.args.gradient_accumulation_steps * trainer.args.world_size)  # every process
    first = int(Path(checkpoint).name.split("-")[-1]) if checkpoint else 0
    evaluating = sum(entry.get("eval_runtime", 0.0) for entry in history if entry.get("step", 0) >= first)
    steps = trainer.state.global_step - first
    training_seconds = max(elapsed - evaluating, 1e-9)
    curves = {name: perplexity_curve(history, tokens_per_step, f"eval_{name}_perplexity")
              for name in trainer.eval_dataset}  # a dict of held-out sets
    return {
        "curves": curves,
        "grad_norms": [[entry["step"], entry["grad_norm"]] for entry in history if "grad_norm" in entry],
        "steps": trainer.state.global_step,
        "tokens": trainer.state.global_step * tokens_per_step,
        "train_loss": output.training_loss,
        "seconds": elapsed,
        "tokens_per_second": steps * tokens_per_step / training_seconds,
    }
