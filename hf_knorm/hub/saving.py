"""``hf_knorm.save_pretrained``: the weights, the config with the plugin's settings, the tokenizer, and the card.

It writes what :func:`hf_knorm.push_to_hub` sends, so a push can be read locally before it happens: with
``repo_id=`` the folder's ``README.md`` is exactly the card a first push to that repo uploads (a later push also keeps
the text the Hub's card has outside the generated block).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.nn as nn

from ..models.persistence import save_weights_and_config
from .base_model import resolve_base_model
from .card import render_card
from .card_inputs import CardInputs, evaluation_inputs, kv_balance_inputs, niah_inputs, norm_history_inputs

CARD_FILE = "README.md"


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *, tokenizer=None, repo_id: str | None = None,
                    base_model: str | None = None, balance_report=None, niah=None, norm_history=None,
                    evaluation: dict | None = None, **kwargs) -> Path:
    """Save ``model`` so that everything hf_knorm changed comes back on load, with its model card.

    ``config.json`` always carries the plugin's settings (normalization, K/V balancing record, plugin version) and,
    for a patched model, the ``attn_implementation`` marker. The card (``README.md``) is rendered from
    the template ``model_card.md``; text written outside its generated block in an earlier ``README.md`` in the folder is kept.

    Args:
        model: a Transformers model, patched or not.
        save_directory: the folder to write (created if needed).
        tokenizer: its tokenizer or processor, saved alongside (anything with ``save_pretrained``).
        repo_id: the Hub repo the card's loading snippet names; default: the folder.
        base_model: the Hub id of the model this one derives from; default: inferred (see
            :func:`hf_knorm.hub.base_model.resolve_base_model`).
        balance_report: the :class:`~hf_knorm.BalanceReport` of the balancing these weights went through: per-layer
            K/V norm ratios before/after and the "Original vs. Balanced kv-norm" figure on the card.
        niah: needle-in-a-haystack results of this model (records, ``results.json`` or its folder): their table.
        norm_history: the per-layer attention-norm figure of its training run (an image path).
        evaluation: the held-out perplexity record of the training job that made these weights (the ``evaluation``
            entry of ``finetune.json`` / ``convert.json``): a card section and the metadata's ``model-index``.
        **kwargs: passed to ``model.save_pretrained`` (``max_shard_size``, ...).

    Returns:
        The folder written.

    Raises:
        ValueError, FileNotFoundError, TypeError: a bad ``base_model`` or measurement input (checked before
            anything is written).
    """
    folder = Path(save_directory)
    origin = resolve_base_model(model, base_model)  # before the folder's own record is overwritten
    niah_table = niah_inputs(niah) if niah is not None else None
    evaluation = evaluation_inputs(evaluation) if evaluation is not None else None
    if norm_history is not None and not Path(norm_history).is_file():
        raise FileNotFoundError(f"No norm-history figure at {norm_history}.")
    if balance_report is not None:
        from ..balancing.report import BalanceReport

        if not isinstance(balance_report, BalanceReport):
            raise TypeError("balance_report must be the BalanceReport that hf_knorm.balance_kv returned, got "
                            f"{type(balance_report).__name__}.")
    previous_card = (folder / CARD_FILE).read_text() if (folder / CARD_FILE).is_file() else None
    for stale in CardInputs.read(folder).figures() if folder.is_dir() else []:
        (folder / stale).unlink(missing_ok=True)  # figures of the weights this save replaces

    save_weights_and_config(model, folder, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    inputs = CardInputs(origin, niah=niah_table, evaluation=evaluation)
    if balance_report is not None:
        inputs.kv_balance = kv_balance_inputs(balance_report, folder)
    if norm_history is not None:
        inputs.norm_history = norm_history_inputs(norm_history, folder)
    inputs.write(folder)
    card = render_card(folder, repo_id if repo_id is not None else str(save_directory), previous_card)
    card.save(folder / CARD_FILE)
    return folder
