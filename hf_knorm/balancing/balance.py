"""Balanced Key-Value: an exact reparametrization that puts keys and values on one scale.

TransMLA (Meng et al., "TransMLA: Multi-Head Latent Attention Is All You Need", arXiv 2502.07864, "Balanced Key-Value",
Fig. 4a) observes per-channel key norms one to two orders of magnitude above value norms, so a joint low-rank (PCA)
compression of ``[K; V]`` only sees keys. Dividing keys by ``s`` and multiplying queries by ``s`` leaves ``Q K^T``
(hence every normalization of the scores) unchanged; multiplying values by ``t`` and ``o_proj``'s input columns by
``1/t`` leaves the attention output unchanged. Convention, per layer, ``s`` and ``t`` of shape ``(H_kv, head_dim)``:

    K' = K / s,   Q' = Q * s (query head j uses the s of KV head j // groups),   V' = V * t,   o_proj' = o_proj / t.

``s`` is equal within each RoPE pair (channel ``i`` and ``i + R/2``), so it commutes with the rotation: cached
(post-RoPE) keys are exactly ``K_rope / s``. Modes:

- ``"layer"`` (TransMLA): one scalar per layer, ``s = mean_c ||K_c|| / mean_c ||V_c||`` over the calibration tokens,
  put entirely on the key side (``t = 1``: values and ``o_proj`` untouched), so the mean key-channel norm equals the
  mean value-channel norm.
- ``"channel"`` (per-channel, like QServe SmoothAttention and msModelSlim KVSmooth, extended to V): every key and value
  channel is pulled toward one target ``T`` (geometric mean of the layer's key and value channel norms) with migration
  strength ``alpha``: ``s_c = (||K_c|| / T)^alpha``, ``t_c = (T / ||V_c||)^alpha`` (``alpha = 1`` makes all channels
  equal), then one scalar on ``s`` makes the mean key and value norms equal. Key norms are pooled per RoPE pair
  (root mean square), and for QK-norm models (qwen3, gemma3) also over heads, because their ``k_norm``/``q_norm``
  weight is shared by all heads.

The fold is computed in fp32 (fp64 for fp64 models) and cast back; logits before and after must agree within a
tolerance (:data:`TOLERANCES`, relative to the largest logit), otherwise every weight is restored and a ``ValueError``
says so. The scales are recorded in ``config.hf_knorm["kv_balancing"]`` (cumulative: balancing a balanced model
composes), so :func:`key_scales` recovers the original basis: ``original key = balanced key * s``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from ..models.architectures import architecture_of, attention_modules
from ..models.kv_layouts import KVLayout, kv_layouts
from ..recording.record_norms import record_norms
from ..version import __version__
from .report import BalanceReport, KVNorms

MODES = ("layer", "channel")
RECORD_KEY = "kv_balancing"
TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
"""Default allowed max |logit change| / max(1, max |logit|), by parameter dtype (fp64 is not tighter than 1e-6:
Gemma3's norms compute in fp32 even in fp64 models)."""
VERIFY_TOKENS = 128


def balance_kv(model: nn.Module, tokenizer, calibration, mode: str = "layer", *, alpha: float = 0.5,
               max_length: int = 512, max_tokens: int = 4096, min_tokens: int = 32, tolerance: float | None = None,
               progress: bool = True) -> BalanceReport:
    """Balance ``model``'s keys and values in place (exact; see the module docstring) and return a report.

    Args:
        model (nn.Module): A model of a supported architecture
            (``hf_knorm.models.architectures.SUPPORTED_ARCHITECTURES``), patched or not, any dtype.
        tokenizer: Tokenizes ``calibration`` texts; ``None`` when ``calibration`` holds model inputs.
        calibration (str, list of str, or list of dict): Texts, cut into windows of ``max_length`` tokens (at most
            ``max_tokens`` in all), or input dicts (e.g. ``{"pixel_values": (B, 3, H, W)}`` for ViT), one forward pass
            each.
        mode ({"layer", "channel"}): One scalar per layer (TransMLA) or per-channel scales.
        alpha (float): Migration strength of ``"channel"``, in (0, 1]; ignored by ``"layer"``.
        max_length, max_tokens, min_tokens (int): Window length, token budget, and the fewest calibration tokens
            accepted.
        tolerance (float, optional): Allowed max |logit change| relative to max(1, max |logit|); default by dtype
            (:data:`TOLERANCES`).
        progress (bool): Show a progress bar over calibration batches.

    Returns:
        BalanceReport: Per-layer ``(H_kv * head_dim,)`` norms before and after (both measured), the scales, the check.

    Raises:
        ValueError: Bad settings, unsupported layout, empty or too-short calibration, non-finite activations, or a fold
            that changes the logits beyond the tolerance. The weights are then exactly as they were.
    """
    training = model.training
    model.eval()  # calibration and the check must not see dropout
    try:
        return _balance_kv(model, tokenizer, calibration, mode, alpha, max_length, max_tokens, min_tokens, tolerance,
                           progress)
    finally:
        model.train(training)


def _balance_kv(model, tokenizer, calibration, mode, alpha, max_length, max_tokens, min_tokens, tolerance, progress):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha (migration strength) must be in (0, 1], got {alpha}.")
    layouts = kv_layouts(model)
    previous = _previous_record(model, layouts)
    batches = calibration_batches(model, tokenizer, calibration, max_length, max_tokens)
    before = measure_kv_norms(model, batches, progress, min_tokens, "before")
    scales = [compute_scales(k, v, layout, mode, alpha) for k, v, layout in zip(before.keys, before.values, layouts)]
    dtype = next(model.parameters()).dtype
    tolerance = TOLERANCES.get(dtype, 1e-4) if tolerance is None else tolerance
    verify = {name: t[:, :VERIFY_TOKENS] if name != "pixel_values" else t for name, t in batches[0].items()}
    snapshot = [(p, p.detach().clone()) for layout in layouts for p in layout.parameters()]
    with torch.no_grad():
        reference = _output(model, verify)
        try:
            for layout, (s, t) in zip(layouts, scales):
                layout.fold(s, t)
            change = (_output(model, verify) - reference).abs().max().item()
            bound = tolerance * max(1.0, reference.abs().max().item())
            if not change <= bound:  # also catches NaN
                raise ValueError(
                    f"K/V balancing changed the outputs by {change:.3g} (allowed {bound:.3g}); the weights are "
                    "restored. The scales may be too extreme for this dtype: balance in fp32, or pass a larger "
                    "tolerance."
                )
            after = measure_kv_norms(model, batches, progress, min_tokens, "after")
        except BaseException:
            for param, saved in snapshot:
                param.data.copy_(saved)
            raise
    _write_record(model, mode, alpha, scales, previous)
    return BalanceReport(mode, alpha if mode == "channel" else None, before, after, [s for s, _ in scales],
                         [t for _, t in scales], change, bound)


def compute_scales(key_norms: torch.Tensor, value_norms: torch.Tensor, layout: KVLayout, mode: str,
                   alpha: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales of one layer from its channel norms (the rules of the module docstring).

    Args:
        key_norms, value_norms (torch.Tensor): ``(H_kv * D,)`` L2 norms of the post-RoPE key channels and the value
            channels.
        layout (KVLayout): The layer (heads, rotary dimension, QK-norm).
        mode ({"layer", "channel"}):
        alpha (float): Migration strength of ``"channel"``.

    Returns:
        s, t : torch.Tensor: fp64 ``(H_kv, D)`` each: ``K' = K / s``, ``V' = V * t``; ``s`` equal within RoPE pairs (and
            over heads for QK-norm layouts).
    """
    shape = (layout.num_kv_heads, layout.head_dim)
    nk, nv = key_norms.double().reshape(shape), value_norms.double().reshape(shape)
    for name, n in (("key", nk), ("value", nv)):
        if not torch.isfinite(n).all() or n.max() <= 0:
            raise ValueError(f"{layout.name}: the {name} channel norms are not finite and positive; cannot balance.")
    nk, nv = nk.clamp_min(1e-6 * nk.max()), nv.clamp_min(1e-6 * nv.max())  # dead channels: no infinite scales
    if mode == "layer":
        ratio = (nk.mean() / nv.mean()).item()
        return torch.full(shape, ratio, dtype=torch.float64), torch.ones(shape, dtype=torch.float64)
    pooled = nk.clone()
    half = layout.rotary_dim // 2
    if half:  # RoPE pairs (i, i + R/2) share one scale
        pair = ((nk[:, :half].square() + nk[:, half:2 * half].square()) / 2).sqrt()
        pooled[:, :half], pooled[:, half:2 * half] = pair, pair
    if layout.qk_norm:  # one (D,) norm weight for all heads
        pooled = pooled.square().mean(dim=0, keepdim=True).sqrt().expand(shape).clone()
    target = torch.cat([pooled.flatten(), nv.flatten()]).log().mean().exp()
    s, t = (pooled / target) ** alpha, (target / nv) ** alpha
    s = s * ((nk / s).mean() / (nv * t).mean())  # equal mean key and value norms afterwards
    return s, t


def calibration_batches(model: nn.Module, tokenizer, calibration, max_length: int, max_tokens: int) -> list[dict]:
    """Calibration inputs as a list of single-sequence batches on the model's device (see :func:`balance_kv`)."""
    if isinstance(calibration, (str, Mapping)):
        calibration = [calibration]
    if not isinstance(calibration, Sequence):
        raise ValueError(f"calibration must be a list of texts or of input dicts, got {type(calibration).__name__}.")
    if len(calibration) == 0:
        raise ValueError("calibration is empty: pass a list of texts (a few thousand tokens are plenty).")
    device = next(model.parameters()).device
    if all(isinstance(item, Mapping) for item in calibration):
        return [{name: value.to(device) for name, value in item.items()} for item in calibration]
    if not all(isinstance(item, str) for item in calibration) or tokenizer is None:
        raise ValueError("calibration must be texts (with a tokenizer) or a list of model-input dicts, not a mix.")
    batches, total = [], 0
    for text in calibration:
        ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
        for start in range(0, len(ids), max_length):
            window = ids[start:start + max_length][: max_tokens - total]
            if len(window) == 0:
                break
            window = window[None].to(device)  # (1, n)
            batches.append({"input_ids": window, "attention_mask": torch.ones_like(window)})
            total += window.shape[1]
        if total >= max_tokens:
            break
    if not batches:
        raise ValueError("calibration texts produced no tokens: pass non-empty texts.")
    return batches


def measure_kv_norms(model: nn.Module, batches: list[dict], progress: bool = True, min_tokens: int = 1,
                     label: str = "") -> KVNorms:
    """Per-channel L2 norms of the post-RoPE keys and the values of ``model`` over ``batches``.

    Returns:
        KVNorms: One ``(H_kv * D,)`` fp64 key and value norm vector per layer.

    Raises:
        ValueError: Fewer than ``min_tokens`` tokens, or non-finite keys/values in some layer.
    """
    extra = {"use_cache": False} if architecture_of(model).causal else {}
    with torch.no_grad(), record_norms(model, keys_values=True, attention=False) as recorder:
        for batch in tqdm(batches, desc=f"K/V norms {label}".strip(), disable=not progress, leave=False):
            model(**batch, **extra)
    tokens = min(layer.tokens for layer in recorder.layers)
    if tokens < min_tokens:
        raise ValueError(f"Calibration has {tokens} tokens; at least {min_tokens} are needed for stable norms. "
                         "Pass more or longer calibration texts.")
    for i, layer in enumerate(recorder.layers):
        if not (torch.isfinite(layer.key_sq).all() and torch.isfinite(layer.value_sq).all()):
            raise ValueError(f"Layer {i} produced non-finite keys or values on the calibration data (NaN/inf): check "
                             "the inputs and the dtype (fp16 overflow); nothing was changed.")
    return KVNorms([l.key_channel_norms() for l in recorder.layers], [l.value_channel_norms() for l in recorder.layers],
                   tokens)


def key_scales(config) -> list[torch.Tensor] | None:
    """Per layer, the fp32 ``(H_kv, head_dim)`` ``s`` with ``original key = balanced key * s``; ``None`` if unbalanced.

    Cumulative over repeated balancing. Holds for the cached (post-RoPE) keys too: ``s`` is equal within RoPE pairs.
    """
    return _scales(config, "key_scale")


def value_scales(config) -> list[torch.Tensor] | None:
    """Per layer, the fp32 ``(H_kv, head_dim)`` ``t`` with ``balanced value = original value * t``.

    ``None`` for a model that was never balanced; cumulative over repeated balancing.
    """
    return _scales(config, "value_scale")


def _scales(config, name: str) -> list[torch.Tensor] | None:
    record = (getattr(config, "hf_knorm", None) or {}).get(RECORD_KEY)
    if not record:
        return None
    return [torch.tensor(layer, dtype=torch.float32) for layer in record[name]]


def _previous_record(model: nn.Module, layouts: list[KVLayout]) -> dict | None:
    record = (getattr(model.config, "hf_knorm", None) or {}).get(RECORD_KEY)
    if record is None:
        return None
    shapes = [tuple(torch.tensor(layer).shape) for layer in record.get("key_scale", [])]
    expected = [(layout.num_kv_heads, layout.head_dim) for layout in layouts]
    if shapes != expected:
        raise ValueError("config.hf_knorm['kv_balancing'] does not match this model's layers; it was not written by "
                         "hf_knorm.balance_kv for this model. Remove it only if the weights are the original ones.")
    return record


def _write_record(model: nn.Module, mode: str, alpha: float, scales, previous: dict | None) -> None:
    key = [s for s, _ in scales]
    value = [t for _, t in scales]
    history = [mode if mode == "layer" else f"channel(alpha={alpha})"]
    if previous is not None:
        key = [torch.tensor(p, dtype=torch.float64) * s for p, s in zip(previous["key_scale"], key)]
        value = [torch.tensor(p, dtype=torch.float64) * t for p, t in zip(previous["value_scale"], value)]
        history = list(previous.get("history", [])) + history
    record = {"mode": mode, "alpha": alpha if mode == "channel" else None, "history": history,
              "convention": "K' = K / key_scale, Q' = Q * key_scale, V' = V * value_scale, "
                            "o_proj' = o_proj / value_scale",
              "key_scale": [s.tolist() for s in key], "value_scale": [t.tolist() for t in value],
              "version": __version__}
    configs = {id(model.config): model.config}
    for _, module in attention_modules(model):
        configs.setdefault(id(module.config), module.config)
    for config in configs.values():
        section = dict(getattr(config, "hf_knorm", None) or {})
        section[RECORD_KEY] = record
        setattr(config, "hf_knorm", section)


def _output(model: nn.Module, batch: dict) -> torch.Tensor:
    """The model's logits (or last hidden state for a base encoder), in fp64 for comparison."""
    extra = {"use_cache": False} if architecture_of(model).causal else {}
    out = model(**batch, **extra)
    return (out.logits if getattr(out, "logits", None) is not None else out[0]).double()
