"""The values a rendered model card states (hf_knorm/hub/model_card.md), read back, so that a test compares them with
what the model, its config or its run holds instead of pinning the card's sentences."""

from __future__ import annotations

import re

from hf_knorm.normalizations import parse_normalization


def _one(pattern: str, text: str, cast=str):
    """``cast`` of the first group of the only match of ``pattern``; ``None`` without one; AssertionError with two."""
    found = re.findall(pattern, text, flags=re.S)
    assert len(found) <= 1, (pattern, found)
    return cast(found[0]) if found else None


def stated_normalization(card: str) -> dict | None:
    """The card's "Attention normalization" entry: its spelling and what its meaning says of the softmax part, read
    from the words (``None`` where the meaning names none): ``{"spelling", "window", "sinks", "sparse", "score",
    "clusters"}``. ``None`` when the card names no normalization."""
    entry = re.search(r"\*\*Attention normalization `([^`]+)`\*\* \((.*?)\), from \"Rethinking Softmax\"", card, re.S)
    if entry is None:
        return None
    meaning = " ".join(entry.group(2).split())
    sparse = re.findall(r"the (\d+) older keys of highest (\w+)", meaning)
    assert len(sparse) <= 1, sparse
    return {"spelling": entry.group(1),
            "window": _one(r"each query's last (\d+) positions", meaning, int),
            "sinks": _one(r"the sequence's first (\d+) \(attention sinks\)", meaning, int),
            "sparse": int(sparse[0][0]) if sparse else None,
            "score": sparse[0][1] if sparse else None,
            "clusters": _one(r"(\d+) pseudo-keys", meaning, int)}


def expected_normalization(spelling: str) -> dict:
    """What :func:`stated_normalization` should read for a model patched with ``spelling``: the parsed values."""
    norm = parse_normalization(spelling)
    return {"spelling": spelling,
            "window": norm.window or None,
            "sinks": norm.sinks or None,
            "sparse": norm.sparse or None,
            "score": norm.score if norm.sparse else None,
            "clusters": norm.clusters or None}


def stated_knorm_defaults(card: str) -> dict[str, str] | None:
    """The KNorm defaults the card lists (``key=value`` code spans of that entry, values as rendered), or ``None``."""
    entry = _one(r"\*\*KNorm KV-cache compression defaults\*\* \(\[arXiv[^)]*\)\):(.*?), recorded", card)
    return None if entry is None else dict(re.findall(r"`(\w+)=([^`]*)`", entry))


def stated_balancing(card: str) -> str | None:
    """The K/V balancing mode the card's entry names (``"layer"``, ``"channel"``), or ``None`` (none stated)."""
    return _one(r"\*\*K/V balancing\*\* \(`(\w+)` mode", card)


def stated_changes(card: str) -> dict:
    """What the card says hf_knorm changed: the normalization's spelling, the balancing mode and the KNorm defaults,
    each ``None`` where it states none."""
    normalization = stated_normalization(card)
    return {"normalization": normalization and normalization["spelling"], "balancing": stated_balancing(card),
            "knorm": stated_knorm_defaults(card)}


def stated_data_format(card: str) -> dict | None:
    """``{"format", "loss_on"}`` of the card's "Trained on ... data, the loss on ..." line (the format with its
    underscores), or ``None``."""
    found = re.findall(r"Trained on ([\w ]+?) data, the loss on ([^.]+)\.", card)
    assert len(found) <= 1, found
    return {"format": found[0][0].replace(" ", "_"), "loss_on": found[0][1]} if found else None


def stated_twin(card: str) -> str | None:
    """The twin the card says both conversion stages trained (``x^3/1`` for ``x^3/16``), or ``None``."""
    return _one(r"trained its twin `([^`]+)`", card)


def loading_snippet(card: str) -> str:
    """The card's python block: how it tells the reader to load the model."""
    return _one(r"```python\n(.*?)```", card)


def load_as_the_card_says(card: str, load_id: str, folder) -> object:
    """The model the card's snippet loads, run with ``folder`` in place of the ``load_id`` it names."""
    snippet = loading_snippet(card)
    assert f'"{load_id}"' in snippet, snippet
    namespace = {}
    exec(snippet.replace(f'"{load_id}"', repr(str(folder))), namespace)  # noqa: S102 (the card's own code)
    return namespace["model"]


def stated_held_out(card: str) -> dict:
    """The held-out perplexity section's figures: ``{"worst_domain", "worst_ratio", "domains": {name: (original,
    this model, ratio)}}`` as printed (two decimals)."""
    worst = re.findall(r"the worst set \(([^)]+)\): ([\d.]+)x the original", " ".join(card.split()))
    assert len(worst) <= 1, worst
    rows = re.findall(r"^\| ([\w-]+): [^|]* \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", card, flags=re.M)
    return {"worst_domain": worst[0][0] if worst else None, "worst_ratio": float(worst[0][1]) if worst else None,
            "domains": {name: tuple(map(float, figures)) for name, *figures in rows}}


def stated_beyond_window(card: str) -> dict | None:
    """``{"worst_domain", "worst_ratio", "window_only_worst_ratio"}`` of the card's beyond-the-window paragraph (the
    last ``None`` where it names no window-only ablation), or ``None``."""
    found = re.findall(r"the worst domain \(([^)]+)\) is ([\d.]+)x the original(?:, the window alone \(the polynomial "
                       r"part switched off\) ([\d.]+)x)?", " ".join(card.split()))
    assert len(found) <= 1, found
    if not found:
        return None
    domain, ratio, window_only = found[0]
    return {"worst_domain": domain, "worst_ratio": float(ratio),
            "window_only_worst_ratio": float(window_only) if window_only else None}


def stated_probe_agreement(card: str) -> int | None:
    """The percentage of the original model's answers the card says the probe reproduced, or ``None``."""
    return _one(r"(\d+)% of the original model's answers reproduced", " ".join(card.split()), int)


def two_decimals(value: float) -> float:
    """``value`` as the card prints it (``%.2f``), read back."""
    return float(f"{value:.2f}")
