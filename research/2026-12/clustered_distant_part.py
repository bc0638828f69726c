"""Can a bounded distant part weighted by softmax jointly with the window earn 10% beyond the window? (issue 47)

Issue 47 asks the part beside the window to lower perplexity beyond the window by 10% against the window-only
ablation of the same model. ``x/1`` (its own row-normalized branch, a mix solved in closed form) never earned more
than ~1%, and 0.0% under the default sparse cache (docs/results/conversion.md). This prototype tries a distant part
that is **weighted by softmax together with the window, the sinks and the sparse cache**, untrained, on a converted
run's weights unchanged: the older keys that are in neither (the keys ``x/1`` would get) are summarized, per layer
and KV head, by ``C`` pseudo-pairs, one per cluster of a fixed codebook (spherical k-means on calibration keys),
each the mean key ``k_c`` and mean value ``v_c`` of the distant keys assigned to it, with the logit
``q . k_c * scaling + log n_c`` (Jensen's lower bound of ``log sum_j exp(q . k_j * scaling)`` over the cluster);
``+b`` after a mode adds ``b`` to every pseudo-pair's logit (Jensen's bound is low by the spread of the cluster's
scores). Memory: ``C`` pairs plus ``C`` counts per KV head, whatever the length; the codebook is a fixed ``C x D``.

Computed here without building the pseudo-keys: a pseudo-pair's logit is the mean of its pairs' exact scores (the
same number: the score is linear in the key) and its value a weight ``p_c / n_c`` on each of its pairs. Commit
b9f9340 of this script built them (``(q, C, D)`` tensors per head: slower, not timed alone) and had ``mean_var`` /
``kmeans_var:C``, the Gaussian correction ``+ scaling^2 / 2 * sum_d q_d^2 Var_c[k_d]`` (it overshoots: 3.7x the
original beyond the window on seed 0).

Modes (``--modes``): ``off`` (the window-only ablation: nothing beyond window, sinks and sparse cache; must
reproduce the library's figures), ``exact`` (every distant key weighted by softmax: the ceiling, the unpatched model),
``mean`` (one pseudo-pair, no codebook), ``kmeans:C``, each optionally ``+b`` (``kmeans:64+2``).

A plain dense implementation (``O(N^2)`` masks; the sparse cache's pairs from the library's
``call_scores``/``exit_positions``), one unpadded sequence per row, bottom-right causal: for the full forward of
the perplexity beyond the window only (retrieval through ``generate`` is not measured with it).

Usage: ``OMP_NUM_THREADS=2 python research/2026-12/clustered_distant_part.py --run runs/first3_default_s0
           --modes off,exact,mean,kmeans:64 --out runs/kprobe/clustered_s0.json``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch
import transformers

import hf_knorm
from hf_knorm.attention.sparse import exit_positions
from hf_knorm.conversion.beyond_window import beyond_window_blocks, beyond_window_perplexities
from hf_knorm.data.text_data import encode_texts, embedded_records
from hf_knorm.normalizations import parse_normalization
from hf_knorm.normalizations.sparse_choice import call_scores

NAME = "hf_knorm_clustered_prototype"
STATE: dict = {"mode": "off", "clusters": 0, "bias": 0.0, "codebooks": {}, "record": None,
               "normalization": None}


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``(B, q, H_q, D)`` outputs of window + sinks + sparse cache + the distant part of ``STATE["mode"]``."""
    norm = STATE["normalization"]
    window, sinks, sparse = norm.window, norm.sinks, norm.sparse
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = dim ** -0.5 if scaling is None else scaling
    if STATE["record"] is not None:
        STATE["record"].setdefault(module.layer_idx, []).append(key.detach().float().reshape(batch, kv_heads, -1, dim))
    device = query.device
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    k_pos = torch.arange(kv_len, device=device)
    pair_scores, _ = call_scores(norm.score, key.detach(), value.detach(), None, window=window)
    eligible = (k_pos >= sinks).expand(batch, kv_heads, kv_len)
    exits = exit_positions(pair_scores, k_pos.expand(batch, kv_heads, kv_len).contiguous(), eligible, sparse)
    causal = k_pos[None, :] <= q_pos[:, None]  # (q, kv)
    older = k_pos[None, :] <= q_pos[:, None] - window
    edge = (q_pos - window)[None, None, :, None]
    in_sparse = older & eligible[:, :, None, :] & (edge < exits[:, :, None, :])  # (B, H_kv, q, kv)
    distant = older & eligible[:, :, None, :] & (exits[:, :, None, :] <= edge)
    exact = (causal & ~older) | (causal & (k_pos < sinks)[None, :]) | in_sparse
    if STATE["mode"] == "exact":
        exact = exact | distant
    k = key.float().repeat_interleave(groups, dim=1)
    v = value.float().repeat_interleave(groups, dim=1)
    scores = query.float() @ k.transpose(-1, -2) * scaling  # (B, H_q, q, kv)
    logits = torch.where(exact.repeat_interleave(groups, dim=1), scores, -math.inf)
    if STATE["mode"] in ("off", "exact"):
        return (torch.softmax(logits, dim=-1) @ v).to(query.dtype).transpose(1, 2).contiguous(), None
    # the pseudo-pairs: cluster c's logit q . mean_k_c * scaling + log n_c is the mean of the exact scores of its
    # distant pairs plus log n_c; its value mean_v_c, i.e. weight p_c / n_c on each of those pairs
    assign = _assignments(module.layer_idx, key.float())  # (B, H_kv, kv)
    onehot = torch.nn.functional.one_hot(assign, max(STATE["clusters"], 1)).float()  # (B, H_kv, kv, C)
    in_distant = distant.float()
    count = (in_distant @ onehot).repeat_interleave(groups, dim=1)  # (B, H_q, q, C)
    in_distant = in_distant.repeat_interleave(groups, dim=1)
    mean_score = (scores * in_distant) @ onehot.repeat_interleave(groups, dim=1) / count.clamp_min(1)
    pseudo = torch.where(count > 0, mean_score + count.clamp_min(1).log() + STATE["bias"], -math.inf)
    weights = torch.softmax(torch.cat([logits, pseudo], dim=-1), dim=-1)
    per_pair = (weights[..., kv_len:] / count.clamp_min(1)).gather(
        -1, assign.repeat_interleave(groups, dim=1)[:, :, None, :].expand(-1, -1, q_len, -1))  # (B, H_q, q, kv)
    out = (weights[..., :kv_len] + per_pair * in_distant) @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _assignments(layer: int, key: torch.Tensor) -> torch.Tensor:
    """``(B, H_kv, kv)`` each key's cluster: the codebook row of highest cosine (all 0 without a codebook)."""
    if not STATE["clusters"]:
        return torch.zeros(key.shape[:3], dtype=torch.long, device=key.device)
    codebook = STATE["codebooks"][layer].to(key.device)  # (H_kv, C, D), unit rows
    return torch.einsum("bhnd,hcd->bhnc", torch.nn.functional.normalize(key, dim=-1), codebook).argmax(-1)


def fit_codebooks(model, tokenizer, clusters: int, iterations: int = 20, seed: int = 0) -> dict:
    """Spherical k-means per layer and KV head on the keys of Paul Graham essays 0-3 (in the conversion's training
    mixture, not in the held-out domains), ``max(2048, 8 C)`` tokens in 1,024-token blocks:
    ``{layer: (H_kv, C, D)}``."""
    tokens = max(2048, 8 * clusters)
    ids = [token for text in encode_texts(tokenizer, embedded_records("paul-graham")["text"][:4]) for token in text]
    STATE["record"], STATE["mode"] = {}, "off"
    with torch.no_grad():
        for start in range(0, tokens, 1024):
            model(torch.tensor([ids[start:start + 1024]]))
    recorded, STATE["record"] = STATE["record"], None
    generator = torch.Generator().manual_seed(seed)
    codebooks = {}
    for layer, keys in recorded.items():
        keys = torch.nn.functional.normalize(torch.cat(keys, dim=2)[0], dim=-1)  # (H_kv, N, D)
        start = torch.randperm(keys.shape[1], generator=generator)[:clusters]
        centroids = keys[:, start]
        for _ in range(iterations):
            assign = torch.einsum("hnd,hcd->hnc", keys, centroids).argmax(-1)
            summed = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand_as(keys), keys)
            empty = summed.norm(dim=-1, keepdim=True) == 0
            centroids = torch.where(empty, centroids, torch.nn.functional.normalize(summed, dim=-1))
        codebooks[layer] = centroids
    return codebooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--modes", default="off,exact,mean,kmeans:16,kmeans:64")
    parser.add_argument("--score", default=None, help="the sparse cache's score (default: the run's)")
    parser.add_argument("--sparse", type=int, default=None, help="the sparse cache's K (default: the run's)")
    parser.add_argument("--domains", default=None, help="comma-separated held-out domains (default: the run's)")
    parser.add_argument("--block", type=int, default=None,
                        help="tokens per block (default: convert's 1,024); with --original, the original's figures")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per domain with --block")
    parser.add_argument("--original", default=None, help="with --block: a JSON of distant_room_at_4k.py")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.run)
    record = json.loads((Path(args.run) / "convert.json").read_text())
    domains = args.domains.split(",") if args.domains else record["settings"]["eval_domains"]
    if args.block:
        blocks = beyond_window_blocks(domains, tokenizer, args.block * args.blocks, args.block)
        original = json.loads(Path(args.original).read_text())["original"]
    else:
        blocks = beyond_window_blocks(domains, tokenizer, record["settings"]["eval_tokens"])
        original = {name: value["original_perplexity"] for name, value in record["beyond_window"]["domains"].items()}
    model = hf_knorm.from_pretrained(args.run).eval()
    STATE["normalization"] = parse_normalization(hf_knorm.patched_normalization(model))
    if args.score:
        STATE["normalization"] = dataclasses.replace(STATE["normalization"], score=args.score)
    if args.sparse is not None:
        STATE["normalization"] = dataclasses.replace(STATE["normalization"], sparse=args.sparse)
    print(STATE["normalization"].name, flush=True)
    hf_knorm.unpatch(model)
    transformers.AttentionInterface.register(NAME, attention)
    model.set_attn_implementation(NAME)
    results = {}
    for mode in args.modes.split(","):
        spec, _, bias = mode.partition("+")
        name, _, clusters = spec.partition(":")
        if name not in ("off", "exact", "mean", "kmeans") or (name == "kmeans") != bool(clusters):
            raise SystemExit(f"Unknown mode {mode!r}: off, exact, mean or kmeans:C, each optionally +b.")
        STATE["bias"] = float(bias or 0)
        STATE["clusters"] = int(clusters or 0)
        if STATE["clusters"] and STATE["codebooks"].get("size") != STATE["clusters"]:
            STATE["codebooks"] = {**fit_codebooks(model, tokenizer, STATE["clusters"]), "size": STATE["clusters"]}
        STATE["mode"] = name
        perplexity = beyond_window_perplexities(model, blocks, mode)
        ratios = {domain: value / original[domain]
                  for domain, value in perplexity.items()}
        results[mode] = {"perplexity": perplexity, "ratio_to_original": ratios}
        if "off" in results:
            results[mode]["gain_over_off"] = {domain: 1 - value / results["off"]["perplexity"][domain]
                                              for domain, value in perplexity.items()}
        line = " | ".join(f"{domain} {ratios[domain]:.3f}x" for domain in ratios)
        gains = results[mode].get("gain_over_off", {})
        line += "  gain " + " ".join(f"{gain:+.1%}" for gain in gains.values())
        print(f"{mode}: {line}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
