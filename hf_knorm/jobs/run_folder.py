"""A training job's run folder: atomic JSON files, and the settings a run started with, compared on ``--resume``.

A run folder outlives the process that writes it: a job is interrupted (a crash, a lost machine, Ctrl-C) and resumed.
Three rules keep it whole:

- every JSON record is written to ``<name>.partial`` and moved over the old file (``os.replace`` is atomic on one
  file system), so an interruption never leaves half a file;
- the settings are stored when a run starts (:func:`store_settings`), and ``--resume`` with settings that shape the
  result changed is refused, naming each field (:func:`check_same_settings`): resuming with another normalization
  would mix two runs and label the result with the second;
- in a run of several processes only the main one writes (:func:`is_main_process`); the Trainer itself writes its
  checkpoints from that process too.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path


def is_main_process() -> bool:
    """Whether this process writes the run folder: the only one, or global rank 0 of a run started by ``torchrun`` or
    ``accelerate launch`` (both set ``RANK``). The other processes train alongside and write nothing."""
    return int(os.environ.get("RANK", "0")) == 0


def write_json(path: Path, data) -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically (a temporary file, then ``os.replace``)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(partial, path)
    return path


def settings_record(settings) -> dict:
    """A settings dataclass as JSON values (tuples become lists): how a run folder stores it."""
    return json.loads(json.dumps(asdict(settings), default=str))


def check_same_settings(stored: dict | None, settings, resumable: tuple[str, ...]) -> None:
    """Refuse to resume a run whose settings that shape the result differ from those it started with.

    Args:
        stored: the settings record the run stored when it started (``None``: nothing to compare).
        settings: the settings of the resumed run (a dataclass with ``out``).
        resumable: fields a resumed run may change (they do not shape the result: logging, the run folder, ...).
            A field the stored record lacks (added to the settings after the run started) counts as its default.

    Raises:
        ValueError: a field outside ``resumable`` differs; the message names each, with both values.
    """
    if not stored:
        return
    now = settings_record(settings)
    defaults = settings_record(type(settings)())
    changed = [name for name in now if name not in resumable and stored.get(name, defaults[name]) != now[name]]
    if changed:
        details = ", ".join(f"{name}: {stored.get(name)!r} then, {now[name]!r} now" for name in changed)
        raise ValueError(f"--resume continues the run in {settings.out} with the settings it started with; these "
                         f"differ: {details}. Resume with the same settings, or start another --out.")
