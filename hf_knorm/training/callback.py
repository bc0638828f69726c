"""NormLoggerCallback: per-layer attention and K/V norms while a Transformers ``Trainer`` trains.

``Trainer(..., callbacks=[hf_knorm.NormLoggerCallback()])`` is all it takes. On each logging step the callback reads,
from inside the attention of the forward passes the Trainer runs anyway (no second forward), the statistics of
:mod:`hf_knorm.recording.per_step` for every layer, and logs them as ``norms/layer_07/attn_fro`` and so on.

How the scalars reach every ``report_to`` integration
    The Trainer calls ``on_log`` on its callbacks in list order, and user callbacks come after the integrations
    (TensorBoard, W&B, MLflow, ...): a value a callback adds to ``logs`` in its own ``on_log`` normally reaches
    none of them, and Transformers offers no public way to run earlier. When training starts (``on_train_begin``)
    this callback therefore moves itself to the front of the Trainer's callback list
    (:func:`hf_knorm.compat.run_callback_first`, the workaround, documented and tested there); its ``on_log`` then
    adds the norms to the ``logs`` dict before any integration sees it, and also to the ``state.log_history`` entry
    the Trainer has just appended. If the list cannot be found (a future Transformers), it warns and the norms reach
    ``log_history`` and ``norms.jsonl`` only (:attr:`NormLoggerCallback.reaches_integrations` is ``False``). The
    console printer (progress bar or ``PrinterCallback``) would print the whole dict, seven numbers per layer, at
    every logging step: unless ``console=True``, a small companion callback placed just before it takes the norm
    keys out of ``logs`` (``state.log_history`` keeps them).

Which forward passes count
    The recorder is switched on in ``on_step_begin`` of a step that will log and off in ``on_step_end``; on every
    other step nothing is installed and nothing runs. With gradient accumulation every micro-batch of the logging
    optimizer step counts (the whole effective batch). A forward pass recomputed by gradient checkpointing during
    the backward pass is not counted twice. Statistics are summed on the device and reduced across processes
    (every process's tokens count, as if one process held the global batch); the history file is written by the
    main process only.

A model that is not patched
    The norms come from inside hf_knorm's attention function. A model patched with any normalization is read as it
    trains. A model that is not patched is patched with ``softmax`` for the forward passes of each logging step and
    unpatched in ``on_step_end``: hf_knorm's softmax is the model's own attention (tested to fp32 tolerance, forward
    and backward), so the training is the same. The cost is on the logging steps only: they run hf_knorm's chunked
    kernel instead of the model's (SDPA), 1.5-2x the attention time at long sequences (BENCHMARKS.md), plus the
    switch of attention implementation (well under a millisecond). With attention dropout the dropout masks of
    those steps come from ``torch.nn.functional.dropout`` rather than from SDPA's kernel (same distribution,
    different random draws).

Divergence
    Non-finite statistics are logged as they are (NaN/inf floats in ``logs``; ``"nan"``/``"inf"`` strings in
    ``norms.jsonl``), and the first step and layer where one appeared is warned about once and kept in
    :attr:`NormLoggerCallback.first_nonfinite`. ``stop_on_nonfinite_loss=True`` stops training after the first
    optimizer step whose loss is not finite (the Trainer's ``logging_nan_inf_filter`` would otherwise hide it).
"""

from __future__ import annotations

import math
import warnings

import torch
import transformers
from transformers import TrainerCallback
from transformers.utils import logging

from ..compat import run_callback_first
from ..models.architectures import attention_modules
from ..models.patching import patch, patched_normalization, unpatch
from .finite_gradients import finite_on_every_process
from .history import HISTORY_FILE, NormHistory
from ..recording.per_step import STATISTICS, StepNormRecorder

logger = logging.get_logger(__name__)


class NormLoggerCallback(TrainerCallback):
    """Log per-layer attention-matrix Frobenius norms and K/V norms through the Trainer's own log stream.

    Args:
        every: log the norms every ``every`` optimizer steps. Default: on the Trainer's own logging steps
            (``logging_steps``, and step 1 with ``logging_first_step``); required when ``logging_strategy`` is not
            ``"steps"``. The callback makes the Trainer log on each of its steps.
        history_file: name of the history file in ``output_dir`` (``None``: no file).
        stop_on_nonfinite_loss: stop training after the first optimizer step with a non-finite loss. Costs one
            ``isfinite`` per forward pass and one host synchronization per step (plus an ``all_reduce`` across
            processes, so that all stop together).
        prefix: the first component of the logged keys.
        console: also print the norms with the Trainer's progress output (default: keep them off the console).

    Attributes:
        first_nonfinite: ``(step, key)`` of the first non-finite statistic (e.g. ``(140, "layer_07/attn_fro")``),
            or ``None``; restored from the history on resume.
        stopped_at_step: the step after which ``stop_on_nonfinite_loss`` stopped training, or ``None``.

    Examples:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NormLoggerCallback()])
        >>> trainer.train()
        >>> trainer.state.log_history[-2]["norms/layer_00/attn_fro"]
    """

    def __init__(self, every: int | None = None, history_file: str | None = HISTORY_FILE,
                 stop_on_nonfinite_loss: bool = False, prefix: str = "norms", console: bool = False):
        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be a positive number of steps, not {every!r}.")
        self.every = every
        self.history_file = history_file
        self.stop_on_nonfinite_loss = stop_on_nonfinite_loss
        self.prefix = prefix
        self.console = console
        self.first_nonfinite: tuple[int, str] | None = None
        self.stopped_at_step: int | None = None
        self.reaches_integrations = False
        self._recorder: StepNormRecorder | None = None
        self._history: NormHistory | None = None
        self._normalization = None
        self._temporary_patch = None  # the model patched with softmax for the current step
        self._pending: tuple[int, list[dict[str, float]]] | None = None
        self._loss_hook = None
        self._loss_finite: torch.Tensor | None = None
        self._console_filter = None if console else _HideFromConsole(self)

    # --- Trainer events ------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.reaches_integrations = run_callback_first(self, console_filter=self._console_filter)
        if not self.reaches_integrations:
            warnings.warn(
                f"NormLoggerCallback could not reach the Trainer's callback list to run before the report_to "
                f"integrations (Transformers {transformers.__version__}; please report it to hf_knorm): the norms will "
                f"be in state.log_history and norms.jsonl, not in TensorBoard/W&B.",
                stacklevel=2,
            )
        self._end_step(model)  # a previous train() that raised during a logging step
        try:
            modules = attention_modules(model)
        except ValueError as error:
            raise ValueError(f"NormLoggerCallback cannot read this model's attention norms: {error}") from None
        if self.every is None and args.logging_strategy != "steps":
            raise ValueError(
                f"NormLoggerCallback follows the Trainer's logging steps, but logging_strategy is "
                f"{args.logging_strategy!s}: pass NormLoggerCallback(every=N) to log the norms every N steps."
            )
        if getattr(args, "n_gpu", 1) > 1:
            raise ValueError(
                "NormLoggerCallback does not support torch.nn.DataParallel (several GPUs in one process); launch one "
                "process per GPU with torchrun (DistributedDataParallel)."
            )
        self._recorder = StepNormRecorder(model, [module for _, module in modules])
        self._normalization = patched_normalization(model) or "softmax"
        self._pending = None
        self._history = None
        if self.history_file and state.is_world_process_zero:
            self._history = NormHistory(f"{args.output_dir}/{self.history_file}")
            kept = self._history.keep_until(state.global_step)  # a resumed run logs the later steps again
            self.first_nonfinite = next(
                ((record["step"], record["nonfinite"][0]) for record in kept if record.get("nonfinite")), None
            )
        if self.stop_on_nonfinite_loss and self._loss_hook is None:
            self._loss_hook = model.register_forward_hook(self._watch_loss)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self._recorder is None or not self._logs_at(state.global_step + 1, args, state):
            return
        if patched_normalization(model) is None:
            patch(model, "softmax")  # hf_knorm's softmax = the model's own attention, read from inside
            self._temporary_patch = model
        self._recorder.start()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._recorder is not None and self._recorder.active:
            self._end_step(model)
            layers = self._recorder.finish()  # all processes reach this step: the reduction is collective
            self._pending = (state.global_step, layers)
            control.should_log = True
            self._note_nonfinite(state.global_step, layers, state.is_world_process_zero)
        if self.stop_on_nonfinite_loss:
            self._check_loss(state, control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending is None or logs is None or "loss" not in logs:
            return
        step, layers = self._pending
        if step != state.global_step:
            return
        self._pending = None
        scalars = self._scalars(layers)
        logs.update(scalars)  # the integrations after this callback read this dict
        entry = state.log_history[-1] if state.log_history else None
        if entry is not None and entry.get("step") == step and entry.get("loss") == logs["loss"]:
            entry.update(scalars)  # the Trainer appended its copy before calling on_log
        if self._history is not None:
            self._write(step, state, logs, layers)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._end_step(model)
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None

    # --- helpers -------------------------------------------------------------------------------------------------

    def _logs_at(self, step: int, args, state) -> bool:
        """Whether the optimizer step ``step`` (1-based) logs the norms."""
        if self.every is not None:
            return step % self.every == 0
        if args.logging_first_step and step == 1:
            return True
        return bool(state.logging_steps) and step % state.logging_steps == 0

    def _end_step(self, model) -> None:
        """Stop recording and undo the temporary softmax patch, if any."""
        if self._recorder is not None:
            self._recorder.stop()
        if self._temporary_patch is not None:
            unpatch(self._temporary_patch)
            self._temporary_patch = None

    def _scalars(self, layers: list[dict[str, float]]) -> dict[str, float]:
        width = max(2, len(str(len(layers) - 1)))
        return {
            f"{self.prefix}/layer_{index:0{width}d}/{name}": float(stats[name])
            for index, stats in enumerate(layers)
            for name in STATISTICS
        }

    def _write(self, step: int, state, logs: dict, layers: list[dict[str, float]]) -> None:
        record = {"step": step, "epoch": state.epoch, "loss": logs.get("loss"), "normalization": self._normalization,
                  "layers": layers}
        nonfinite = _nonfinite_keys(layers)
        if nonfinite:
            record["nonfinite"] = nonfinite
        self._history.append(record)

    def _note_nonfinite(self, step: int, layers: list[dict[str, float]], main_process: bool) -> None:
        if self.first_nonfinite is not None:
            return
        nonfinite = _nonfinite_keys(layers)
        if nonfinite:
            self.first_nonfinite = (step, nonfinite[0])
            if main_process:
                logger.warning(
                    f"NormLoggerCallback: first non-finite attention statistic at step {step}: {nonfinite[0]} "
                    f"({len(nonfinite)} non-finite values at this step). They are logged as NaN/inf."
                )

    def _watch_loss(self, module, args, output) -> None:
        loss = output.get("loss") if hasattr(output, "get") else None
        if not module.training or not isinstance(loss, torch.Tensor):
            return
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite

    def _check_loss(self, state, control) -> None:
        finite = self._loss_finite
        self._loss_finite = None
        if finite is None:
            return
        if not finite_on_every_process(finite):
            self.stopped_at_step = state.global_step
            control.should_training_stop = True
            if state.is_world_process_zero:
                logger.warning(f"NormLoggerCallback: non-finite loss at step {state.global_step}; stopping training.")


class _HideFromConsole(TrainerCallback):
    """Placed just before the Trainer's console printer: removes the norm scalars from the ``logs`` it prints.

    Only the console loses them: every callback before it, the integrations included, has read them, and
    ``state.log_history`` keeps them.
    """

    def __init__(self, owner: NormLoggerCallback):
        self.owner = owner

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            for key in [key for key in logs if key.startswith(self.owner.prefix + "/")]:
                del logs[key]


def _nonfinite_keys(layers: list[dict[str, float]]) -> list[str]:
    width = max(2, len(str(len(layers) - 1)))
    return [
        f"layer_{index:0{width}d}/{name}"
        for index, stats in enumerate(layers)
        for name in STATISTICS
        if not math.isfinite(stats[name])
    ]
