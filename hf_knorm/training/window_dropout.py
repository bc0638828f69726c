"""Window dropout: on the training steps it draws, a windowed model runs without its softmax window, so that the part
beside the window must carry the context.

Scheduled Sliding-window Dropout (Benfeghoul et al., arXiv 2510.05901): hybrids of a sliding softmax window and
another attention learn to bypass the other branch; suppressing the window stochastically during training, with a
probability that follows a schedule, prevents it. Our reading, and what runs here:

- **Per optimizer step, all layers together.** Before each optimizer step the callback draws once: with probability
  ``p(step)`` every attention layer's window is dropped for all the micro-batches of that step (and its gradient
  accumulation), else none is. What a dropped layer computes is :mod:`hf_knorm.attention.window_off`: the base family
  over every key, the sinks and a sparse cache off too.
- **Schedules.** ``linear``: ``p(t) = p0 * (1 - t / T)`` at step ``t = 0 .. T - 1`` of a ``T``-step run (``p0`` at
  the first step, going to 0 at the end, so the last steps train the composition that inference runs); ``constant``:
  ``p(t) = p0``.
- **Deterministic.** The draw of step ``t`` depends on the seed and ``t`` alone (a generator of its own, seeded from
  both: the global random state is not touched, so ``p0 = 0`` trains bit for bit as without the callback, and a
  resumed run draws what the interrupted one would have). Every process draws the same.
- **Training only.** The switch is on from ``on_step_begin`` to ``on_step_end`` (the Trainer evaluates after
  ``on_step_end``), and the attention reads it only while the module trains: evaluation and ``generate`` run the
  window.
- **Logged.** On each logging step, ``window_dropout/probability`` (``p`` of the last step) and
  ``window_dropout/dropped`` (the share of the steps since the previous log that ran without the window), in the
  Trainer's own log stream (placed before the ``report_to`` integrations as :class:`~.callback.NormLoggerCallback`
  is, :func:`hf_knorm.compat.run_callback_first`).
"""

from __future__ import annotations

import random

from transformers import TrainerCallback

from ..compat import run_callback_first
from ..models.window_mix import set_window_dropped

WINDOW_DROPOUT_SCHEDULES = ("linear", "constant")
"""How the probability of dropping the window moves over a run (:func:`window_dropout_probability`)."""
PREFIX = "window_dropout"


def check_window_dropout(probability: float, schedule: str) -> None:
    """Raise ``ValueError`` unless ``probability`` is a number in ``[0, 1]`` and ``schedule`` one of
    :data:`WINDOW_DROPOUT_SCHEDULES`."""
    if isinstance(probability, bool) or not isinstance(probability, (int, float)) or not 0 <= probability <= 1:
        raise ValueError(f"window dropout is the probability of a training step without the softmax window: a "
                         f"number in [0, 1] (0: off), got {probability!r}.")
    if schedule not in WINDOW_DROPOUT_SCHEDULES:
        raise ValueError(f"window dropout schedule must be one of {', '.join(WINDOW_DROPOUT_SCHEDULES)}, not "
                         f"{schedule!r}.")


def window_dropout_probability(initial: float, schedule: str, step: int, steps: int) -> float:
    """The probability of dropping the window at optimizer step ``step`` (0-based) of a ``steps``-step run:
    ``initial * (1 - step / steps)`` (``linear``, 0 from ``step >= steps`` on) or ``initial`` (``constant``)."""
    check_window_dropout(initial, schedule)
    if schedule == "constant":
        return float(initial)
    return float(initial) * max(0.0, 1.0 - step / max(steps, 1))


def window_dropped_at(seed: int, step: int, probability: float) -> bool:
    """Whether step ``step`` of a run seeded ``seed`` drops the window, at ``probability``: one uniform draw of a
    generator seeded from both (Python's ``random.Random`` on a string: the same on every platform and process, the
    global random state untouched); never at 0, always at 1."""
    if probability <= 0:
        return False
    return random.Random(f"hf_knorm window dropout: seed {seed}, step {step}").random() < probability


def window_dropout_steps(initial: float, schedule: str, seed: int, steps: int) -> list[int]:
    """The optimizer steps (0-based) of a ``steps``-step run seeded ``seed`` that drop the window: what
    :class:`WindowDropoutCallback` draws, resumed or not."""
    return [step for step in range(steps)
            if window_dropped_at(seed, step, window_dropout_probability(initial, schedule, step, steps))]


class WindowDropoutCallback(TrainerCallback):
    """Drop a windowed model's softmax window on the training steps drawn with probability ``p(step)``.

    Args:
        probability: ``p0``, the probability at the first step, in ``[0, 1]``.
        schedule: ``linear`` (from ``p0`` to 0 over the run) or ``constant``.
        seed: the draws' seed; ``None``: the Trainer's ``args.seed``.

    Attributes:
        dropped_steps: the optimizer steps (``state.global_step`` before each, 0-based) that ran without the window.
        reaches_integrations: whether the logged rate reaches the ``report_to`` integrations (see the module docstring).

    Raises:
        ValueError: a probability outside ``[0, 1]`` or an unknown schedule; at ``on_train_begin``, a model without a
            softmax window.

    Example:
        >>> trainer = Trainer(model=windowed_model, args=args, train_dataset=train,
        ...                   callbacks=[WindowDropoutCallback(0.5, "linear")])
    """

    def __init__(self, probability: float, schedule: str = "linear", seed: int | None = None):
        check_window_dropout(probability, schedule)
        self.probability = float(probability)
        self.schedule = schedule
        self.seed = seed
        self.dropped_steps: list[int] = []
        self.reaches_integrations = False
        self._last_probability: float | None = None
        self._since_log = [0, 0]  # [steps dropped, steps] since the last log

    def probability_at(self, step: int, steps: int) -> float:
        """``p`` at optimizer step ``step`` (0-based) of a ``steps``-step run."""
        return window_dropout_probability(self.probability, self.schedule, step, steps)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        set_window_dropped(model, False)  # checks the window; clears a switch a previous train() left on
        self.reaches_integrations = run_callback_first(self)
        self._since_log = [0, 0]

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        probability = self.probability_at(step, state.max_steps)
        seed = args.seed if self.seed is None else self.seed
        dropped = window_dropped_at(seed, step, probability)
        set_window_dropped(model, dropped)
        if dropped:
            self.dropped_steps.append(step)
        self._last_probability = probability
        self._since_log[0] += int(dropped)
        self._since_log[1] += 1

    def on_step_end(self, args, state, control, model=None, **kwargs):
        set_window_dropped(model, False)  # before the Trainer logs, saves and evaluates

    def on_train_end(self, args, state, control, model=None, **kwargs):
        set_window_dropped(model, False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._last_probability is None:
            return
        dropped, steps = self._since_log
        scalars = {f"{PREFIX}/probability": self._last_probability,
                   f"{PREFIX}/dropped": dropped / steps if steps else 0.0}
        logs.update(scalars)  # the integrations after this callback read this dict
        entry = state.log_history[-1] if state.log_history else None
        if entry is not None and entry.get("step") == state.global_step and entry.get("loss") == logs["loss"]:
            entry.update(scalars)  # the Trainer appended its copy before calling on_log
        self._since_log = [0, 0]
