"""``hf-knorm convert`` with the work done on the original model recorded, for the tests that launch it in several
processes (``test_original_model_work.py``): every call of the teacher sampling, the held-out perplexity and the
probe appends ``<process index> <call> <device> <autocast dtype or fp32>`` to ``$CALLS_FILE``; the teacher samples
are cached in ``$TEACHER_CACHE``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from hf_knorm.cli import main
from hf_knorm.conversion import teacher_text
from hf_knorm.evaluation import probe
from hf_knorm.data import heldout


def call_record(name: str, model) -> str:
    device = next(model.parameters()).device
    precision = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32
    return f"{os.environ.get('RANK', '0')} {name} {device.type} {str(precision).removeprefix('torch.')}"


def recorded(module, name: str, replace=setattr) -> None:
    """Record each call of ``module.name`` (``replace``: how to swap it in; tests pass ``monkeypatch.setattr``)."""
    original = getattr(module, name)

    def wrapper(model, *args, **kwargs):
        with open(os.environ["CALLS_FILE"], "a") as calls:
            calls.write(call_record(name, model) + "\n")
        return original(model, *args, **kwargs)

    replace(module, name, wrapper)


if __name__ == "__main__":
    for module, name in ((teacher_text, "_sample"), (heldout, "held_out_perplexity"), (probe, "ask")):
        recorded(module, name)
    teacher_text._cache_root = lambda: Path(os.environ["TEACHER_CACHE"])
    sys.exit(main(sys.argv[1:]))
