"""Prototype: an expected-attention eviction score (kvpress ``ExpectedAttentionPress``) on the needle harness.

Expected attention (Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution", arXiv 2510.00636; kvpress ``ExpectedAttentionPress``) needs no attention weights and no
question, but it needs the model's *queries*, which a KV cache never sees. This script measures whether the idea pays
off on the default model before anything is built into ``KNormCache`` for it:

- forward hooks on every layer's ``q_proj`` record, during the context's prefill, the mean ``mu`` and covariance
  ``S`` of the pre-RoPE queries per query head (the first ``--sinks`` tokens left out, as kvpress does);
- the score of a cached (post-RoPE) key ``k`` of KV head ``h`` is ``softmax_j(mu_r . k_j / sqrt(d) + k_j' S_r k_j /
  (2 d))`` averaged over the query heads of the group, times ``||v_j||``; ``mu_r = R mu`` and ``S_r = R S R'`` with
  ``R`` the RoPE rotation averaged over the next ``--future`` positions;
- rows: the score with and without the covariance and the value norm, with sinks + recent window, against
  ``key_norm`` and ``kv_diff`` on the same contexts (``hf_knorm.evaluation.needle.run_needle``, kvpress protocol).

Llama-style attention only (a ``q_proj`` and a ``rotary_emb`` on the base model), as kvpress. Result in
docs/results/knorm.md ("Eviction scores"; in full: docs/research/2026-12-knorm.md, "Expected attention"); it is not
part of the package because it did not beat the query-free scores.

Usage: ``OMP_NUM_THREADS=1 python research/2026-12/knorm_expected_attention.py --task niah --lengths 1000,2000``
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from transformers import DynamicCache

import hf_knorm
from hf_knorm.evaluation.needle import Variant, run_needle, summary_table
from hf_knorm.models.architectures import attention_modules


class QueryStatistics:
    """Per layer, mean (B, H, D) and covariance (B, H, D, D) of the pre-RoPE queries of the last prefill."""

    def __init__(self, model, sinks: int):
        modules = [module for _, module in attention_modules(model)]
        if not all(hasattr(module, "q_proj") for module in modules) or not hasattr(model.model, "rotary_emb"):
            raise ValueError("This prototype needs Llama-style attention (q_proj, model.model.rotary_emb).")
        self.rotary, self.sinks, self.recording = model.model.rotary_emb, sinks, False
        self.heads, self.head_dim = model.config.num_attention_heads, modules[0].head_dim
        self.mean: dict[int, torch.Tensor] = {}
        self.covariance: dict[int, torch.Tensor] = {}
        for index, module in enumerate(modules):
            module.q_proj.register_forward_hook(self._recorder(index))
        # record on the context's prefill only: a fresh DynamicCache (the question and the decoding steps run on
        # the compressed cache, after the scores were taken)
        model.register_forward_pre_hook(self._arm, with_kwargs=True)

    def _arm(self, module, args, kwargs):
        cache = kwargs.get("cache")
        self.recording = type(cache) is DynamicCache and cache.get_seq_length() == 0

    def _recorder(self, index: int):
        def hook(module, inputs, output):
            if not self.recording:
                return
            queries = output[:, self.sinks:].float()
            queries = queries.view(*queries.shape[:2], self.heads, self.head_dim)  # (B, S, H, D)
            mean = queries.mean(dim=1)
            centred = queries - mean[:, None]
            self.mean[index] = mean
            self.covariance[index] = torch.einsum("bshi,bshj->bhij", centred, centred) / queries.shape[1]

        return hook


@dataclass(frozen=True, eq=False)
class ExpectedAttention:
    """Expected attention of future queries times ``||v||`` (arXiv 2510.00636, kvpress ``ExpectedAttentionPress``)."""

    name: ClassVar[str] = "expected_attention"
    statistics: QueryStatistics
    future: int = 512
    covariance: bool = True
    value_norm: bool = True

    def __call__(self, keys, values, positions, layer_idx):
        stats, dim = self.statistics, keys.shape[-1]
        mean, covariance = stats.mean[layer_idx], stats.covariance[layer_idx]
        start = int(positions.max()) + 1
        cos, sin = stats.rotary(mean, torch.arange(start, start + self.future)[None])
        swap = torch.zeros(dim, dim)  # rotate_half as a matrix: (x1, x2) -> (-x2, x1)
        swap[dim // 2:, :dim // 2], swap[:dim // 2, dim // 2:] = torch.eye(dim // 2), -torch.eye(dim // 2)
        rotation = (cos[0].float()[:, :, None] * torch.eye(dim) + sin[0].float()[:, :, None] * swap).mean(0)
        group = stats.heads // keys.shape[1]
        expanded = keys.float().repeat_interleave(group, dim=1)  # (B, H, S, D)
        logits = torch.einsum("bhd,bhsd->bhs", mean @ rotation.T, expanded) / math.sqrt(dim)
        if self.covariance:
            rotated = rotation @ covariance @ rotation.T
            logits = logits + torch.einsum("bhsi,bhij,bhsj->bhs", expanded, rotated, expanded) / (2 * dim)
        importance = logits.softmax(-1).view(*keys.shape[:2], group, -1).mean(2)  # (B, H_kv, S)
        return importance * values.float().norm(dim=-1) if self.value_norm else importance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("niah", "passkey"), default="niah")
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--sinks", type=int, default=4, help="first tokens left out of the query statistics")
    parser.add_argument("--future", type=int, default=512, help="future positions the RoPE rotation is averaged over")
    parser.add_argument("--out", type=Path, default=Path("outputs/knorm_expected_attention"))
    args = parser.parse_args()
    model, tokenizer = hf_knorm.load_default_model()
    stats = QueryStatistics(model, args.sinks)
    score = ExpectedAttention(stats, future=args.future)

    def row(name: str, **options) -> Variant:
        return Variant(f"r={args.ratio:g} {name}", {"compression_ratio": args.ratio, **options})

    variants = [
        Variant("r=0", {}), row("key_norm"), row("kv_diff", score="kv_diff"),
        row("expected_attention", score=score),
        row("expected_attention, no covariance", score=ExpectedAttention(stats, args.future, covariance=False)),
        row("expected_attention, no value norm", score=ExpectedAttention(stats, args.future, value_norm=False)),
        row("expected_attention+sinks4+window64", score=score, sink_tokens=4, recent_window=64),
    ]
    records = run_needle(model, tokenizer, args.out / args.task, tasks=(args.task,), variants=variants,
                         lengths=[int(n) for n in args.lengths.split(",")], seeds=args.seeds)
    print(summary_table(records, args.task))


if __name__ == "__main__":
    main()
