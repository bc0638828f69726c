"""A conversion measured where a softmax window cannot help: perplexity beyond the window and retrieval.

A hybrid ``x^p/c + softmax window W`` (:mod:`hf_knorm.attention.window`) can look good on short blocks while its
polynomial part does nothing: the window alone models most local text (arXiv 2510.05901 re-tested such hybrids and
warns of exactly this). So every conversion is also measured

- **beyond the window**: held-out perplexity of each domain in blocks of ``BLOCK`` tokens (``--beyond-window-block``),
  scored on the tokens at positions ``>= START`` only (every one of them has ``START - W`` or more keys older than a
  window of ``W <= START``), each against the original model on the same tokens;
- **by retrieval**: the passkey (and optionally needle) grid of :mod:`hf_knorm.evaluation.retrieval` at 1k-2k tokens,
  answered with the cache the model's ``generate`` uses (a ``p = 1`` hybrid: its constant-size state plus the last
  ``W`` keys), against the original's hits;
- and, for a hybrid, both again **with the polynomial part switched off** (the window alone,
  :func:`hf_knorm.models.window_mix.distant_part_off`): the hybrid must beat it beyond the window, or its polynomial
  part is decoration. Where the mix is already 0 in every head (a sparse cache that held every older key of the
  training blocks leaves the part beside the window nothing to fit), the window alone is the same model: its
  figures are the converted model's, not measured twice (``window_only_is_converted`` in the record).
"""

from __future__ import annotations

from ..evaluation.retrieval import hits_by_length, retrieval_records
from ..models.patching import held_normalization
from ..models.window_mix import distant_part_off, window_mixes
from ..data.heldout import held_out_domain_blocks, held_out_perplexity

BLOCK = 1024
"""Tokens per block of the beyond-window perplexity, by default. Longer blocks measure what a bounded cache loses
where it cannot hold the whole block: the default conversion is 1.24x the original on technical text in 1,024-token
blocks and 2.21x in 4,096-token blocks (docs/results/conversion.md, "At 4,096 tokens")."""
START = 256
"""The first position scored (LoLCATs' window is 64: every scored token has 192+ keys older than it)."""


def beyond_window_blocks(domains: list[str], tokenizer, eval_tokens: int, block: int = BLOCK) -> dict:
    """Each domain's held-out text in ``max(eval_tokens, block) // block`` blocks of ``block`` tokens (the same texts
    as the 256-token evaluation, packed longer), labels ``-100`` before position ``START``: only the later tokens
    count.

    Raises:
        ValueError: ``block`` is not longer than ``START``.
    """
    check_block(block)
    blocks = held_out_domain_blocks(domains, tokenizer, block, max(eval_tokens, block))

    def score_late(example):
        return {"labels": [-100] * START + example["labels"][START:]}

    return {name: data.map(score_late, desc=f"beyond-window blocks, {name}") for name, data in blocks.items()}


def check_block(block: int) -> None:
    """Raise ``ValueError`` unless ``block`` tokens leave tokens to score after position ``START``."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= START:
        raise ValueError(f"beyond_window_block must be an integer above {START} (the tokens before position {START} "
                         f"are not scored), got {block!r}.")


def beyond_window_perplexities(model, blocks: dict, label: str) -> dict[str, float]:
    """``{domain: perplexity}`` of ``model`` on :func:`beyond_window_blocks`."""
    return {name: held_out_perplexity(model, data, desc=f"{label}, {name} beyond the window")
            for name, data in blocks.items()}


def measure_converted(model, tokenizer, blocks: dict, retrieval: dict, windowed: bool) -> dict:
    """The converted model's beyond-window perplexities and retrieval records, and the window-only ablation's when
    ``windowed``: ``{"perplexity": ..., "retrieval": [...], "window_only": {"perplexity": ..., "retrieval": [...]}}``.
    Where every head's mix is 0 and there are no clusters the ablation changes nothing: ``window_only`` is the
    converted model's own figures, with ``"is_converted": True``.

    Args:
        retrieval: keyword arguments of :func:`~hf_knorm.evaluation.retrieval.retrieval_records` (tasks, lengths,
            depths, seeds); an empty ``tasks`` measures no retrieval.
    """
    measured = {"perplexity": beyond_window_perplexities(model, blocks, "converted model"),
                "retrieval": retrieval_records(model, tokenizer, **retrieval, desc="converted model, retrieval")}
    clustered = held_normalization(model).clusters
    if windowed and not clustered and all(mix == 0 for layer in window_mixes(model) for mix in layer):
        measured["window_only"] = {**measured, "is_converted": True}
    elif windowed:
        with distant_part_off(model):
            measured["window_only"] = {
                "perplexity": beyond_window_perplexities(model, blocks, "window only"),
                "retrieval": retrieval_records(model, tokenizer, **retrieval, desc="window only, retrieval")}
    return measured


def beyond_window_record(original: dict, converted: dict, block: int = BLOCK) -> dict:
    """What ``convert.json`` and the card keep: per domain the original's, the converted model's and (a hybrid) the
    window-only perplexity beyond the window (in blocks of ``block`` tokens) with their ratios, the worst domain, and
    the retrieval hits by task and length of each (the answers themselves beside them)."""
    window_only = converted.get("window_only")
    domains = {}
    for name, reference in original["perplexity"].items():
        entry = {"original_perplexity": reference, "perplexity": converted["perplexity"][name],
                 "ratio_to_original": converted["perplexity"][name] / reference}
        if window_only:
            entry["window_only_perplexity"] = window_only["perplexity"][name]
            entry["window_only_ratio"] = window_only["perplexity"][name] / reference
        domains[name] = entry
    worst = max(domains, key=lambda name: domains[name]["ratio_to_original"])
    record = {"block_size": block, "first_scored_position": START, "domains": domains, "worst_domain": worst,
              "worst_ratio": domains[worst]["ratio_to_original"],
              "retrieval": {"original": hits_by_length(original["retrieval"]),
                            "converted": hits_by_length(converted["retrieval"])},
              "answers": {"original": original["retrieval"], "converted": converted["retrieval"]}}
    if window_only:
        record["window_only_worst_ratio"] = max(entry["window_only_ratio"] for entry in domains.values())
        record["retrieval"]["window_only"] = hits_by_length(window_only["retrieval"])
        record["answers"]["window_only"] = window_only["retrieval"]
        record["window_only_is_converted"] = bool(window_only.get("is_converted"))
    return record
