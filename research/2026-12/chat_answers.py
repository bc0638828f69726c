"""Greedy answers of several models to held-out chatterbot questions, beside the corpus's own answers.

The questions are the first user turns of the conversations ``hf-knorm finetune --dataset chatterbot`` holds out
(every tenth: 9, 19, 29, ...; ``hf_knorm.data.heldout.split_held_out``), rendered with each model's chat template
and its generation prompt; each model answers greedily (``--max-new-tokens``). Prints a markdown table.

Usage:
    python research/2026-12/chat_answers.py --models default,outputs/chat-finetune,outputs/chat-convert --questions 8
"""

from __future__ import annotations

import argparse

import torch
import transformers

import hf_knorm
from hf_knorm.assets.texts import chatterbot_chats


def load(name: str):
    """``(model, tokenizer)``: ``default`` (the embedded SmolLM2-135M-Instruct) or a run folder of hf_knorm."""
    if name == "default":
        return hf_knorm.load_default_model()
    return hf_knorm.from_pretrained(name), transformers.AutoTokenizer.from_pretrained(name)


@torch.no_grad()
def answer(model, tokenizer, question: str, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return " ".join(tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True).split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="default", help="comma-separated: default and/or run folders")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    held_out = [chat for index, chat in enumerate(chatterbot_chats()) if index % 10 == 9][:args.questions]
    names = args.models.split(",")
    answers = {}
    for name in names:
        model, tokenizer = load(name)
        model.eval()
        answers[name] = [answer(model, tokenizer, chat[0]["content"], args.max_new_tokens) for chat in held_out]
    print("| question | corpus answer | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for index, chat in enumerate(held_out):
        cells = [chat[0]["content"], chat[1]["content"]] + [answers[name][index] for name in names]
        print("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")


if __name__ == "__main__":
    main()
