"""A left-padded batch of prompts through ``KNormCache`` against one prompt at a time (issue 65: "a batch of 8 prompts
of different lengths at most 0.5x the time of eight single runs on 2 cores, same outputs").

Prompts: the default model's chat template around the first ``n`` tokens of Paul Graham essays (a different start per
prompt), ``n`` from ``--lengths`` (8 by default, all different). In interleaved rounds (the order alternates so a
drifting load hits both entries), the same greedy generation of ``--new`` tokens (``min_new_tokens`` too: no row
stops early) runs as:

- ``single``: ``hf_knorm.eviction.pipeline.knorm_generate`` on each prompt alone, one after the other (the baseline);
- ``batch``: ``knorm_generate`` once on the left-padded batch (:mod:`hf_knorm.eviction.rows`: each row keeps what it
  keeps alone; each prompt but its last token prefilled alone and stacked, ``prefill_rows``: no padding computed);
- ``questions single`` / ``questions batch``: the pipeline's protocol (``answer_questions``: the context compressed,
  the question appended), each context alone against the left-padded batch of contexts, whose rows are prefilled
  one at a time and stacked the same way before the questions and answers run as a batch.

Before timing, both run once with their logits and the outputs are compared: every row's tokens must equal its
single run's (the script stops otherwise) and the largest logit difference is printed. Medians over rounds; the batch
as a multiple of the single runs of the same run.

Usage: ``OMP_NUM_THREADS=2 python scripts/knorm/bench_batched_generate.py --rounds 3`` (needs a quiet machine: the
issue's target is on 2 cores); ``--score kvzip`` adds the reconstruction (row by row), ``--device cuda`` on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_knorm
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.eviction.pipeline import answer_questions, encode_prompt, knorm_cache_for, knorm_generate
from hf_knorm.eviction.rows import left_pad

ENTRIES = ("single", "batch", "questions single", "questions batch")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def parts_of(tokenizer, lengths: list[int], device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(context (n_i,), question (m,)) ids per length: the chat template around ``n_i`` essay tokens, each from its
    own start, and "Summarize it." (a prompt is the two together)."""
    body = tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]
    parts = []
    for index, n in enumerate(lengths):
        start = 997 * index % max(1, len(body) - n)
        context, question = encode_prompt(tokenizer, tokenizer.decode(body[start:start + n]), "Summarize it.")
        parts.append((context[0].to(device), question[0].to(device)))
    return parts


def _answers(model, tokenizer, parts, entry: str, options: dict, generate: dict) -> list[torch.Tensor]:
    """The ``questions`` entries: per context, (new,) the answer's ids."""
    if entry == "questions single":
        return [answer_questions(model, knorm_cache_for(model, **options), context[None], [question[None]],
                                 **generate)[0][0] for context, question in parts]
    context_ids, context_mask = left_pad([context for context, _ in parts], tokenizer.pad_token_id)
    question_ids, question_mask = left_pad([question for _, question in parts], tokenizer.pad_token_id)
    answers = answer_questions(model, knorm_cache_for(model, **options), context_ids, [question_ids],
                               context_mask=context_mask, question_masks=[question_mask], **generate)[0]
    return list(answers)


@torch.no_grad()
def run_entry(model, tokenizer, parts, entry: str, options: dict, generate: dict) -> None:
    """One ``entry`` (module docstring), outputs dropped: what is timed."""
    if entry.startswith("questions"):
        _answers(model, tokenizer, parts, entry, options, generate)
        return
    prompts = [torch.cat([context, question]) for context, question in parts]
    if entry == "single":
        for ids in prompts:
            knorm_generate(model, ids[None], tokenizer=tokenizer, **options, **generate)
    else:
        knorm_generate(model, *left_pad(prompts, tokenizer.pad_token_id), tokenizer=tokenizer, **options, **generate)


@torch.no_grad()
def outputs_of(model, tokenizer, prompts, entry: str, options: dict, generate: dict) -> list:
    """One ``entry``'s outputs: per prompt, (tokens (new,), logits (new, vocab))."""
    generate = {**generate, "output_logits": True, "return_dict_in_generate": True}
    logits = lambda out, row: torch.stack([step[row] for step in out.logits])  # noqa: E731
    if entry == "single":
        outs = [knorm_generate(model, ids[None], tokenizer=tokenizer, **options, **generate) for ids in prompts]
        return [(out.sequences[0, ids.numel():], logits(out, 0)) for out, ids in zip(outs, prompts)]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    out = knorm_generate(model, ids, mask, tokenizer=tokenizer, **options, **generate)
    return [(out.sequences[row, ids.shape[1]:], logits(out, row)) for row in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="250,400,550,700,850,1000,1150,1300",
                        help="essay tokens per prompt (one prompt each)")
    parser.add_argument("--new", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--score", default="kv_diff")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    model, tokenizer = hf_knorm.load_default_model(dtype=getattr(torch, args.dtype))
    model.to(args.device)
    lengths = [int(x) for x in args.lengths.split(",")]
    parts = parts_of(tokenizer, lengths, args.device)
    prompts = [torch.cat([context, question]) for context, question in parts]
    options = dict(compression_ratio=args.ratio, score=args.score)
    generate = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id)
    checked = {entry: outputs_of(model, tokenizer, prompts, entry, options, generate)
               for entry in ENTRIES[:2]}  # also the warm-up
    worst = 0.0
    for row, ((single, single_logits), (batch, batch_logits)) in enumerate(zip(checked["single"], checked["batch"])):
        if not torch.equal(single, batch):
            raise SystemExit(f"prompt {row} ({prompts[row].numel()} tokens): the batch generated other tokens than "
                             "the single run")
        worst = max(worst, (single_logits - batch_logits).abs().max().item())
    alone, stacked = (_answers(model, tokenizer, parts, entry, options, generate) for entry in ENTRIES[2:])
    for row, (single, batch) in enumerate(zip(alone, stacked)):
        if not torch.equal(single, batch):
            raise SystemExit(f"context {row} ({parts[row][0].numel()} tokens): the batch of contexts answered other "
                             "tokens than the context alone")
    print(f"device {args.device}, {args.dtype}, torch threads {torch.get_num_threads()}; SmolLM2-135M-Instruct; "
          f"{len(prompts)} prompts of {min(p.numel() for p in prompts)}-{max(p.numel() for p in prompts)} tokens; "
          f"score={args.score}, r={args.ratio:g}; {args.new} new tokens each; median of {args.rounds} interleaved "
          f"rounds\nsame tokens in every row (both protocols); largest logit difference batch vs single (generate) "
          f"{worst:.2e}\n")
    times = {entry: [] for entry in ENTRIES}
    for round_ in range(args.rounds):
        for entry in ENTRIES if round_ % 2 == 0 else ENTRIES[::-1]:
            _sync(args.device)
            began = time.perf_counter()
            run_entry(model, tokenizer, parts, entry, options, generate)
            _sync(args.device)
            times[entry].append(time.perf_counter() - began)
    medians = {entry: statistics.median(values) for entry, values in times.items()}
    print("| entry | seconds | x its single runs |")
    print("|---|---:|---:|")
    for entry in ENTRIES:
        baseline = "questions single" if entry.startswith("questions") else "single"
        print(f"| {entry} | {medians[entry]:.3f} | {medians[entry] / medians[baseline]:.2f} |")


if __name__ == "__main__":
    main()
