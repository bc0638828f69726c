"""The main job of ``make demo``: the default model under each normalization, side by side.

For each normalization the model is patched (then unpatched), and we report its greedy next tokens on a few prompts
and its perplexity on :data:`hf_knorm.assets.texts.SAMPLE_TEXT` (teacher forcing, one forward pass). A pretrained model was
trained with softmax, so the polynomial normalizations are expected to degrade it sharply until it is fine-tuned:
the demo shows by how much, and that softmax through the plugin reproduces the model exactly.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from .assets.texts import SAMPLE_TEXT
from .attention.normalizations import parse_normalization
from .models.patching import patch, unpatch
from .models.persistence import load_model

PROMPTS = ("The capital of France is", "Water freezes at a temperature of", "The opposite of hot is")


def evaluate_normalization(model, tokenizer, normalization: str | None, new_tokens: int = 4) -> dict:
    """Greedy continuations of :data:`PROMPTS` and perplexity on the sample text; ``None`` = the model's own attention."""
    if normalization is not None:
        patch(model, normalization)
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


def run_demo(model_name: str, normalizations: list[str], out_dir: Path) -> list[dict]:
    """Evaluate the model natively and under each normalization; print a table and write ``demo.json``."""
    normalizations = [parse_normalization(name).name for name in normalizations]  # bad spellings fail before loading
    model, tokenizer = load_model(model_name)
    print(f"Model: {model_name} ({model.config.model_type}, {model.config.num_hidden_layers} layers). "
          f"Perplexity on a {len(tokenizer(SAMPLE_TEXT)['input_ids'])}-token sample text; greedy continuations.")
    rows = [evaluate_normalization(model, tokenizer, None)]
    rows += [evaluate_normalization(model, tokenizer, name) for name in normalizations]
    width = max(len(row["normalization"]) for row in rows)
    print(f"\n{'normalization':<{width}}  {'perplexity':>12}  " + "  |  ".join(f"{p!r}" for p in PROMPTS))
    for row in rows:
        cells = "  |  ".join(repr(c) for c in row["continuations"])
        print(f"{row['normalization']:<{width}}  {row['perplexity']:>12.4g}  {cells}")
    print("\nThe model was trained with softmax: softmax through the plugin reproduces it; the polynomial normalizations "
          "change its function and need fine-tuning before their text means anything.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.json").write_text(json.dumps({"model": model_name, "prompts": PROMPTS, "rows": rows}, indent=2))
    print(f"\nWrote {out_dir / 'demo.json'}")
    return rows
