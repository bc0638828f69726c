"""What a distant part beside a softmax window could add: the original's own attention, split at the window.

A converted ``x^p/c + softmax window 64 + sinks 4`` model computes, per head (hf_knorm.attention.window),

    o_i = softmax over the window and the sinks (renormalized)  +  m_h * u_i / RMS(u_i),   u_i = sum_older s_ij^p v_j

and the conversion measured its polynomial part close to decoration (BENCHMARKS.md: the hybrid 1.68x the original
beyond the window, its window alone 1.70x; the closed-form mix at median |m_h| 0.007). This asks why, on the original
model's own queries, keys and values, with no training in the way. The original's head output splits exactly as

    o_i = o_win,i + r_i,    r_i = alpha_i * (o_old,i - o_win,i)

with ``o_win`` softmax over the window and the sinks alone, ``o_old`` softmax over the older keys alone and
``alpha_i`` the softmax mass on the older keys: ``r`` is what a distant part must supply. A distant part needs a
**direction** (which older values) and a **size** (``alpha_i``, which varies by query). The candidates ``c_i``, each
a function of the same q, k, v, fall in three kinds:

- a fixed size, ``m_h * c_i`` with ``m_h`` per head fitted by least squares (the hybrid's own form):
  ``x^p / RMS`` is the hybrid's part ``u / RMS(u)`` (``p = 1, 3`` the paper's, ``p = 2`` positive weights);
  ``mean / RMS`` the plain mean of the older values; ``relu(x)^p / RMS`` the weights ``max(s, 0)^p``;
- LoLCATs' joint normalization, ``alpha_i = m W_i / (Z_i + m W_i)`` with ``Z_i = sum_window e^s`` and ``W_i`` the
  older keys' total weight, times ``(weighted mean of the older values - o_win)``; ``m_h`` searched on a log grid
  (``joint |x|^p``, ``joint relu(x)^p``);
- oracles, for scale only: the exact direction ``(o_old - o_win) / RMS`` with a fitted fixed size, and
  ``alpha x (weighted mean - o_win)`` with the true ``alpha``.

``relu(x)^p`` is outside the paper's family; it is here because softmax's weights grow with the score while the
paper's do not: ``|s|^p`` weighs a strongly negative score like a strongly positive one, ``s^p`` (``p`` odd) gives it
a negative weight.

Two measures, on the four held-out domains in 1,024-token blocks at positions >= 256 (the conversion's beyond-window
evaluation, ``hf_knorm.conversion.beyond_window``):

1. **Explained energy**: the share of ``r``'s energy, summed over heads and layers, that each candidate explains
   (``1 - sum ||r - m_h c||^2 / sum ||r||^2``), every layer fed the original's own inputs; the sizes ``m_h`` are fitted
   here, on blocks the second measure does not score.
2. **Perplexity**: the model run with every layer's attention output replaced by ``o_win + m_h c`` (the fitted sizes,
   untrained otherwise), against the original and the window alone on the same tokens: what each design is worth
   before any conversion.

    python research/2026-12/distant_part_ceiling.py --out runs/distant_ceiling.json   # ~25 min, 2 threads
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_knorm.attention.window import row_scale
from hf_knorm.conversion.beyond_window import BLOCK, START, beyond_window_blocks
from hf_knorm.data.heldout import held_out_perplexity
from hf_knorm.evaluation.domains import DOMAINS
from hf_knorm.models.architectures import attention_modules
from hf_knorm.models.persistence import load_model

GRID = torch.logspace(-12, 12, 97, dtype=torch.float64)
"""The joint normalization's ``m_h`` candidates (4 a decade): the scale between ``e^s`` and ``s^p`` is unknown."""


class Split(NamedTuple):
    """One head group's attention split at the window: every tensor ``(H, q, ...)`` for the rows ``q`` measured."""

    scores: torch.Tensor  # (H, q, N) the scaled scores
    value: torch.Tensor  # (H, N, D)
    older: torch.Tensor  # (q, N) bool: keys older than the window, not sinks
    o: torch.Tensor  # (H, q, D) the original's output
    o_win: torch.Tensor  # (H, q, D) softmax over the window and the sinks alone
    o_old: torch.Tensor  # (H, q, D) softmax over the older keys alone (0 where there is none)
    alpha: torch.Tensor  # (H, q, 1) the softmax mass on the older keys
    window_mass: torch.Tensor  # (H, q, 1) sum of e^s over the window and the sinks, unshifted


def split_at_window(scores: torch.Tensor, value: torch.Tensor, rows: torch.Tensor, window: int, sinks: int) -> Split:
    keys = torch.arange(value.shape[1])
    causal = keys[None, :] <= rows[:, None]
    in_window = causal & ((keys[None, :] > rows[:, None] - window) | (keys[None, :] < sinks))
    older = causal & ~in_window
    weight = (scores - scores.max(-1, keepdim=True).values).exp() * causal
    total = weight.sum(-1, keepdim=True)
    return Split(scores, value, older, (weight @ value) / total, weighted_mean(weight * in_window, value),
                 weighted_mean(weight * older, value), (weight * older).sum(-1, keepdim=True) / total,
                 (scores.exp() * in_window).sum(-1, keepdim=True))


def rms_unit(vectors: torch.Tensor) -> torch.Tensor:
    """``(..., D)`` vectors brought to RMS 1 over the last dimension by the hybrid's own :func:`row_scale` (0 stays
    0)."""
    return vectors * row_scale(vectors)


def weighted_mean(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``(H, q, N)`` non-negative weights, ``(H, N, D)`` values: each row's weighted mean, ``(H, q, D)`` (0 where the
    row has no weight)."""
    return (weights @ values) / weights.sum(-1, keepdim=True).clamp_min(1e-300)


def older_weights(kind: str, power: int) -> Callable[[Split], torch.Tensor]:
    """The ``(H, q, N)`` weights of the older keys: ``s^p`` (signed), ``|s|^p``, ``max(s, 0)^p`` or 1 (the mean)."""
    def weights(split: Split) -> torch.Tensor:
        s = split.scores
        base = {"signed": s, "abs": s.abs(), "relu": s.clamp_min(0), "mean": torch.ones_like(s)}[kind]
        return base.pow(power) * split.older

    return weights


def fixed_size(weights: Callable[[Split], torch.Tensor]) -> Callable[[Split], torch.Tensor]:
    """The hybrid's form of a distant part: ``u / RMS(u)`` with ``u = sum_older w v``, ``(H, q, D)``."""
    return lambda split: rms_unit(weights(split) @ split.value)


def at_true_size(weights: Callable[[Split], torch.Tensor]) -> Callable[[Split], torch.Tensor]:
    """An oracle: the older values' weighted mean at softmax's own share of the older keys, ``(H, q, D)``."""
    return lambda split: split.alpha * (weighted_mean(weights(split), split.value) - split.o_win)


FIXED: dict[str, Callable[[Split], torch.Tensor]] = {
    **{f"x^{p} / RMS": fixed_size(older_weights("signed", p)) for p in (1, 2, 3)},
    "mean / RMS": fixed_size(older_weights("mean", 0)),
    **{f"relu(x)^{p} / RMS": fixed_size(older_weights("relu", p)) for p in (1, 3)},
}
"""Realizable candidates with a fixed size: ``c_i`` (``m_h`` fitted)."""

JOINT: dict[str, Callable[[Split], torch.Tensor]] = {
    **{f"joint |x|^{p}": older_weights("abs", p) for p in (1, 3)},
    **{f"joint relu(x)^{p}": older_weights("relu", p) for p in (1, 3)},
}
"""Realizable candidates with LoLCATs' joint normalization: their older keys' weights (``m_h`` on :data:`GRID`)."""

ORACLE: dict[str, Callable[[Split], torch.Tensor]] = {
    "exact direction / RMS (oracle)": lambda split: rms_unit(split.o_old - split.o_win),
    **{f"alpha x (mean_{name} - o_win) (oracle)": at_true_size(older_weights(kind, p))
       for name, kind, p in (("1", "mean", 0), ("|x|^3", "abs", 3), ("relu^1", "relu", 1), ("relu^3", "relu", 3))},
}
"""Candidates that read the true ``o_old`` or ``alpha`` (``m_h`` fitted): what a direction or a size is worth."""


def joint_part(split: Split, weights: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """LoLCATs' joint normalization's distant part for the mixes ``m``, shaped to broadcast against ``(H, q, 1)``:
    ``(H, 1, 1)`` one per head gives ``(H, q, D)``, ``(G, 1, 1, 1)`` a grid gives ``(G, H, q, D)``."""
    distant = weights.sum(-1, keepdim=True)
    share = m * distant / (split.window_mass + m * distant)
    return share * (weighted_mean(weights, split.value) - split.o_win)


class Fits:
    """Per candidate and layer, over the rows measured: ``sum r.c`` and ``sum ||c||^2`` per head (fixed sizes), or
    the residual energy per grid mix and head (joint); and ``sum ||r||^2``, ``sum ||o||^2`` per head."""

    def __init__(self):
        self.fixed: dict[str, dict[int, torch.Tensor]] = {}
        self.joint: dict[str, dict[int, torch.Tensor]] = {}
        self.residual: dict[int, torch.Tensor] = {}
        self.output: dict[int, torch.Tensor] = {}

    @staticmethod
    def _add(store: dict, layer: int, value: torch.Tensor) -> None:
        store[layer] = store[layer] + value if layer in store else value

    def add(self, layer: int, split: Split) -> None:
        r = split.o - split.o_win
        self._add(self.residual, layer, r.pow(2).sum(dim=(1, 2)))
        self._add(self.output, layer, split.o.pow(2).sum(dim=(1, 2)))
        for name, candidate in {**FIXED, **ORACLE}.items():
            c = candidate(split)
            self._add(self.fixed.setdefault(name, {}), layer,
                      torch.stack([(r * c).sum(dim=(1, 2)), c.pow(2).sum(dim=(1, 2))]))
        for name, weights in JOINT.items():
            parts = joint_part(split, weights(split), GRID.view(-1, 1, 1, 1))
            self._add(self.joint.setdefault(name, {}), layer, (r - parts).pow(2).sum(dim=(2, 3)))  # (G, H)

    def mix(self, name: str, layer: int) -> torch.Tensor:
        """The fitted ``(H,)`` sizes of a realizable candidate at ``layer``."""
        if name in self.joint:
            return GRID[self.joint[name][layer].argmin(dim=0)]
        sums = self.fixed[name][layer]
        return sums[0] / sums[1].clamp_min(1e-300)

    def explained(self) -> dict[str, dict]:
        """``{candidate: {"all": share of r's energy over every head, "by_layer": [...], "head_median": ...}}``."""
        layers = sorted(self.residual)
        explained = {name: {layer: sums[0].pow(2) / sums[1].clamp_min(1e-300) for layer, sums in store.items()}
                     for name, store in self.fixed.items()}
        explained |= {name: {layer: self.residual[layer] - grid.min(dim=0).values for layer, grid in store.items()}
                      for name, store in self.joint.items()}
        total = sum(self.residual[layer].sum() for layer in layers)
        return {name: {"all": float(sum(per[layer].sum() for layer in layers) / total),
                       "by_layer": [float(per[layer].sum() / self.residual[layer].sum()) for layer in layers],
                       "head_median": float(torch.cat([per[layer] / self.residual[layer] for layer in layers]).median())}
                for name, per in explained.items()}


class WindowSplitter:
    """Hooks on every attention module of a Llama-style model (q/k/v projections, RoPE): the original's q, k, v
    recomputed in fp64 and split at the window. ``fitting``: every candidate's fit accumulated over the rows
    ``>= START``. ``replacing = name``: every row's attention output (the ``o_proj`` input) replaced by
    ``o_win + m_h c`` of candidate ``name`` (``"window alone"``: ``o_win``; ``"original"``: the recomputed ``o``)."""

    def __init__(self, model, window: int, sinks: int):
        self.window, self.sinks = window, sinks
        self.fits = Fits()
        self.fitting = False
        self.replacing: str | None = None
        self._pending: dict[int, torch.Tensor] = {}
        modules = [module for _, module in attention_modules(model)]
        if not all(hasattr(module, name) for module in modules for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError("This script recomputes Llama-style attention (q_proj, k_proj, v_proj, o_proj, RoPE).")
        for index, module in enumerate(modules):
            module.register_forward_pre_hook(self._on_attention(index), with_kwargs=True)
            module.o_proj.register_forward_pre_hook(self._on_output(index))

    def _on_attention(self, index: int):
        def hook(module, args, kwargs):
            if self.fitting or self.replacing:
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
                self._layer(index, module, hidden, cos, sin)

        return hook

    def _on_output(self, index: int):
        def hook(module, args):
            if self.replacing:
                return (self._pending.pop(index).to(args[0].dtype),)
            return None

        return hook

    @torch.no_grad()
    def _layer(self, index: int, module, hidden: torch.Tensor, cos, sin) -> None:
        batch, length, _ = hidden.shape
        dim = module.head_dim
        query = module.q_proj(hidden).view(batch, length, -1, dim).transpose(1, 2)
        key = module.k_proj(hidden).view(batch, length, -1, dim).transpose(1, 2)
        value = module.v_proj(hidden).view(batch, length, -1, dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        groups = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(groups, dim=1).double() for t in (key, value))
        rows = torch.arange(START if self.fitting else 0, length)
        outputs = []
        for b in range(batch):
            scores = (query[b, :, rows].double() @ key[b].transpose(-1, -2)) * module.scaling  # (H, q, N)
            split = split_at_window(scores, value[b], rows, self.window, self.sinks)
            if self.fitting:
                self.fits.add(index, split)
            else:
                outputs.append(self._replaced(index, split))
        if self.replacing:
            self._pending[index] = torch.stack(outputs).transpose(1, 2).reshape(batch, length, -1)

    def _replaced(self, index: int, split: Split) -> torch.Tensor:
        name = self.replacing
        if name == "original":
            return split.o
        if name == "window alone":
            return split.o_win
        m = self.fits.mix(name, index)
        if name in JOINT:
            return split.o_win + joint_part(split, JOINT[name](split), m.view(-1, 1, 1))
        return split.o_win + m.view(-1, 1, 1) * FIXED[name](split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2, help=f"blocks of {BLOCK} tokens per domain, for each measure")
    parser.add_argument("--window", type=int, default=64, help="the softmax window W")
    parser.add_argument("--sinks", type=int, default=4, help="the attention sinks S (in the window's softmax)")
    parser.add_argument("--perplexity", default="original,window alone," + ",".join([*FIXED, *JOINT]),
                        help="the candidates whose perplexity is measured, comma-separated ('' for none)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    started = time.perf_counter()
    model, tokenizer = load_model("default")
    splitter = WindowSplitter(model, args.window, args.sinks)
    blocks = beyond_window_blocks([d.name for d in DOMAINS], tokenizer, 2 * args.blocks * BLOCK)
    scored = {name: data.select(range(args.blocks)) for name, data in blocks.items()}
    fitted = {name: data.select(range(args.blocks, 2 * args.blocks)) for name, data in blocks.items()}

    splitter.fitting = True
    for data in fitted.values():
        for example in data:
            with torch.no_grad():
                model(input_ids=torch.tensor([example["input_ids"]]), use_cache=False, logits_to_keep=1)
    splitter.fitting = False
    fits = splitter.fits
    residual = float(sum(e.sum() for e in fits.residual.values()))
    output = float(sum(e.sum() for e in fits.output.values()))
    result = {"window": args.window, "sinks": args.sinks, "start": START, "block": BLOCK, "blocks": args.blocks,
              "residual_over_output": residual / output, "explained": fits.explained(), "perplexity": {}}
    print(f"r, what lies beyond the window: {result['residual_over_output']:.4f} of the head outputs' energy "
          f"(positions >= {START} of {BLOCK}-token blocks, {args.blocks} a domain)")
    for name, share in sorted(result["explained"].items(), key=lambda item: -item[1]["all"]):
        print(f"  {name:>38}: explains {share['all']:7.4f} of r (median head {share['head_median']:.4f})")

    for name in [part for part in args.perplexity.split(",") if part]:
        splitter.replacing = name
        result["perplexity"][name] = {domain: held_out_perplexity(model, data, desc=name)
                                      for domain, data in scored.items()}
        print(f"  perplexity, {name:>18}: " + ", ".join(f"{d} {p:.2f}" for d, p in result["perplexity"][name].items()))
    splitter.replacing = None
    result["perplexity"]["unhooked original"] = {domain: held_out_perplexity(model, data, desc="original")
                                                 for domain, data in scored.items()}
    result["seconds"] = time.perf_counter() - started
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
