"""A fixed probe of a causal LM's abilities: greedy answers to short factual cloze prompts and instructions.

Perplexity says how well a model predicts text; it does not say whether the model still knows that Paris is the
capital of France or still answers an instruction. The probe asks a converted model the same 40 questions as the
model it was converted from and counts how many of the original's answers it reproduces:

- 30 **cloze** prompts in plain text ("The capital of France is"), each with the expected word: the answer is the
  first word of the greedy continuation (lower case, punctuation stripped);
- 10 **instructions** through the tokenizer's chat template ("What is 2 + 2?"): the answer is the first three words of
  the greedy reply.

Two figures per model: ``agreement`` (share of the original model's answers reproduced exactly; 1.0 for the original
itself) and ``first_token_agreement`` (share of prompts whose first greedy token is the original's), plus
``cloze_accuracy`` (share of cloze prompts answered with the expected word: the original is not always right either).
Decoding is greedy, one prompt at a time (no padding), at most 8 new tokens: a minute or less on 2 CPU cores for the
default model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

CLOZE = (
    ("The capital of France is", "paris"),
    ("The capital of Japan is", "tokyo"),
    ("The capital of Italy is", "rome"),
    ("The capital of Germany is", "berlin"),
    ("The capital of Spain is", "madrid"),
    ("The largest planet in our solar system is", "jupiter"),
    ("The chemical symbol for gold is", "au"),
    ("Water is made of hydrogen and", "oxygen"),
    ("The opposite of hot is", "cold"),
    ("The sun rises in the", "east"),
    ("The first month of the year is", "january"),
    ("A week has seven", "days"),
    ("The color of the sky on a clear day is", "blue"),
    ("Two plus two equals", "four"),
    ("The author of Romeo and Juliet is William", "shakespeare"),
    ("The Eiffel Tower is in the city of", "paris"),
    ("The freezing point of water in degrees Celsius is", "0"),
    ("Bees make", "honey"),
    ("The currency of the United States is the", "dollar"),
    ("The tallest mountain in the world is Mount", "everest"),
    ("Cows drink water and give us", "milk"),
    ("The primary language spoken in Brazil is", "portuguese"),
    ("The planet known as the Red Planet is", "mars"),
    ("A baby cat is called a", "kitten"),
    ("The longest river in Africa is the", "nile"),
    ("Light travels faster than", "sound"),
    ("The Great Wall is in", "china"),
    ("The largest ocean on Earth is the", "pacific"),
    ("Python is a programming", "language"),
    ("The day after Monday is", "tuesday"),
)
"""``(prompt, expected first word)``: plain-text cloze prompts."""

INSTRUCTIONS = (
    "What is 2 + 2?",
    "Name a primary color.",
    "Translate 'thank you' into French.",
    "What is the capital of England?",
    "Give me a synonym for 'happy'.",
    "How many legs does a spider have?",
    "Write one sentence about the ocean.",
    "What do plants need to grow?",
    "Who wrote Hamlet?",
    "Say hello.",
)
"""Instructions, asked through the tokenizer's chat template."""

MAX_NEW_TOKENS = 8
INSTRUCTION_WORDS = 3


@dataclass(frozen=True)
class ProbeAnswer:
    """One prompt's greedy answer: the prompt, its kind (``cloze`` / ``instruction``), the decoded continuation,
    the normalized answer compared between models, and the first generated token id."""

    prompt: str
    kind: str
    text: str
    answer: str
    first_token: int


def normalize(text: str, words: int) -> str:
    """The first ``words`` words of ``text``, lower case, without punctuation (``" Paris." -> "paris"``)."""
    return " ".join(re.findall(r"[a-z0-9']+", text.lower())[:words])


@torch.no_grad()
def ask(model, tokenizer) -> list[ProbeAnswer]:
    """Greedy answers of ``model`` to every probe prompt (cloze first, then instructions).

    Raises:
        ValueError: the tokenizer has no chat template (the instructions need one).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The ability probe asks instructions through the chat template, and this tokenizer has no chat template.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    answers = []
    try:
        prompts = [(prompt, "cloze", tokenizer(prompt, return_tensors="pt").input_ids) for prompt, _ in CLOZE]
        prompts += [(prompt, "instruction", tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True,
        )["input_ids"]) for prompt in INSTRUCTIONS]
        for prompt, kind, ids in prompts:
            ids = ids.to(device)
            output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                    do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            new = output[0, ids.shape[1]:]
            text = tokenizer.decode(new, skip_special_tokens=True)
            words = 1 if kind == "cloze" else INSTRUCTION_WORDS
            answers.append(ProbeAnswer(prompt, kind, text, normalize(text, words), int(new[0]) if len(new) else -1))
    finally:
        model.train(was_training)
    return answers


def compare(answers: list[ProbeAnswer], reference: list[ProbeAnswer]) -> dict:
    """How many of ``reference``'s answers (the original model's) ``answers`` reproduce.

    Returns:
        ``{"prompts", "agreement", "first_token_agreement", "cloze_accuracy", "original_cloze_accuracy",
        "answers": [...]}``; each answer
        ``{"prompt", "kind", "text", "reference", "same"}``.
    """
    if [a.prompt for a in answers] != [r.prompt for r in reference]:
        raise ValueError("The two probe runs asked different prompts: compare answers of the same probe.")
    expected = dict(CLOZE)
    same = [a.answer == r.answer for a, r in zip(answers, reference)]
    cloze = [a for a in answers if a.kind == "cloze"]
    return {
        "prompts": len(answers),
        "agreement": sum(same) / len(answers),
        "first_token_agreement": sum(a.first_token == r.first_token for a, r in zip(answers, reference)) / len(answers),
        "cloze_accuracy": sum(a.answer == expected[a.prompt] for a in cloze) / len(cloze),
        "original_cloze_accuracy": sum(r.answer == expected[r.prompt] for r in reference if r.kind == "cloze")
        / len(cloze),
        "answers": [{"prompt": a.prompt, "kind": a.kind, "text": a.text, "reference": r.text, "same": s}
                    for a, r, s in zip(answers, reference, same)],
    }
