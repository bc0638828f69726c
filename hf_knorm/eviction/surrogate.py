"""KVzap's surrogate of KVzip's score: a linear map from a cached pair to the logarithm of its reconstruction
importance, fitted once per model and saved, so that the cache ranks pairs at the prefill's cost.

KVzap (arXiv 2601.07891; kvpress ``kvzap/``) fits, per layer, a linear map (or a small MLP) from each token's hidden
state to ``log`` of its KVzip+ importance, and prunes the pairs it predicts below a threshold. Here the surrogate reads
what a KV cache holds, not the hidden state (an eviction score sees only the cached pairs,
:mod:`hf_knorm.eviction.scores`): per layer, the features of token ``t`` are the keys of every KV head **with their
rotary rotation undone** and the values of every KV head, ``x_t = [k_1 .. k_H, v_1 .. v_H]`` ``(2 * H_kv * D,)``, both
linear in the layer's normalized hidden state (``W_k h``, ``W_v h``): a linear map of ``x_t`` is KVzap's linear
surrogate restricted to the rows of ``[W_k; W_v]``. Without the rotation undone a linear map would read a pair's
position through the rotation's phase. The target is ``log`` of the project's KVzip importance
(:func:`hf_knorm.eviction.reconstruction.reconstruction_scores`: the largest softmax weight a reconstruction query
gives the pair), not KVzip+'s normalized one, so the surrogate stands in for ``score="kvzip"`` and its predictions
are on one scale across layers and heads (``layer_budget="global"``).

The fit (:func:`fit_kvzap`): ridge regression per layer, the normal equations accumulated over every token of the
fitting texts in fp64 (no feature matrix is held), the features standardized by their spread for the penalty. Its
report gives, on held-out texts, each layer's ``R^2`` and the share of KVzip's kept pairs (the top half of each head)
that the surrogate keeps too. A surrogate is bound to the model it was fitted on: :meth:`KVzapSurrogate.check_model`
compares the rotary frequencies and a fingerprint of every parameter, and the score checks shapes on every call.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["KVzapSurrogate", "calibrate_threshold", "fit_kvzap", "model_fingerprint", "rotary_of", "same_fingerprint",
           "surrogate_features", "unrotated_keys"]

FLOOR = 1e-10
"""The importance a log is taken of at least (a pair no reconstruction query attends has importance 0)."""


def rotary_of(model) -> tuple[torch.Tensor | None, float]:
    """``(inv_freq (D_rot / 2,) fp32 or None, attention_scaling)`` of the rotary embedding of ``model``'s full-attention
    layers (the layers a KNorm cache compresses; a model with per-layer-type RoPE, Gemma 3, keeps them as
    ``full_attention_inv_freq``): ``None`` for a model whose keys are not rotated (absolute positions).

    Raises:
        ValueError: several rotary embeddings with different frequencies, or frequencies that change with the length
            (``rope_type="dynamic"``): one rotation cannot be undone for every layer.
    """
    found = {}
    for module in model.modules():
        buffers = dict(module.named_buffers(recurse=False))
        prefix = "" if "inv_freq" in buffers else "full_attention_" if "full_attention_inv_freq" in buffers else None
        if prefix is None:
            continue
        rope_type = getattr(module, "rope_type", "default")
        if "dynamic" in (rope_type.values() if isinstance(rope_type, dict) else (rope_type,)):
            raise ValueError("The KVzap surrogate undoes the keys' rotary rotation, and this model's frequencies "
                             "change with the length (rope_type='dynamic'): score it with score='kvzip'.")
        inv_freq = buffers[prefix + "inv_freq"].detach().float().cpu()
        found[tuple(inv_freq.tolist())] = (inv_freq, float(getattr(module, prefix + "attention_scaling", 1.0)))
    if len(found) > 1:
        raise ValueError(f"This model has {len(found)} rotary embeddings with different frequencies; the KVzap "
                         "surrogate undoes one rotation for every layer: score it with score='kvzip'.")
    return next(iter(found.values())) if found else (None, 1.0)


def unrotated_keys(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None,
                   scaling: float = 1.0) -> torch.Tensor:
    """The keys before their rotary rotation (Transformers' ``rotate_half`` convention, partial rotary included: the
    first ``2 * len(inv_freq)`` dimensions rotate): (B, H_kv, S, D) at absolute ``positions`` (B, H_kv, S) -> (B, H_kv,
    S, D) fp32. The inverse of ``k * cos + rotate_half(k) * sin`` with ``cos, sin`` of ``positions * inv_freq`` times
    ``scaling``; ``inv_freq=None``: the keys as they are."""
    keys = keys.float()
    if inv_freq is None:
        return keys
    rotary = 2 * inv_freq.numel()
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(keys.device, torch.float64)  # (B, H, S, D_rot/2)
    cos, sin = (torch.cat([part, part], dim=-1).float() for part in (angles.cos(), angles.sin()))
    turned, kept = keys[..., :rotary], keys[..., rotary:]
    half = rotary // 2
    rotated_half = torch.cat([-turned[..., half:], turned[..., :half]], dim=-1)
    return torch.cat([(turned * cos - rotated_half * sin) / scaling, kept], dim=-1)


def surrogate_features(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       inv_freq: torch.Tensor | None, scaling: float = 1.0) -> torch.Tensor:
    """Each token's features (module docstring): (B, H_kv, S, D) keys and values at (B, H_kv, S) positions ->
    (B, S, 2 * H_kv * D) fp32, the unrotated keys of every head then the values of every head."""
    batch, heads, length, _ = keys.shape
    flat = lambda states: states.float().permute(0, 2, 1, 3).reshape(batch, length, -1)  # noqa: E731
    return torch.cat([flat(unrotated_keys(keys, positions, inv_freq, scaling)), flat(values)], dim=-1)


def model_fingerprint(model) -> list[float]:
    """Numbers that tell models apart: for every parameter, in order, the mean absolute value of its first 64 entries
    in fp64 (a change of dtype moves each by about 1e-3 relative; a light fine-tune of one model may move them less)."""
    return [float(param.detach().flatten()[:64].double().abs().mean()) for param in model.parameters()]


def same_fingerprint(found: list[float], expected: list[float], relative: float = 5e-3) -> bool:
    """Whether two :func:`model_fingerprint` lists are of one model (each entry within ``relative``)."""
    return len(found) == len(expected) and all(abs(a - b) <= relative * abs(b) + 1e-12 for a, b in zip(found, expected))


@dataclass(frozen=True, eq=False)
class KVzapSurrogate:
    """A fitted surrogate: per layer ``log importance ~ x_t @ weight[l] + bias[l]`` (module docstring).

    Attributes:
        weight: ``(L, 2 * H_kv * D, H_kv)`` fp32, one column per KV head.
        bias: ``(L, H_kv)`` fp32.
        inv_freq: ``(D_rot / 2,)`` the model's rotary frequencies, or ``None`` (keys not rotated).
        attention_scaling: the rotary embedding's ``attention_scaling``.
        info: what it was fitted on and how well (JSON-serializable): ``model``, ``fingerprint``, ``layers`` (the
            fitted ones: those a KNorm cache compresses), ``fit``, ``report``.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    inv_freq: torch.Tensor | None
    attention_scaling: float = 1.0
    info: dict = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return self.weight.shape[0]

    def predict(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                layer_idx: int) -> torch.Tensor:
        """The predicted ``log`` importance of layer ``layer_idx``'s pairs: (B, H_kv, S, D) keys (as cached, rotated)
        and values at (B, H_kv, S) positions -> (B, H_kv, S) fp32.

        Raises:
            ValueError: a layer or a shape the surrogate was not fitted for.
        """
        heads, dim = keys.shape[1], keys.shape[-1]
        if layer_idx not in self.info.get("layers", range(self.layers)) or \
                self.weight.shape[1:] != (heads * (dim + values.shape[-1]), heads):
            fitted = self.info.get("model", "another model")
            raise ValueError(
                f"This KVzap surrogate was fitted on {fitted} ({self.layers} layers, weight "
                f"{tuple(self.weight.shape)}); layer {layer_idx} caches {heads} KV heads of {dim} dimensions. Fit "
                "one for this model (hf_knorm.eviction.surrogate.fit_kvzap, scripts/knorm/fit_kvzap.py) and pass "
                "KVzap(file=...).")
        features = surrogate_features(keys, values, positions, self.inv_freq, self.attention_scaling)
        weight, bias = self.weight[layer_idx].to(features.device), self.bias[layer_idx].to(features.device)
        return (features @ weight + bias).transpose(1, 2)  # (B, H_kv, S)

    def check_model(self, model) -> None:
        """Raise ``ValueError`` unless ``model`` is the one the surrogate was fitted on (its rotary frequencies and
        :func:`same_fingerprint`)."""
        inv_freq, _ = rotary_of(model)
        same_rotary = (inv_freq is None) == (self.inv_freq is None) and (
            inv_freq is None or (inv_freq.shape == self.inv_freq.shape and torch.allclose(inv_freq, self.inv_freq)))
        if not same_rotary or not same_fingerprint(model_fingerprint(model), self.info.get("fingerprint") or []):
            raise ValueError(f"This KVzap surrogate was fitted on {self.info.get('model', 'another model')}, not on "
                             "this model (its rotary frequencies or parameters differ): fit one for it "
                             "(hf_knorm.eviction.surrogate.fit_kvzap) and pass KVzap(file=...).")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the surrogate to ``path`` (safetensors, ``info`` in its metadata), atomically: an interrupted save
        leaves the previous file."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}
        if self.inv_freq is not None:
            tensors["inv_freq"] = self.inv_freq.contiguous()
        metadata = {"hf_knorm_kvzap": json.dumps({**self.info, "attention_scaling": self.attention_scaling})}
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(handle)
        try:
            save_file(tensors, temporary, metadata=metadata)
            os.chmod(temporary, 0o644)  # mkstemp's 0o600 would hide a shipped file from other users
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> KVzapSurrogate:
        """Read a surrogate written by :meth:`save`.

        Raises:
            FileNotFoundError: no file at ``path``; ValueError: a safetensors file that is not a KVzap surrogate.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No KVzap surrogate at {path}: fit one (scripts/knorm/fit_kvzap.py) or give the "
                                    "path of a saved one.")
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if "hf_knorm_kvzap" not in metadata or not {"weight", "bias"} <= set(handle.keys()):
                raise ValueError(f"{path} is not a KVzap surrogate saved by hf_knorm (KVzapSurrogate.save).")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        info = json.loads(metadata["hf_knorm_kvzap"])
        scaling = float(info.pop("attention_scaling", 1.0))
        return cls(tensors["weight"], tensors["bias"], tensors.get("inv_freq"), scaling, info)


class _NormalEquations:
    """One layer's ridge regression, accumulated token by token in fp64: ``sum x``, ``sum x x^T``, ``sum x y^T``."""

    def __init__(self, features: int, heads: int):
        self.count = 0
        self.sum = torch.zeros(features, dtype=torch.float64)
        self.gram = torch.zeros(features, features, dtype=torch.float64)
        self.cross = torch.zeros(features, heads, dtype=torch.float64)
        self.target_sum = torch.zeros(heads, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``x`` (n, F) features, ``y`` (n, H_kv) log importance."""
        x, y = x.double(), y.double()
        self.count += x.shape[0]
        self.sum += x.sum(0)
        self.gram += x.T @ x
        self.cross += x.T @ y
        self.target_sum += y.sum(0)

    def solve(self, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight (F, H_kv), bias (H_kv,))`` minimizing the squared error plus ``ridge * n * sum_f var_f w_f^2``
        (the penalty of standardized features), the intercept free."""
        n = self.count
        mean, target_mean = self.sum / n, self.target_sum / n
        covariance = self.gram / n - mean[:, None] * mean[None, :]
        cross = self.cross / n - mean[:, None] * target_mean[None, :]
        penalty = ridge * covariance.diagonal().clamp_min(1e-12)
        weight = torch.linalg.solve(covariance + torch.diag(penalty), cross)
        return weight.float(), (target_mean - mean @ weight).float()


def _layer_samples(model, tokenizer, text: str, rotary: tuple[torch.Tensor | None, float]):
    """``{layer index: (features (n, F), log importance (n, H_kv))}`` of one context: prefilled into a
    ``KNormCache(score="kvzip")`` as the pipeline does (the chat template's user turn), scored by the reconstruction;
    ``rotary``: :func:`rotary_of` the model."""
    from ..compat import cache_kwargs
    from .cache import KNormLayer
    from .pipeline import encode_prompt, knorm_cache_for
    from .reconstruction import reconstruction_scores

    context_ids, _ = encode_prompt(tokenizer, text, "")
    cache = knorm_cache_for(model, recorded_defaults=False, score="kvzip", compression_ratio=0.5)
    with torch.no_grad():
        model(input_ids=context_ids, **cache_kwargs(cache), use_cache=True)
        importance = reconstruction_scores(model, cache, context_ids, tokenizer)
    samples = {}
    for layer in cache.layers:
        if isinstance(layer, KNormLayer):
            keys, values, positions = layer.prompt_slots()
            features = surrogate_features(keys, values, positions, *rotary)[0]
            target = importance[layer.layer_idx][0].float().clamp_min(FLOOR).log().T  # (n, H_kv)
            samples[layer.layer_idx] = (features, target)
    return samples


def fit_kvzap(model, tokenizer, texts: list[str], held_out: list[str] = (), *, ridge: float = 1e-3,
              progress=None) -> KVzapSurrogate:
    """Fit a :class:`KVzapSurrogate` of ``model`` on the KVzip importance of ``texts`` (module docstring).

    Args:
        model (PreTrainedModel): A decoder with softmax attention (the reconstruction's); only its full-attention
            layers are fitted (the cache keeps sliding-window layers whole).
        tokenizer: Its tokenizer (the reconstruction prompt is text).
        texts (list of str): The contexts to fit on (KVzap: 750-1,250 tokens each; each is one reconstruction).
        held_out (list of str): Contexts scored after the fit, for its report: per layer ``R^2`` of the log
            importance and the share of KVzip's kept pairs (each head's top half) the surrogate keeps too.
        ridge (float): The penalty on the standardized features (default 1e-3).
        progress (callable, optional): Called with ``(done, total)`` after each context.

    Raises:
        ValueError: no text.
    """
    if not texts:
        raise ValueError("fit_kvzap needs at least one text to fit on.")
    rotary = rotary_of(model)
    total, equations = len(texts) + len(held_out), {}
    for done, text in enumerate(texts, 1):
        for index, (x, y) in _layer_samples(model, tokenizer, text, rotary).items():
            equations.setdefault(index, _NormalEquations(x.shape[-1], y.shape[-1])).add(x, y)
        if progress is not None:
            progress(done, total)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    features, heads = next(iter(equations.values())).cross.shape
    unfitted = (torch.zeros(features, heads), torch.zeros(heads))  # a sliding-window layer: the cache keeps it whole
    solved = [equations[index].solve(ridge) if index in equations else unfitted for index in range(layers)]
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    info = {"model": Path(name).name if os.path.isabs(name) else name,  # a local folder: its name, not the machine's
            "fingerprint": model_fingerprint(model),
            "layers": sorted(equations),
            "fit": {"texts": len(texts), "tokens": next(iter(equations.values())).count, "ridge": ridge,
                    "target": "log KVzip importance (hf_knorm.eviction.reconstruction)"}}
    surrogate = KVzapSurrogate(torch.stack([weight for weight, _ in solved]),
                               torch.stack([bias for _, bias in solved]), *rotary, info)
    if held_out:
        surrogate.info["report"] = _report(surrogate, model, tokenizer, held_out, len(texts), total, progress)
    return surrogate


def calibrate_threshold(model, tokenizer, texts: list[str], evict: float, *, score=None, sink_tokens: int = 0,
                        recent_window: int = 0) -> float:
    """The threshold at which KVzap's pruning (``KNormCache(score="kvzap", head_budget="heads", threshold=t)``)
    evicts the share ``evict`` of the prompt pairs it may evict in ``texts``: their ``evict``-quantile of the
    surrogate's predicted log importance.

    KVzap (arXiv 2601.07891) prunes below a threshold rather than at a ratio, and the threshold's scale (a predicted log
    attention weight) says nothing of how much goes. This reads it off text like the user's: each text is prefilled as
    the pipeline encodes a context (the chat template's user turn), every layer the cache compresses and every KV head
    scores its pairs, the first ``sink_tokens`` and the last ``recent_window`` of each text left out (never evicted),
    and ``t`` is the ``k``-th smallest prediction with ``k = round(evict * N)`` of the ``N`` left: a threshold cache
    with the same sinks and window evicts exactly ``k`` of them at the prefill of these texts (up to ties). On other
    text it evicts about that share (docs/results/knorm.md, "KVzap's threshold pruning": the share a threshold evicts
    varies with the text).

    Args:
        model (PreTrainedModel): The model the surrogate was fitted on (checked).
        tokenizer: Its tokenizer.
        texts (list of str): Contexts like those the cache will compress.
        evict (float): The share to evict, in (0, 1).
        score (KVzap, optional): The score whose surrogate is read (``KVzap(file=...)``); default: the shipped one.
        sink_tokens, recent_window (int): The cache's; their pairs are not counted.

    Raises:
        ValueError: ``evict`` outside (0, 1), no text, a text with no pair left to evict, or a surrogate of another
            model.
    """
    from transformers import DynamicCache

    from ..compat import cache_kwargs
    from .pipeline import encode_prompt
    from .scores import KVzap

    if not 0.0 < evict < 1.0:
        raise ValueError(f"evict is the share of the evictable pairs to evict, in (0, 1); got {evict!r}.")
    if not texts:
        raise ValueError("calibrate_threshold needs at least one text like those the cache will compress.")
    surrogate = (score or KVzap()).surrogate()
    surrogate.check_model(model)
    predictions = []
    for text in texts:
        ids, _ = encode_prompt(tokenizer, text, "")
        ids = ids.to(model.device)
        length = ids.shape[1]
        if length <= sink_tokens + recent_window:
            raise ValueError(f"A text of {length} tokens has no pair older than the window ({sink_tokens} sinks and "
                             f"{recent_window} recent tokens are never evicted): give longer texts.")
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
        for index in surrogate.info.get("layers", range(surrogate.layers)):
            layer = cache.layers[index]
            positions = torch.arange(length, device=ids.device).expand(1, layer.keys.shape[1], -1)
            predicted = surrogate.predict(layer.keys, layer.values, positions, index)  # (1, H_kv, n)
            predictions.append(predicted[..., sink_tokens:length - recent_window].flatten().float().cpu())
    ordered = torch.cat(predictions).sort().values
    return float(ordered[min(len(ordered) - 1, round(evict * len(ordered)))])


def _report(surrogate: KVzapSurrogate, model, tokenizer, texts, done: int, total: int, progress) -> dict:
    """Per layer, over the held-out contexts: ``R^2`` of the log importance (against each context's own mean: what a
    ranking within the context can use), and the share of KVzip's kept pairs (each
    head's top half of each context) the surrogate keeps too."""
    errors, spreads, shared, kept = {}, {}, {}, {}
    for step, text in enumerate(texts, done + 1):
        for index, (x, y) in _layer_samples(model, tokenizer, text, (surrogate.inv_freq,
                                                                      surrogate.attention_scaling)).items():
            predicted = x @ surrogate.weight[index] + surrogate.bias[index]  # (n, H_kv)
            errors[index] = errors.get(index, 0.0) + float((predicted - y).square().sum())
            spreads[index] = spreads.get(index, 0.0) + float((y - y.mean(0)).square().sum())
            half = max(1, y.shape[0] // 2)
            truth = torch.zeros_like(y, dtype=torch.bool).scatter_(0, y.topk(half, dim=0).indices, True)
            mine = torch.zeros_like(truth).scatter_(0, predicted.topk(half, dim=0).indices, True)
            shared[index] = shared.get(index, 0) + int((truth & mine).sum())
            kept[index] = kept.get(index, 0) + int(truth.sum())
        if progress is not None:
            progress(step, total)
    layers = sorted(errors)
    return {"texts": len(texts), "r2": [1.0 - errors[i] / spreads[i] for i in layers],
            "top_half_overlap": [shared[i] / kept[i] for i in layers]}
