"""Retrieval by plain ``model.generate``: the passkey and needle samples of :mod:`.needle`, answered greedily with
the cache the model's own ``generate`` picks (a K/V cache for softmax and ``p = 3``; the constant-size state of a
``p = 1`` model, with its softmax window's last keys: :mod:`hf_knorm.recurrent`).

Where :mod:`.needle` measures KNorm's compression (the context prefilled once, compressed copies), this measures a
model as it is: what a converted model retrieves from beyond its softmax window (the needle sits at the given depth of
a 1k-4k-token context, the question after it). A cell is correct when the first number of the answer is the needle's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..compat import output_cache
from ..eviction.pipeline import encode_prompt
from .needle import haystack, is_correct, make_sample

RETRIEVAL_DEPTHS = (0.0, 0.25, 0.5, 0.75)
"""Where the needle sits in the context: never at its end (depth 1 puts it a few tokens before the question, inside a
softmax window of 64)."""


@torch.no_grad()
def answer(model, tokenizer, sample: dict, max_new_tokens: int = 10, generate=None) -> tuple[str, str]:
    """``(the greedy answer, the class name of the cache generate decoded with)`` of one sample; ``generate(ids)``,
    where given, answers instead of the model's own ``generate`` (e.g. under a ``KNormCache``) and returns the
    ``(1, n + new)`` sequences (the cache reported as ``"custom"``)."""
    context_ids, question_ids = encode_prompt(tokenizer, sample["context"], sample["question"], sample["answer_prefix"])
    device = next(model.parameters()).device
    ids = torch.cat([context_ids, question_ids], dim=1).to(device)
    if generate is not None:
        sequences, cache = generate(ids), "custom"
    else:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id, return_dict_in_generate=True)
        sequences, cache = out.sequences, type(output_cache(out)).__name__
    return tokenizer.decode(sequences[0, ids.shape[1]:], skip_special_tokens=True).strip(), cache


def retrieval_records(model, tokenizer, tasks: Sequence[str] = ("passkey",), lengths: Sequence[int] = (1000, 2000),
                      depths: Sequence[float] = RETRIEVAL_DEPTHS, seeds: int = 2, desc: str = "retrieval",
                      generate=None) -> list[dict]:
    """Every cell of the grid tasks x lengths x depths x seeds answered by ``model``: ``task, length, depth, seed,
    expected, answer, cache, correct`` each. The samples depend on the tokenizer and the cell only, so two models with
    one tokenizer answer the same questions. ``generate``: as :func:`answer` takes it.

    Raises:
        ValueError: an unknown task, or a length the haystack cannot fill.
    """
    from tqdm.auto import tqdm

    records = []
    cells = [(task, length, depth, seed) for task in tasks for length in lengths for depth in depths
             for seed in range(seeds)]
    haystacks = {task: haystack(task, tokenizer) for task in tasks}
    for task, length, depth, seed in tqdm(cells, desc=desc):
        sample = make_sample(task, tokenizer, haystacks[task], length, depth, seed)
        text, cache = answer(model, tokenizer, sample, generate=generate)
        records.append(dict(task=task, length=length, depth=depth, seed=seed, expected=sample["expected"],
                            answer=text, cache=cache, correct=is_correct(text, sample["expected"])))
    return records


def hits_by_length(records: list[dict]) -> dict[str, dict[str, list[int]]]:
    """``{task: {length: [correct, cells]}}`` of :func:`retrieval_records` (lengths as strings: JSON keys)."""
    table: dict[str, dict[str, list[int]]] = {}
    for record in records:
        cell = table.setdefault(record["task"], {}).setdefault(str(record["length"]), [0, 0])
        cell[0] += bool(record["correct"])
        cell[1] += 1
    return table
