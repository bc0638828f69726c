"""Why a converted hybrid retrieves no passkey: how much of each head's distant attention lands on the passkey.

A converted ``x^p/c + softmax window 64 + sinks 4`` model (``hf-knorm convert``) can only read a passkey that sits
more than 64 tokens before the question through its polynomial part, ``m_h * u_i / RMS(u_i)`` with
``u_i = sum_{j older} s_ij^p v_j / c`` (hf_knorm.attention.window). This measures, at the query that must say the
passkey's first digit (the last token of the prompt ``retrieval.answer`` generates from), for every layer and head:

- the share of the attention weight on the passkey's digit tokens among the keys older than the window and not
  sinks (the keys the polynomial part reads): ``e^s`` for the original's softmax, ``|s|^p`` for ``x^p`` (the part's
  weights, signs dropped: an upper bound on how much of ``u`` the digits make), and ``max(s, 0)^p`` (``relu^p``:
  weights that grow with the score as ``e^s``'s do, outside the paper's family; ``research/2026-12/distant_part_ceiling.py``
  measures what they would add beyond the window);
- for a converted model, the same share under its own trained queries and keys, and the head's mix ``|m_h|``.

The score ``s_ij = q_i . k_j / sqrt(d)`` is recomputed from each attention module's projections and RoPE (Llama-style
attention only, as the default model). The samples are those of ``hf_knorm.evaluation.retrieval`` (the passkey grid:
lengths x depths x 2 seeds), so the figures sit beside the conversion's passkey hits.

    python research/2026-12/passkey_attention_share.py --converted runs/sinks4_s0 runs/x1_sinks4_s0 --out runs/share.json

Prints, per model and weighting, over the samples: the median of the best head's share (and where it is), and the
uniform share (digits / keys read) for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_knorm.normalizations import parse_normalization
from hf_knorm.evaluation.needle import haystack, make_sample
from hf_knorm.evaluation.retrieval import RETRIEVAL_DEPTHS
from hf_knorm.eviction.pipeline import encode_prompt
from hf_knorm.models.architectures import attention_modules
from hf_knorm.models.patching import patched_normalization
from hf_knorm.models.persistence import load_model

POWERS = (1, 3, 5, 9)
"""The powers ``|s|^p`` measured on the original's scores (the paper's ``p = 1, 3`` and two sharper ones)."""


class LastRowScores:
    """Per layer, the ``(H_q, N)`` scores of the last query of the last forward (hooks on the attention modules)."""

    def __init__(self, model):
        self.scores: dict[int, torch.Tensor] = {}
        self.modules = [module for _, module in attention_modules(model)]
        if not all(hasattr(module, name) for module in self.modules for name in ("q_proj", "k_proj", "scaling")):
            raise ValueError("This script recomputes Llama-style scores (q_proj, k_proj, scaling, RoPE).")
        for index, module in enumerate(self.modules):
            module.register_forward_pre_hook(self._hook(index), with_kwargs=True)

    def _hook(self, index: int):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            batch, length, _ = hidden.shape
            dim = module.head_dim
            query = module.q_proj(hidden[:, -1:]).view(batch, 1, -1, dim).transpose(1, 2)
            key = module.k_proj(hidden).view(batch, length, -1, dim).transpose(1, 2)
            query, _ = apply_rotary_pos_emb(query, query, cos[:, -1:], sin[:, -1:])
            _, key = apply_rotary_pos_emb(key, key, cos, sin)
            key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
            self.scores[index] = (query @ key.transpose(-1, -2))[0, :, 0] * module.scaling  # (H_q, N)

        return hook


def digit_positions(tokenizer, ids: torch.Tensor, context_length: int) -> torch.Tensor:
    """Positions of the context's tokens that hold a digit: the passkey's, twice (the filler and intro hold none)."""
    tokens = tokenizer.convert_ids_to_tokens(ids[0, :context_length].tolist())
    return torch.tensor([index for index, token in enumerate(tokens) if any(char.isdigit() for char in token)])


def shares(scores: torch.Tensor, read: torch.Tensor, digits: torch.Tensor, powers) -> dict[str, torch.Tensor]:
    """``{weighting: (H_q,) share of the weight on the digits among the keys read}`` for one layer's last-row scores
    ``(H_q, N)``: ``exp`` (softmax restricted to the keys read), ``x^p`` (``|s|^p``), ``relu^p`` (``max(s, 0)^p``)
    and softmax over every key."""
    on_digits = torch.zeros_like(read)
    on_digits[digits] = True
    out = {}
    logits = scores.double().masked_fill(~read, float("-inf"))
    out["exp"] = (logits.softmax(-1) * on_digits).sum(-1)
    out["softmax, every key"] = (scores.double().softmax(-1) * on_digits).sum(-1)
    for power in powers:
        weight = scores.double().abs().pow(power) * read
        out[f"x^{power}"] = (weight * on_digits).sum(-1) / weight.sum(-1)
        rectified = scores.double().clamp_min(0).pow(power) * read
        out[f"relu^{power}"] = (rectified * on_digits).sum(-1) / rectified.sum(-1).clamp_min(1e-300)
    return out


@torch.no_grad()
def measure(path: str, lengths, seeds: int, window: int, sinks: int) -> dict:
    model, tokenizer = load_model(path)
    name = patched_normalization(model)
    normalization = None if name is None else parse_normalization(name)
    own = None if normalization is None else f"x^{normalization.without_window.power}"
    recorder = LastRowScores(model)
    filler = haystack("passkey", tokenizer)
    per_sample = []
    for length in lengths:
        for depth in RETRIEVAL_DEPTHS:
            for seed in range(seeds):
                sample = make_sample("passkey", tokenizer, filler, length, depth, seed)
                context, question = encode_prompt(tokenizer, sample["context"], sample["question"],
                                                  sample["answer_prefix"])
                ids = torch.cat([context, question], dim=1)
                logits = model(input_ids=ids).logits[0, -1]
                first_digit = tokenizer.convert_ids_to_tokens(int(logits.argmax()))
                count = ids.shape[1]
                read = torch.ones(count, dtype=torch.bool)
                read[:sinks] = False
                read[count - window:] = False
                digits = digit_positions(tokenizer, ids, context.shape[1])
                powers = POWERS if own is None else (normalization.without_window.power,)
                best = {}
                for layer, scores in recorder.scores.items():
                    for weighting, share in shares(scores, read, digits, powers).items():
                        head = int(share.argmax())
                        if weighting not in best or share[head] > best[weighting][0]:
                            best[weighting] = (float(share[head]), layer, head)
                mix = None
                if own is not None:
                    layer, head = best[own][1:]
                    module = recorder.modules[layer]
                    mixes = normalization.values_on(module).get("window_mix")
                    mix = None if mixes is None else float(mixes[head].abs())
                per_sample.append(dict(length=length, depth=depth, seed=seed, expected=sample["expected"],
                                       first_token=first_digit, digits=len(digits), read=int(read.sum()),
                                       best=best, mix_at_best=mix))
    return dict(model=path, normalization=None if normalization is None else normalization.name, own=own,
                samples=per_sample)


def summary(result: dict) -> list[str]:
    samples = result["samples"]
    uniform = statistics.median(sample["digits"] / sample["read"] for sample in samples)
    lines = [f"{result['model']} ({result['normalization'] or 'softmax'}): uniform share {uniform:.4f}"]
    for weighting in samples[0]["best"]:
        values = [sample["best"][weighting][0] for sample in samples]
        places = {tuple(sample["best"][weighting][1:]) for sample in samples}
        where = ", ".join(f"L{layer}H{head}" for layer, head in sorted(places)[:4])
        lines.append(f"  {weighting:>4}: best head's share median {statistics.median(values):.4f} "
                     f"[{min(values):.4f}-{max(values):.4f}] at {where}{' ...' if len(places) > 4 else ''}")
    mixes = [sample["mix_at_best"] for sample in samples if sample["mix_at_best"] is not None]
    if mixes:
        lines.append(f"  |m_h| at that head: median {statistics.median(mixes):.4f} [{min(mixes):.4f}-{max(mixes):.4f}]")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--converted", nargs="*", default=[], help="converted model folders (hf-knorm convert --out)")
    parser.add_argument("--lengths", default="1000,2000", help="passkey context lengths, comma-separated")
    parser.add_argument("--seeds", type=int, default=2, help="samples per length and depth (as convert: 2)")
    parser.add_argument("--window", type=int, default=64, help="the softmax window W the keys read are older than")
    parser.add_argument("--sinks", type=int, default=4, help="the attention sinks S, not read by the distant part")
    parser.add_argument("--out", type=Path, default=None, help="write every sample's figures as JSON here")
    args = parser.parse_args()
    lengths = [int(part) for part in args.lengths.split(",")]
    results = [measure(path, lengths, args.seeds, args.window, args.sinks) for path in ["default", *args.converted]]
    for result in results:
        print("\n".join(summary(result)))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
