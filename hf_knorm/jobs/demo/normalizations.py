"""Demo step 1: the default model under each normalization, side by side.

For each normalization the model is patched (then unpatched), and we report its greedy next tokens on a few prompts
and its perplexity on :data:`hf_knorm.assets.texts.SAMPLE_TEXT` (teacher forcing, one forward pass). A pretrained model was
trained with softmax, so the polynomial normalizations are expected to degrade it sharply until it is fine-tuned:
the demo shows by how much, and that softmax through the plugin reproduces the model exactly.
"""

from __future__ import annotations

import math
import time

import torch

from ...assets.texts import SAMPLE_TEXT
from ...models.patching import patch, unpatch
from ...normalizations import parse_normalization

PROMPTS = ("The capital of France is", "Water freezes at a temperature of", "The opposite of hot is")


def evaluate_normalization(model, tokenizer, normalization: str | None, new_tokens: int = 4,
                           cluster_tokens: int | None = None) -> dict:
    """Greedy continuations of :data:`PROMPTS` and perplexity on the sample text; ``None`` = the model's own attention.
    A normalization with clusters gets its codebooks fitted on the patched model's keys, as a conversion fits them
    (on ``cluster_tokens`` tokens; ``None``: the conversion's default)."""
    if normalization is not None:
        patch(model, normalization)
        clusters = parse_normalization(normalization).clusters
        if clusters:
            from ...conversion.clusters import add_clusters

            add_clusters(model, tokenizer, clusters, tokens=cluster_tokens)
    try:
        started = time.perf_counter()
        with torch.no_grad():
            batch = tokenizer(SAMPLE_TEXT, return_tensors="pt")
            loss = model(**batch, labels=batch["input_ids"]).loss.item()
            continuations = []
            for prompt in PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt")
                out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
                continuations.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    finally:
        if normalization is not None:
            unpatch(model)
    return {
        "normalization": normalization or "native (sdpa)",
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "loss": loss,
        "continuations": continuations,
        "seconds": round(time.perf_counter() - started, 2),
    }


def compare_normalizations(model, tokenizer, normalizations: list[str], new_tokens: int = 4) -> list[dict]:
    """The model natively, then under each normalization (patched, evaluated, unpatched); one row each."""
    rows = [evaluate_normalization(model, tokenizer, None, new_tokens)]
    rows += [evaluate_normalization(model, tokenizer, name, new_tokens) for name in normalizations]
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table: normalization, perplexity, one greedy continuation per prompt."""
    width = max(len(row["normalization"]) for row in rows)
    lines = [f"{'normalization':<{width}}  {'perplexity':>12}  " + "  |  ".join(f"{p!r}" for p in PROMPTS)]
    for row in rows:
        cells = "  |  ".join(repr(c) for c in row["continuations"])
        lines.append(f"{row['normalization']:<{width}}  {row['perplexity']:>12.4g}  {cells}")
    return "\n".join(lines)
