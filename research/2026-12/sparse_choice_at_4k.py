"""Why the default conversion finds 0-2 of 8 passkeys at 4,000 tokens: the training, or the choice of pairs? (issue 47)

One converted run folder (``hf-knorm convert``'s output; the default ``x/1 + softmax window 64 + sinks 4 + sparse 256
(value_over_key)``, whose distant part solved to mix 0) is read back with its weights unchanged and answers the
passkey (or, ``--task niah``, needle) cells (``hf_knorm.evaluation.retrieval``: 4 depths x 2 seeds per length, 10
greedy tokens, exact match) with:

- ``all``: every pair kept, i.e. the model unpatched (plain softmax): with mix 0 and ``K >=`` every older key, the
  sparse cache computes exactly this, so it says what the trained weights can do at 4,000 tokens;
- ``value_over_key K``: the released score with ``K`` pairs (the config's spelling rewritten: ``sparse K``);
- ``causal_kv_diff K``: a candidate score that a bounded decoder could run (not built): the eviction's ``kv_diff``
  (:class:`hf_knorm.eviction.scores.KVDiff`: distinctiveness of the key and of the value against the head's mean
  direction, each standardized, summed, averaged over 5 centred tokens) with the mean direction and the
  standardization taken over the tokens up to each one (so each token's score is fixed two tokens after it is
  produced, long before it leaves a 64-token window). It replaces the per-token score of the prompt's forward only
  (``hf_knorm.attention.sparse``'s ``token_scores``, ``_chunked``, ``_attend``, overridden here:
  :func:`use_causal_kv_diff`); the question and the 10 decoded tokens never leave the window, so their score is never
  read (checked). One sequence per call (no padding), as the cells are.

Usage: ``OMP_NUM_THREADS=2 python research/2026-12/sparse_choice_at_4k.py --run runs/sparse_s0 \\
           --cells all,value_over_key:256,value_over_key:768,causal_kv_diff:256,causal_kv_diff:768 --lengths 4000``
(~2-3 min a cell at 4,000 tokens on 2 threads). Written up in docs/results/conversion.md, "Why 4,000 tokens fail".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

import hf_knorm
import hf_knorm.attention.sparse as sparse_attention
from hf_knorm.evaluation.retrieval import hits_by_length, retrieval_records
from hf_knorm.eviction.scores import pooled
from hf_knorm.models.patching import _configs
from hf_knorm.normalizations import parse_normalization

MAX_NEW_TOKENS = 10  # retrieval_records' answers


def causal_distinctiveness(states: torch.Tensor) -> torch.Tensor:
    """``-cos(x_j, a_j)``, ``a_j`` the mean of the unit vectors of tokens ``0..j``: (B, H, N, D) -> (B, H, N) fp32."""
    unit = F.normalize(states.float(), dim=-1)
    count = torch.arange(1, states.shape[2] + 1, device=states.device)[None, None, :, None]
    return -F.cosine_similarity(states.float(), unit.cumsum(dim=2) / count, dim=-1)


def causal_standardized(x: torch.Tensor) -> torch.Tensor:
    """``(x_j - mean_{i<=j} x_i) / std_{i<=j} x_i`` along the last dimension."""
    count = torch.arange(1, x.shape[-1] + 1, device=x.device)
    mean = x.cumsum(-1) / count
    variance = (x * x).cumsum(-1) / count - mean * mean
    return (x - mean) / variance.clamp_min(1e-12).sqrt()


def causal_kv_diff(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The prefix-causal ``kv_diff`` of the module docstring: (B, H_kv, N, D) x 2 -> (B, H_kv, N)."""
    of_keys, of_values = causal_distinctiveness(keys), causal_distinctiveness(values)
    return pooled(causal_standardized(of_keys) + causal_standardized(of_values), 5)


def use_causal_kv_diff(window: int):
    """Override the sparse cache's per-token score while ``generate`` runs the bounded cache; returns what to restore.

    The released score is computed on each call's keys: in the prompt's chunks
    (:func:`hf_knorm.attention.sparse._chunked`: each chunk's keys with the window's before them) and, after it, on
    the window's kept pairs with each new call's (the question, then each decoded token); the window's oldest pairs
    leave it during those calls, and their score is read then. Right for a per-token score only. Here every score is
    looked up by the pair's absolute position in the score of the whole context (its prefix for every token),
    computed once per layer when the context runs in chunks. The pairs after the context (the question and the
    decoded tokens) get 0: fewer than ``window`` with the answer, they never leave the window (checked)."""
    released = sparse_attention.token_scores, sparse_attention._chunked, sparse_attention._attend
    by_layer, call = {}, {}  # layer -> (B, H_kv, N) scores of the context; the running call's layer and positions

    def chunked(query, key, value, key_valid, normalization, options, handover=None):
        if handover is None:
            raise RuntimeError("the prototype runs only under the bounded cache (generate)")
        before = handover.cumulative_length - key.shape[2]
        if before:
            raise RuntimeError("a second chunked call on one layer: the prototype scores one context per layer")
        by_layer[handover.layer_idx] = causal_kv_diff(key, value)
        call["layer"] = handover.layer_idx
        try:
            return released[1](query, key, value, key_valid, normalization, options, handover)
        finally:
            call.pop("layer")

    def attend(query, key, value, key_valid, source, normalization, handover, **options):
        layer = call.get("layer", getattr(handover, "layer_idx", None))
        if layer not in by_layer:
            raise RuntimeError("a call before its layer's context ran in chunks")
        first = handover.cumulative_length - key.shape[2]
        call.update(scored=layer, positions=torch.arange(first, first + key.shape[2]))
        try:
            return released[2](query, key, value, key_valid, source, normalization, handover, **options)
        finally:
            call.pop("scored"), call.pop("positions")

    def score(name, keys, values):
        context = by_layer[call["scored"]]
        positions = call["positions"]
        after = positions >= context.shape[-1]
        if after.any() and int(positions[-1]) - context.shape[-1] + 1 + MAX_NEW_TOKENS >= window:
            raise RuntimeError("pairs after the context would leave the window before the answer ends")
        out = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
        out[:, :, ~after] = context[:, :, positions[~after]]
        return out

    sparse_attention.token_scores, sparse_attention._chunked, sparse_attention._attend = score, chunked, attend
    return released


def respell(model, sparse: int) -> str:
    """Give every config of ``model`` the same normalization with ``sparse`` pairs; returns the new spelling."""
    old = parse_normalization(hf_knorm.patched_normalization(model))
    spelling = old.name.replace(f"sparse {old.sparse} ", f"sparse {sparse} ")
    parse_normalization(spelling)  # a typo here fails before any cell runs
    for config in _configs(model):
        section = dict(config.hf_knorm)
        section["normalization"] = spelling
        section.pop("normalization_record", None)
        config.hf_knorm = section
    return spelling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="an hf-knorm convert output folder")
    parser.add_argument("--cells", default="all,value_over_key:256,value_over_key:768,causal_kv_diff:256")
    parser.add_argument("--lengths", default="4000")
    parser.add_argument("--task", default="passkey", choices=("passkey", "niah"))
    parser.add_argument("--out", default=None, help="a JSON file for the records (default: print only)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.run)
    results = {}
    for cell in args.cells.split(","):
        model = hf_knorm.from_pretrained(args.run).eval()
        window = parse_normalization(hf_knorm.patched_normalization(model)).window
        if MAX_NEW_TOKENS >= window:
            raise SystemExit(f"decoded tokens would leave the {window}-token window: their score would be read")
        released = None  # (token_scores, _chunked, _attend) to restore
        if cell == "all":
            hf_knorm.unpatch(model)
            label = "every pair kept (unpatched)"
        else:
            score, sparse = cell.split(":")
            label = f"{respell(model, int(sparse))}" + (" with causal_kv_diff" if score == "causal_kv_diff" else "")
            if score == "causal_kv_diff":
                released = use_causal_kv_diff(window)
            elif score != "value_over_key":
                raise SystemExit(f"unknown score {score!r}")
        try:
            records = retrieval_records(model, tokenizer, (args.task,), lengths, desc=cell)
        finally:
            if released is not None:
                sparse_attention.token_scores, sparse_attention._chunked, sparse_attention._attend = released
        results[cell] = {"label": label, "hits": hits_by_length(records)[args.task],
                         "answers": [record["answer"] for record in records]}
        print(f"| {label} | " + " | ".join(f"{hit}/{total}" for hit, total in results[cell]["hits"].values()) + " |",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
