"""Text sampled from the original model itself: the part of the training mixture that is the teacher's distribution.

Distillation matches the student's next-token distribution to the teacher's on some text. On one author's essays the
student learns that author; on the teacher's own samples it learns what the teacher does on the prompts it is used
with. The samples come from a fixed list of diverse prompts (:data:`OPENINGS`: plain-text openings of many kinds of
prose; :data:`INSTRUCTIONS`: requests asked through the chat template, as an instruct model is used), sampled at
temperature 1 with nucleus ``top_p`` 0.95 (the teacher's distribution without its far tail, where a 135M model
rambles), up to ``NEW_TOKENS_PER_SAMPLE`` new tokens a sample (a sample ends at the end-of-text token, kept), the
prompts cycled (plain and chat alternating) until ``tokens`` new tokens are drawn. The nucleus is found by
:class:`.nucleus.NucleusFilter` (Transformers' ``TopPLogitsWarper``'s tokens, without sorting the vocabulary at every
step: the same tokens, the default model's draw 1.21x faster on 2 CPU threads, 1.40x on one;
``scripts/conversion/bench_teacher_samples.py``).

Generated once per model and settings, then cached under ``cache_dir()/teacher_text`` (``$HF_KNORM_CACHE``) with
what it cost (``*.json``: seconds, tokens, tokens per second); a conversion reads the cache when it is there.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from .nucleus import CANDIDATES, NucleusFilter

OPENINGS = (
    "The history of the printing press begins", "In the spring of 1848, the city of Vienna", "Photosynthesis is the",
    "To make a good loaf of bread, you", "The stock market fell sharply on Tuesday after", "Dear Sarah,\n\nThank you",
    "Chapter 1\n\nThe rain had not stopped for three days when", "A function in Python is defined with",
    "The human heart has four chambers:", "Once upon a time, in a small village by the sea,",
    "The mitochondria are often called", "Climate change affects farmers in several ways.",
    "The rules of chess are simple to learn:", "Our hotel was a ten-minute walk from the old town, and",
    "In mathematics, a prime number is", "The committee met on Friday to discuss the budget.",
    "Installing the software takes three steps. First,", "The Roman Empire reached its greatest extent under",
    "\"Where have you been?\" she asked.", "Volcanoes form when", "The best way to learn a new language is",
    "This recipe serves four people. Ingredients:", "The team scored twice in the second half,",
    "Electric cars have become popular because", "In 1969, astronauts", "The museum's new exhibition",
    "How to change a flat tire:", "The theory of evolution by natural selection", "My grandmother always said that",
    "The company announced its quarterly earnings,", "Sleep is important for health because",
    "The old man looked at the sea and", "A database index speeds up queries by",
    "The French Revolution began in 1789 when", "Birds migrate south in the winter because",
    "The interview started with a simple question:", "To be a good teacher, one must",
    "The city council voted yesterday to", "Jupiter is the largest planet",
    "The detective examined the room carefully.",
    "Music has been part of every human culture", "The recipe calls for two cups of flour,",
    "Renewable energy sources include", "The first step in writing an essay is", "The train was late again, so",
    "Vaccines work by", "In the year 2050, cities will", "The history of the internet",
)
"""Plain-text openings: essays, news, fiction, letters, science, instructions, history, dialogue."""

INSTRUCTIONS = (
    "Explain how a rainbow forms.", "Write a short poem about autumn.", "What are the benefits of regular exercise?",
    "Give me three tips for saving money.", "Summarize the plot of Romeo and Juliet.", "How does a computer work?",
    "Write a short story about a lost dog.", "What is the difference between weather and climate?",
    "Explain what a black hole is to a child.", "How do I make a cup of tea?", "Describe the water cycle.",
    "What is machine learning?", "Write a thank-you note to a friend.", "Why is the sky blue?",
    "List some healthy breakfast ideas.", "What causes earthquakes?", "How can I improve my writing?",
    "Explain the rules of soccer.", "What was the Industrial Revolution?", "Write a dialogue between two friends.",
    "How do vaccines work?", "What is photosynthesis?", "Give advice to a student starting university.",
    "Describe a busy market in the morning.", "What is the capital of Australia, and what is it known for?",
    "Explain how to write a for loop in Python.", "What are the planets in our solar system?",
    "Write a product description for a water bottle.", "How do bees make honey?", "What is democracy?",
    "Tell me about the history of the bicycle.", "How do I stay focused while studying?",
)
"""Requests asked through the chat template."""

TOP_P = 0.95
NEW_TOKENS_PER_SAMPLE = 256
BATCH_SIZE = 32
SAMPLER = f"nucleus filter among the {CANDIDATES:,} largest"
"""How the nucleus is found, recorded with a draw's cost: a rate is announced only from draws by the same sampler."""


def teacher_samples(model, tokenizer, tokens: int, model_dir: Path, seed: int = 0, progress: bool = True) -> list[str]:
    """Sampled texts of ``model`` (the original, softmax model) totalling about ``tokens`` new tokens, cached.

    Args:
        model: the original model (not patched); sampling runs on its device.
        tokenizer: its tokenizer, with a chat template (the instructions need one).
        tokens: new tokens to sample in all (``NEW_TOKENS_PER_SAMPLE`` a sample).
        model_dir: the model's folder: part of the cache key, with the settings.
        seed: sampling seed.

    Returns:
        One text per sample: the prompt (plain, or rendered through the chat template) and its continuation.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("Teacher samples ask instructions through the chat template, and this tokenizer has no "
                         "chat template.")
    path = cache_path(model_dir, tokens, seed)
    if path.is_file():
        return [json.loads(line)["text"] for line in path.read_text().splitlines()]
    print(announcement(model, model_dir, tokens, path), flush=True)
    started = time.perf_counter()
    texts, drawn = _sample(model, tokenizer, tokens, seed, progress)
    cost = {"samples": len(texts), "new_tokens": drawn, "asked": tokens, "seconds": time.perf_counter() - started,
            "model_dir": str(model_dir), "seed": seed, "top_p": TOP_P, "batch_size": batch_size(tokens),
            "sampler": SAMPLER,
            "device": str(next(model.parameters()).device)}
    cost["tokens_per_second"] = drawn / cost["seconds"]
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # several processes may draw the same samples
    partial.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    os.replace(partial, path)
    meta = path.with_name(f"{path.stem}.{os.getpid()}.json.partial")
    meta.write_text(json.dumps(cost, indent=2) + "\n")
    os.replace(meta, path.with_suffix(".json"))
    return texts


def batch_size(tokens: int) -> int:
    """Samples generated together when drawing ``tokens``: up to :data:`BATCH_SIZE` (the rate of a draw depends on
    it: one sample at a time is several times slower per token than 32)."""
    return min(BATCH_SIZE, -(-tokens // NEW_TOKENS_PER_SAMPLE))


def announcement(model, model_dir: Path, tokens: int, path: Path) -> str:
    """What drawing ``tokens`` will cost, said before it starts: the samples, the device, and the time at the rate
    this model sampled at before on this machine (from the cached costs), only from draws at the same batch size on
    the same device by the same sampler: a rate measured otherwise says nothing of this draw, and then no time is
    announced."""
    device = next(model.parameters()).device
    size = batch_size(tokens)
    line = (f"Teacher samples: drawing {tokens:,} new tokens (up to {-(-tokens // NEW_TOKENS_PER_SAMPLE)} samples of "
            f"{NEW_TOKENS_PER_SAMPLE}, {size} at a time) from the original model on {device}, once; cached in "
            f"{path.parent}")
    rates = []
    for meta in path.parent.glob("*.json"):
        cost = json.loads(meta.read_text())
        if (cost.get("model_dir") == str(model_dir) and cost.get("tokens_per_second")
                and cost.get("batch_size") == size and cost.get("device") == str(device)
                and cost.get("sampler") == SAMPLER):
            rates.append(cost["tokens_per_second"])
    if rates:
        rate = statistics.median(rates)
        line += (f"; about {tokens / rate / 60:.1f} min at the {rate:.0f} tokens/s it sampled at before here, "
                 f"{size} at a time")
    return line + "."


def sampling_cost(model_dir: Path, tokens: int, seed: int = 0) -> dict | None:
    """What generating the cached samples cost (``new_tokens`` drawn, ``seconds``, ``tokens_per_second``), or
    ``None`` before they exist."""
    meta = cache_path(model_dir, tokens, seed).with_suffix(".json")
    return json.loads(meta.read_text()) if meta.is_file() else None


def cache_path(model_dir: Path, tokens: int, seed: int) -> Path:
    """Where the samples of this model and these settings are cached (the key hashes the model's config and
    weight files' sizes, the prompts and the sampling settings)."""
    model_dir = Path(model_dir)
    key = hashlib.sha256()
    config = model_dir / "config.json"
    key.update(config.read_bytes() if config.is_file() else str(model_dir.resolve()).encode())
    for weights in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        key.update(f"{weights.name}:{weights.stat().st_size}".encode())
    key.update(json.dumps([OPENINGS, INSTRUCTIONS, TOP_P, NEW_TOKENS_PER_SAMPLE, tokens, seed]).encode())
    folder = _cache_root()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{key.hexdigest()[:16]}.jsonl"


def _cache_root() -> Path:
    from ..assets.pypi import cache_dir

    return cache_dir() / "teacher_text"


@torch.no_grad()
def _sample(model, tokenizer, tokens: int, seed: int, progress: bool) -> tuple[list[str], int]:
    from tqdm.auto import tqdm

    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    texts = []
    try:
        bar = tqdm(total=tokens, desc="teacher samples", unit="tok", disable=not progress)
        drawn, index = 0, 0
        while drawn < tokens:
            size = batch_size(tokens - drawn)
            prompts = prompt_texts(tokenizer, index, size)
            index += size
            batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            output = generate_batch(model, batch, pad)
            for prompt, row in zip(prompts, output[:, batch["input_ids"].shape[1]:].tolist()):
                if drawn >= tokens:
                    break
                text, count = sample_text(tokenizer, prompt, row)
                texts.append(text)
                drawn += count
                bar.update(count)
        bar.close()
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return texts, drawn


def generate_batch(model, batch, pad: int, sort_vocabulary: bool = False) -> torch.Tensor:
    """One batch of samples, ``(B, prompt + new tokens)`` ids: ``generate`` at temperature 1 with nucleus
    :data:`TOP_P` (:class:`.nucleus.NucleusFilter`), up to :data:`NEW_TOKENS_PER_SAMPLE` new tokens, on the
    left-padded ``batch``. ``sort_vocabulary``: Transformers' ``TopPLogitsWarper`` instead, the reference the filter is
    tested and timed against (``scripts/conversion/bench_teacher_samples.py``)."""
    from transformers import LogitsProcessorList

    nucleus = (dict(top_p=TOP_P) if sort_vocabulary else
               dict(top_p=1.0, logits_processor=LogitsProcessorList([NucleusFilter(TOP_P, CANDIDATES)])))
    return model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=NEW_TOKENS_PER_SAMPLE,
                          pad_token_id=pad, **nucleus)


def sample_text(tokenizer, prompt: str, new_ids: list[int]) -> tuple[str, int]:
    """A sample's text (``prompt`` and its continuation) and its number of new tokens, from the ids ``generate`` gave
    after the prompt: the end-of-text token kept, what the generator padded after it dropped."""
    if tokenizer.eos_token_id in new_ids:
        new_ids = new_ids[:new_ids.index(tokenizer.eos_token_id) + 1]
    return prompt + tokenizer.decode(new_ids, skip_special_tokens=False), len(new_ids)


def prompt_texts(tokenizer, start: int, count: int) -> list[str]:
    """Prompts ``start`` to ``start + count - 1`` of the draw (:func:`_prompt`)."""
    return [_prompt(tokenizer, index) for index in range(start, start + count)]


def _prompt(tokenizer, index: int) -> str:
    """The ``index``-th prompt: plain openings and chat-rendered instructions alternate, each list cycled."""
    if index % 2 == 0:
        return OPENINGS[(index // 2) % len(OPENINGS)]
    request = INSTRUCTIONS[(index // 2) % len(INSTRUCTIONS)]
    return tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                         add_generation_prompt=True)
