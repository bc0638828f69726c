"""KNorm settings that travel with the model: recorded in its config, used whenever no other value is given.

``set_knorm_defaults(model, compression_ratio=0.5, sink_tokens=4)`` validates the options (by building the
:class:`KNormCache` they describe) and records them in ``config.hf_knorm["knorm"]``, so ``save_pretrained`` and
``push_to_hub`` carry them and the model card lists them. :func:`hf_knorm.eviction.pipeline.knorm_cache_for`, ``knorm_generate`` and
the ``knorm-text-generation`` pipeline start from them; an option passed at call time wins, and a call that sizes
the cache itself (``compression_ratio``, ``budget`` or ``layer_ratios``) replaces the recorded sizing as a whole
(a recorded ratio never meets a passed budget).
"""

from __future__ import annotations

from .cache import KNormCache
from .scores import score_spelling

CACHE_OPTIONS = ("compression_ratio", "budget", "sink_tokens", "recent_window", "layer_ratios", "decoding_budget",
                 "score", "head_budget", "head_floor", "layer_budget", "threshold")
SIZING_OPTIONS = ("compression_ratio", "budget", "layer_ratios", "threshold")
SCORE_BASES = ("cached", "original")
RECORD_KEY = "knorm"


def set_knorm_defaults(model, **options) -> dict:
    """Record KNorm options in ``model``'s config; no options removes the record. Returns what was recorded.

    Args:
        model: a supported decoder.
        **options: :class:`KNormCache` options (``compression_ratio``, ``budget``, ``sink_tokens``,
            ``recent_window``, ``layer_ratios``, ``decoding_budget``, ``score``) and ``score_basis``.

    A score instance is recorded by its spelling (:func:`hf_knorm.eviction.scores.score_spelling`, e.g. ``KeyDiff(pool=3)``
    as ``"key_diff+pool3"``), which every KNorm entry point reads back as the same score.

    Raises:
        ValueError: an unknown option, a value :class:`KNormCache` refuses, a model without a KV cache, or a custom
            score (not in :data:`hf_knorm.eviction.scores.SCORES`), which has no spelling to save.
    """
    unknown = sorted(set(options) - set(CACHE_OPTIONS) - {"score_basis"})
    if unknown:
        raise ValueError(f"Unknown KNorm option(s) {', '.join(unknown)}; accepted: "
                         f"{', '.join(CACHE_OPTIONS + ('score_basis',))}.")
    if options.get("score_basis", "cached") not in SCORE_BASES:
        raise ValueError(f"score_basis must be one of {SCORE_BASES}, got {options['score_basis']!r}.")
    KNormCache(config=model.config, **{k: v for k, v in options.items() if k != "score_basis"})  # validates
    section = dict(getattr(model.config, "hf_knorm", None) or {})
    record = dict(options)
    if isinstance(record.get("layer_ratios"), dict):  # JSON object keys are strings; knorm_defaults turns them back
        record["layer_ratios"] = {str(layer): float(ratio) for layer, ratio in record["layer_ratios"].items()}
    elif record.get("layer_ratios") is not None:
        record["layer_ratios"] = [float(ratio) for ratio in record["layer_ratios"]]
    if "score" in record:  # config.json holds text: a score instance is recorded by its spelling ("key_diff+pool3")
        record["score"] = score_spelling(record["score"])
    if record:
        section[RECORD_KEY] = record
    else:
        section.pop(RECORD_KEY, None)
    if section:
        model.config.hf_knorm = section
    else:
        model.config.__dict__.pop("hf_knorm", None)
    return record


def knorm_defaults(config) -> dict:
    """The KNorm options recorded in ``config`` (``layer_ratios`` keyed by int again); ``{}`` if none."""
    record = dict(((getattr(config, "hf_knorm", None) or {}).get(RECORD_KEY)) or {})
    if isinstance(record.get("layer_ratios"), dict):
        record["layer_ratios"] = {int(layer): ratio for layer, ratio in record["layer_ratios"].items()}
    return record


def merged_options(config, score_basis: str | None, options: dict) -> tuple[str, dict]:
    """``(score_basis, cache options)`` of a call: the recorded defaults, overridden by what the call passes."""
    defaults = knorm_defaults(config)
    recorded_basis = defaults.pop("score_basis", "cached")
    if any(name in options for name in SIZING_OPTIONS):
        for name in SIZING_OPTIONS:
            defaults.pop(name, None)
    return (score_basis or recorded_basis), {**defaults, **options}
