"""The ``hf-knorm kv-norms`` job: its settings (the command's flags) and the run (balance, figure, numbers)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

from ..models.sources import MODEL_HELP
from ..balancing.balance import balance_kv


def _default_of(parameter: str):
    """``balance_kv``'s own default: the flag shows it rather than repeating it."""
    return inspect.signature(balance_kv).parameters[parameter].default


@dataclass
class KVNormsSettings:
    """What ``hf-knorm kv-norms`` runs; each field is a flag of the command (``--calibration-tokens 2048``)."""

    model: str = field(default="default", metadata={"help": MODEL_HELP})
    mode: str = field(default=_default_of("mode"), metadata={"help": "one scale per layer or per channel",
                                                             "choices": ("layer", "channel")})
    alpha: float = field(default=_default_of("alpha"), metadata={"help": "migration strength of --mode channel, in (0, 1]"})
    layer: int | None = field(default=None, metadata={
        "help": "layer of the figure (without it: the one with the largest K/V norm ratio)"})
    calibration_tokens: int = field(default=_default_of("max_tokens"), metadata={"help": "calibration tokens"})
    out: str = field(default="outputs/kv_norms", metadata={"help": "output folder"})

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise ValueError(f"--alpha must be in (0, 1], got {self.alpha}.")
        if self.calibration_tokens < 1:
            raise ValueError(f"--calibration-tokens must be positive, got {self.calibration_tokens}.")


def run_kv_norms(settings: KVNormsSettings) -> dict[str, Path]:
    """Balance the model on Shakespeare's training split (Hamlet and the sonnets stay held out) and write the figure
    for one layer, every layer's K/V mean-norm ratio before and after, and the numbers; returns the written files."""
    from ..assets.texts import shakespeare_split
    from ..models.persistence import load_model

    model, tokenizer = load_model(settings.model)
    layers = model.config.num_hidden_layers
    if settings.layer is not None and not 0 <= settings.layer < layers:  # checked before the minute of calibration
        raise ValueError(f"--layer {settings.layer} is out of range: the model has layers 0..{layers - 1}.")
    texts, _ = shakespeare_split()
    report = balance_kv(model, tokenizer, texts, settings.mode, alpha=settings.alpha,
                        max_tokens=settings.calibration_tokens)
    return report.save(Path(settings.out), settings.layer)
