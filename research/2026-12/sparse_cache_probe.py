"""Does a sparse global cache beside the softmax window keep a passkey, untrained? (issue 47, a first probe)

The default model patched with ``x/1 + softmax window 64 + sinks 4 [+ sparse K (score)]`` and its distant part off
(``distant_part_off``: window mix 0), so softmax over the window, the sinks and the sparse cache is all it attends and
``generate`` decodes from ``W + S + K`` pairs (the bounded cache). Passkey, 4 depths x 2 seeds per length
(``hf_knorm.evaluation.retrieval``'s cells), 10 greedy tokens, exact match.

Part 1 (``--part scores``, 1000 tokens): the original, the window alone, ``sparse 64`` and ``sparse 256`` with
``key_norm`` and ``value_over_key``. Part 2 (``--part lengths``, 1000-4000 tokens): ``sparse 256 (value_over_key)``
against the original under a ``KNormCache`` holding the same 324 pairs per head (``kv_diff`` + 4 sinks + a 64-token
window, ``budget = decoding_budget = 324``; prefill attends the whole prompt there, not here). Written up in
docs/results/conversion.md, "A sparse cache beside the window".

Usage: ``OMP_NUM_THREADS=2 python research/2026-12/sparse_cache_probe.py --part scores``
       ``OMP_NUM_THREADS=2 python research/2026-12/sparse_cache_probe.py --part lengths --lengths 1000,2000,4000``
"""

from __future__ import annotations

import argparse

import torch

import hf_knorm
from hf_knorm.evaluation.needle import haystack, is_correct, make_sample
from hf_knorm.evaluation.retrieval import RETRIEVAL_DEPTHS
from hf_knorm.eviction.pipeline import encode_prompt, knorm_generate
from hf_knorm.models.window_mix import distant_part_off

WINDOW = "x/1 + softmax window 64 + sinks 4"


def hits(model, tokenizer, lengths, generate) -> dict[int, list[int]]:
    """``{length: [hits, cells]}`` of ``generate(ids) -> sequences`` over the passkey cells."""
    hay, table = haystack("passkey", tokenizer), {}
    for length in lengths:
        for depth in RETRIEVAL_DEPTHS:
            for seed in range(2):
                sample = make_sample("passkey", tokenizer, hay, length, depth, seed)
                context, question = encode_prompt(tokenizer, sample["context"], sample["question"],
                                                  sample["answer_prefix"])
                ids = torch.cat([context, question], dim=1)
                with torch.no_grad():
                    new = generate(ids)[0, ids.shape[1]:]
                correct = is_correct(tokenizer.decode(new, skip_special_tokens=True).strip(), sample["expected"])
                cell = table.setdefault(length, [0, 0])
                cell[0], cell[1] = cell[0] + correct, cell[1] + 1
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("scores", "lengths"), default="scores")
    parser.add_argument("--lengths", default="1000")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    model, tokenizer = hf_knorm.load_default_model()
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.eos_token_id)

    def plain(ids):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **options)

    def patched(spelling):
        hf_knorm.patch(model, spelling)
        try:
            with distant_part_off(model):
                return hits(model, tokenizer, lengths, plain)
        finally:
            hf_knorm.unpatch(model)

    if args.part == "scores":
        print("original", hits(model, tokenizer, lengths, plain), flush=True)
        for extra in ("", " + sparse 64 (key_norm)", " + sparse 64 (value_over_key)", " + sparse 256 (key_norm)",
                      " + sparse 256 (value_over_key)"):
            print(WINDOW + extra, patched(WINDOW + extra), flush=True)
    else:
        def knorm(ids):
            return knorm_generate(model, ids, attention_mask=torch.ones_like(ids), score="kv_diff", budget=324,
                                  decoding_budget=324, sink_tokens=4, recent_window=64, **options)

        print("KNormCache kv_diff + sinks 4 + window 64, 324 pairs", hits(model, tokenizer, lengths, knorm), flush=True)
        spelling = WINDOW + " + sparse 256 (value_over_key)"
        print(spelling, patched(spelling), flush=True)


if __name__ == "__main__":
    main()
