"""A training job's run folder: atomic JSON files, and the settings a run started with, compared on ``--resume``.

A run folder outlives the process that writes it: a job is interrupted (a crash, a lost machine, Ctrl-C) and resumed.
Three rules keep it whole:

- every JSON record is written to ``<name>.partial`` and moved over the old file (``os.replace`` is atomic on one
  file system), so an interruption never leaves half a file;
- the settings are stored when a run starts, and ``--resume`` with settings that shape the result changed is refused,
  naming each field (:func:`check_same_settings`): resuming with another normalization would mix two runs and label
  the result with the second. Both jobs let the same fields change (:data:`RESUMABLE_FIELDS`);
- so are the run's inputs (:func:`inputs_fingerprint`): a data file edited, or a model folder rewritten, under the same
  path resumes nothing silently (:func:`check_same_inputs`): the examples trained on and evaluated on (after
  tokenization, so a changed tokenizer shows too) are hashed, and the model folder's config and weight files;
- in a run of several processes only the main one writes (:func:`is_main_process`); the Trainer itself writes its
  checkpoints from that process too. The roles are accelerate's (:func:`process_state`, its ``PartialState``: what the
  Trainer itself uses, whatever launched the processes), and work done once for all of them runs on the main process
  while the others wait (:func:`on_main_process`, ``PartialState.main_process_first``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

RESUMABLE_FIELDS = ("resume", "out", "report_to", "logging_steps", "save_steps", "eval_steps", "max_steps")
"""Settings a resumed run may change, in every job (a job without one of them ignores it): they say where and how often
to log, save and evaluate, and ``max_steps`` (``finetune``) continues a run further; none shapes the weights."""


def process_state():
    """accelerate's ``PartialState`` of this process: its role and device in the run. Set up as the jobs'
    ``TrainingArguments`` set up theirs (``use_cpu`` where there is no accelerator), whose Trainer then takes the same
    process group over."""
    from accelerate import PartialState

    from .precision import has_accelerator

    return PartialState(cpu=not has_accelerator())


def is_main_process() -> bool:
    """Whether this process writes the run folder: the only one, or the main process of a run of several (as accelerate
    tells it, however the processes were started). The other processes train alongside and write nothing."""
    return process_state().is_main_process


def on_main_process(work):
    """``work()`` run once, on the main process, while the others wait; its result, on every process.

    For what must not run once per process (the original model's evaluation, its samples, the probe): the others
    receive the main process's result (``accelerate.utils.broadcast_object_list``).
    """
    state = process_state()
    result = [work() if state.is_main_process else None]
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(result, from_process=0)
    return result[0]


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


def check_same_settings(stored: dict | None, settings, resumable: tuple[str, ...] = RESUMABLE_FIELDS) -> None:
    """Refuse to resume a run whose settings that shape the result differ from those it started with.

    Args:
        stored: the settings record the run stored when it started (``None``: the run kept none, which is refused).
        settings: the settings of the resumed run (a dataclass with ``out``).
        resumable: fields a resumed run may change (they do not shape the result: logging, the run folder, ...).
            A field the stored record lacks (added to the settings after the run started) counts as its default.

    Raises:
        ValueError: a field outside ``resumable`` differs; the message names each, with both values.
    """
    if not stored:
        raise ValueError(f"--resume: {settings.out} holds no record of the settings its run started with, so nothing "
                         "shows that resuming would continue the same run. Start another --out.")
    now = settings_record(settings)
    defaults = settings_record(type(settings)())
    changed = [name for name in now if name not in resumable and stored.get(name, defaults[name]) != now[name]]
    if changed:
        details = ", ".join(f"{name}: {stored.get(name)!r} then, {now[name]!r} now" for name in changed)
        raise ValueError(f"--resume continues the run in {settings.out} with the settings it started with; these "
                         f"differ: {details}. Resume with the same settings, or start another --out.")


SAMPLED_BYTES = 1 << 20
"""Bytes read at each end of a weight file for its fingerprint (with its size and the whole config)."""


def inputs_fingerprint(model_dir: str | Path, examples: dict) -> dict:
    """What a run is made from, to compare on ``--resume``: ``{"model": hash, "data": {name: hash}}``.

    Args:
        model_dir: the model's folder: ``config.json`` whole, and each weight file (``*.safetensors``, ``*.bin``) by
            name, size and its first and last MiB (a rewritten checkpoint differs there; the whole of a large model
            would take minutes to read at each start).
        examples: the ``datasets.Dataset`` of examples the run trains and evaluates on, by name; every row's columns
            are hashed (content, not paths: a data file edited under the same name shows).
    """
    model = hashlib.sha256()
    folder = Path(model_dir)
    for path in sorted([*folder.glob("config.json"), *folder.glob("*.safetensors"), *folder.glob("*.bin")]):
        model.update(f"{path.name}:{path.stat().st_size}".encode())
        with path.open("rb") as file:
            if path.name == "config.json":
                model.update(file.read())
                continue
            model.update(file.read(SAMPLED_BYTES))
            file.seek(max(0, path.stat().st_size - SAMPLED_BYTES))
            model.update(file.read())
    return {"model": model.hexdigest(), "data": {name: examples_fingerprint(data) for name, data in examples.items()}}


def examples_fingerprint(dataset) -> str:
    """A content hash of a ``datasets.Dataset``'s rows (columns in name order), read a batch at a time."""
    digest = hashlib.sha256()
    columns = sorted(dataset.column_names)
    digest.update(json.dumps([len(dataset), columns]).encode())
    for batch in dataset.select_columns(columns).iter(batch_size=10_000):
        digest.update(json.dumps([batch[column] for column in columns], default=str).encode())
    return digest.hexdigest()


def check_same_inputs(stored: dict | None, current: dict, out) -> None:
    """Refuse to resume a run whose inputs (:func:`inputs_fingerprint`) differ from those it started with.

    Raises:
        ValueError: the run stored no fingerprint, or the model folder or a set of examples changed (each named).
    """
    if not stored:
        raise ValueError(f"--resume: {out} holds no fingerprint of the data and model its run started from (it was "
                         "started by an older hf_knorm), so nothing shows that they are unchanged. Start another --out.")
    changed = []
    if stored.get("model") != current["model"]:
        changed.append("the model folder (its config or weight files)")
    for name in sorted(set(stored.get("data", {})) | set(current["data"])):
        if stored.get("data", {}).get(name) != current["data"].get(name):
            changed.append(f"the {name} examples (the data file, dataset or tokenizer behind them)")
    if changed:
        raise ValueError(f"--resume continues the run in {out} on the inputs it started from; these changed since: "
                         f"{'; '.join(changed)}. Restore them, or start another --out.")
