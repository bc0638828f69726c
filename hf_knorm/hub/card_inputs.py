"""What a model card is rendered from besides the config: the model's origin and the measurements made on it.

They are written next to the weights, in ``hf_knorm_card.json`` (numbers, tables, the origin) and ``figures/``
(images the card shows), so a saved folder renders the same card wherever it is pushed from: ``hf-knorm push DIR``
needs nothing but the folder. Measurements describe the weights saved with them: a save without measurements
writes none, so an old figure never describes a new model.

- K/V balancing: from a :class:`~hf_knorm.BalanceReport`, the mean key / mean value channel-norm ratio of every
  layer before and after, the exactness check, and TransMLA's "Original vs. Balanced kv-norm" figure of the most
  unbalanced layer.
- Needle in a haystack: the summary table of every task, from the records of ``hf-knorm niah`` (a list, its
  ``results.json``, or its output folder).
- Training: the per-layer attention-norm figure of a fine-tuning run (a PNG, SVG or JPEG path), copied in.
- Evaluation: held-out perplexity of these weights and of the original model on the same text, from the training
  job that made them (``hf-knorm finetune``'s and ``hf-knorm convert``'s ``evaluation`` record); it also goes into
  the card's metadata as the Hub's ``model-index``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..balancing.report import BalanceReport
from ..evaluation.needle import summary_table
from .base_model import CARD_INPUTS_FILE, BaseModel

FIGURES = "figures"
FIGURE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg")


@dataclass
class CardInputs:
    """The origin and measurements a card shows; saved as ``hf_knorm_card.json`` in the model folder.

    Attributes:
        base_model: where the model came from.
        kv_balance: per-layer K/V norm ratios before/after balancing, the check, the figure's path in the folder.
        niah: ``{"tables": {task: markdown table}}``.
        norm_history: ``{"figure": path in the folder}``.
        evaluation: ``{"text", "tokens", "block_size", "perplexity", "original_perplexity", ...}`` (see
            :func:`evaluation_inputs`).
    """

    base_model: BaseModel
    kv_balance: dict | None = None
    niah: dict | None = None
    norm_history: dict | None = None
    evaluation: dict | None = None

    def write(self, folder: Path) -> Path:
        """Write ``hf_knorm_card.json`` into ``folder``; returns its path."""
        path = Path(folder) / CARD_INPUTS_FILE
        data = {"base_model": self.base_model.to_dict(), "kv_balance": self.kv_balance, "niah": self.niah,
                "norm_history": self.norm_history, "evaluation": self.evaluation}
        path.write_text(json.dumps(data, indent=1) + "\n")
        return path

    @classmethod
    def read(cls, folder: Path) -> "CardInputs":
        """The inputs saved in ``folder``; a folder without them (not saved by hf_knorm) has an unknown origin."""
        path = Path(folder) / CARD_INPUTS_FILE
        if not path.is_file():
            return cls(BaseModel(None, "Not recorded (the folder was not saved by hf_knorm)."))
        data = json.loads(path.read_text())
        origin = data.get("base_model") or {}
        return cls(BaseModel(origin.get("hub_id"), origin.get("note", "Not recorded.")), data.get("kv_balance"),
                   data.get("niah"), data.get("norm_history"), data.get("evaluation"))

    def figures(self) -> list[str]:
        """The figure paths (relative to the folder) these inputs refer to."""
        return [entry["figure"] for entry in (self.kv_balance, self.norm_history) if entry and entry.get("figure")]


def kv_balance_inputs(report: BalanceReport, folder: Path) -> dict:
    """Per-layer K/V ratios and the check from ``report``; draws its figure into ``folder/figures/``."""
    if not isinstance(report, BalanceReport):
        raise TypeError(f"balance_report must be the BalanceReport that hf_knorm.balance_kv returned, got "
                        f"{type(report).__name__}.")
    layer = report.default_layer()
    figure = f"{FIGURES}/kv_norms_layer{layer}_{report.mode}.png"
    report.plot(Path(folder) / figure, layer)
    before, after = report.before.ratios().tolist(), report.after.ratios().tolist()
    return {"mode": report.mode, "alpha": report.alpha, "calibration_tokens": report.before.tokens,
            "max_logit_change": report.max_logit_change, "tolerance": report.tolerance, "figure": figure,
            "figure_layer": layer,
            "layers": [{"layer": i, "before": b, "after": a} for i, (b, a) in enumerate(zip(before, after))]}


def niah_inputs(source) -> dict:
    """The summary table of each task in ``source``: records, a ``results.json`` path, or the folder holding it.

    Raises:
        FileNotFoundError: no ``results.json`` at the path given.
        ValueError: no records.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        path = path / "results.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"No needle-in-a-haystack results at {path}: pass the results.json that "
                                    "`hf-knorm niah` wrote (or its --out folder), or the list of records.")
        records = json.loads(path.read_text())
    else:
        records = list(source)
    if not records:
        raise ValueError("The needle-in-a-haystack results are empty: nothing to put on the card.")
    tasks = list(dict.fromkeys(record["task"] for record in records))
    return {"tables": {task: summary_table(records, task) for task in tasks}}


def norm_history_inputs(figure, folder: Path) -> dict:
    """Copy the training run's per-layer norm figure into ``folder/figures/``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an image the Hub renders in a card.
    """
    figure = Path(figure)
    if not figure.is_file():
        raise FileNotFoundError(f"No norm-history figure at {figure}.")
    if figure.suffix.lower() not in FIGURE_SUFFIXES:
        raise ValueError(f"The norm-history figure must be one of {FIGURE_SUFFIXES}, got {figure.name}.")
    target = f"{FIGURES}/norm_history{figure.suffix.lower()}"
    (Path(folder) / FIGURES).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(figure, Path(folder) / target)
    return {"figure": target}


EVALUATION_KEYS = ("text", "tokens", "block_size", "perplexity", "original_perplexity")


def evaluation_inputs(record: dict) -> dict:
    """Check a training job's ``evaluation`` record for the card (held-out perplexity, and the original's).

    Raises:
        ValueError: a key is missing or a perplexity is not a positive number.
    """
    if not isinstance(record, dict):
        raise TypeError(f"evaluation must be the dict a training job recorded, got {type(record).__name__}.")
    missing = [key for key in EVALUATION_KEYS if key not in record]
    if missing:
        raise ValueError(f"The evaluation record lacks {', '.join(missing)}; pass the 'evaluation' entry of "
                         "finetune.json or convert.json.")
    for key in ("perplexity", "original_perplexity"):
        if not isinstance(record[key], (int, float)) or not record[key] > 0:
            raise ValueError(f"evaluation[{key!r}] must be a positive number, got {record[key]!r}.")
    return json.loads(json.dumps(record, default=str))
