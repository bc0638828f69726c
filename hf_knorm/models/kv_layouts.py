"""Where each architecture keeps its query, key, value and output projections: what a K/V reparametrization scales.

A :class:`KVLayout` describes one attention layer as four channel spaces, each a list of :class:`Slot` (a parameter,
the axis that indexes the channels, and the positions of channel ``h * head_dim + d`` along that axis):

- query ``(H_q, D)`` and key ``(H_kv, D)``: the rows of ``q_proj``/``k_proj`` (and biases); for QK-norm models
  (qwen3, gemma3) the ``q_norm``/``k_norm`` weights instead, ``(D,)`` shared by all heads (a per-head RMSNorm
  cancels any scaling of ``k_proj``, so only the norm weight can carry it; Gemma's norm multiplies by ``1 + w``);
- value ``(H_kv, D)``: the rows of ``v_proj`` (and bias);
- output ``(H_q, D)``: the *input* columns of ``o_proj``.

Fused projections are sliced: phi3 ``qkv_proj`` rows ``[q | k | v]``, gpt2 ``c_attn`` (a ``Conv1D``, weight
``(in, out)``) columns ``[q | k | v]``, gpt_neox ``query_key_value`` rows interleaved per head ``[q_h | k_h | v_h]``.
RoPE (Transformers' ``rotate_half``) rotates channel ``i`` with ``i + R/2`` for ``i < R/2``, ``R = rotary_dim``
(``R < D`` with partial rotary: phi3, gpt_neox; channels ``>= R`` pass through); ``rotary_dim = 0`` means no RoPE
(gpt2, bert, vit). Query head ``j`` reads KV head ``j // (H_q / H_kv)`` (Transformers' ``repeat_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .architectures import architecture_of, attention_modules

_SEPARATE = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj"), "mistral": ("q_proj", "k_proj", "v_proj", "o_proj"),
             "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj"), "gemma2": ("q_proj", "k_proj", "v_proj", "o_proj"),
             "vit": ("q_proj", "k_proj", "v_proj", "o_proj")}
_NO_ROPE = ("gpt2", "bert", "vit")


@dataclass(frozen=True)
class Slot:
    """Channels ``0..n-1`` of one projection stored in ``param`` at positions ``index`` along axis ``dim``.

    ``one_plus``: the parameter acts as ``1 + w`` (Gemma's RMSNorm), so scaling by ``f`` means ``w <- (1 + w) f - 1``.
    """

    param: nn.Parameter
    dim: int
    index: torch.Tensor
    one_plus: bool = False

    def scale(self, factor: torch.Tensor) -> None:
        """Multiply channel ``c`` by ``factor[c]`` (flat, length ``len(index)``), computed in fp32 (fp64 for fp64)."""
        data = self.param.data
        compute = torch.float64 if data.dtype == torch.float64 else torch.float32
        work = data.to(compute)
        shape = [1] * work.dim()
        shape[self.dim] = -1
        factor = factor.to(device=work.device, dtype=compute).reshape(shape)
        index = self.index.to(work.device)
        selected = work.index_select(self.dim, index)
        scaled = (1.0 + selected) * factor - 1.0 if self.one_plus else selected * factor
        data.copy_(work.index_copy(self.dim, index, scaled).to(data.dtype))


@dataclass
class KVLayout:
    """The projections of one attention layer that a K/V fold scales (see the module docstring).

    Attributes:
        name (str): The attention module's qualified name.
        num_heads, num_kv_heads, head_dim (int): ``H_q``, ``H_kv``, ``D``.
        rotary_dim (int): Channels rotated by RoPE per head (0: no RoPE).
        qk_norm (bool): Query/key slots are ``(D,)`` norm weights shared by all heads.
        query, key, value, output (list of Slot): The slots of each channel space: ``(H_q, D)``, ``(H_kv, D)``, ``(H_kv,
            D)``, ``(H_q, D)``.
    """

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    qk_norm: bool
    query: list[Slot]
    key: list[Slot]
    value: list[Slot]
    output: list[Slot]

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter a fold may modify (each once)."""
        found = {}
        for slot in self.query + self.key + self.value + self.output:
            found.setdefault(id(slot.param), slot.param)
        return list(found.values())

    def scale_query(self, factor: torch.Tensor) -> None:
        """Multiply query channel ``(j, d)`` by ``factor[j, d]``, ``factor`` ``(H_q, D)``."""
        _apply(self.query, self._per_norm(factor, "query"))

    def scale_key(self, factor: torch.Tensor) -> None:
        """Multiply key channel ``(h, d)`` by ``factor[h, d]``, ``factor`` ``(H_kv, D)``."""
        _apply(self.key, self._per_norm(factor, "key"))

    def scale_value(self, factor: torch.Tensor) -> None:
        """Multiply value channel ``(h, d)`` by ``factor[h, d]``, ``factor`` ``(H_kv, D)``."""
        _apply(self.value, factor.flatten())

    def scale_output(self, factor: torch.Tensor) -> None:
        """Multiply ``o_proj``'s input column ``(j, d)`` by ``factor[j, d]``, ``factor`` ``(H_q, D)``."""
        _apply(self.output, factor.flatten())

    def fold(self, key_scale: torch.Tensor, value_scale: torch.Tensor) -> None:
        """K' = K / s, Q' = Q * s (per query head, from its KV head), V' = V * t, ``o_proj`` columns / t.

        Args:
            key_scale (torch.Tensor): ``s``, ``(H_kv, D)``; must be equal within each RoPE pair (not checked here:
                ``balance_kv`` builds it so).
            value_scale (torch.Tensor): ``t``, ``(H_kv, D)``.
        """
        self.scale_query(expand_to_query_heads(key_scale, self.groups))
        self.scale_key(1.0 / key_scale)
        self.scale_value(value_scale)
        self.scale_output(expand_to_query_heads(1.0 / value_scale, self.groups))

    def _per_norm(self, factor: torch.Tensor, side: str) -> torch.Tensor:
        if not self.qk_norm:
            return factor.flatten()
        if not torch.equal(factor, factor[:1].expand_as(factor)):
            raise ValueError(
                f"{self.name} normalizes {side}s per head with one (head_dim,) weight shared by all heads: a {side} "
                "scale must be the same for every head."
            )
        return factor[0]


def _apply(slots: list[Slot], factor: torch.Tensor) -> None:
    for slot in slots:
        slot.scale(factor)


def expand_to_query_heads(per_kv_head: torch.Tensor, groups: int) -> torch.Tensor:
    """``(H_kv, D)`` -> ``(H_q, D)``: query head ``j`` gets the row of KV head ``j // groups`` (``repeat_kv``)."""
    return per_kv_head.repeat_interleave(groups, dim=0)


def kv_layouts(model: nn.Module) -> list[KVLayout]:
    """The :class:`KVLayout` of every attention layer of ``model``, in layer order.

    Raises:
        ValueError: The architecture is unsupported, a projection is missing or has an unexpected shape or type (e.g. a
            quantized ``nn.Linear`` replacement), a module is a cross-attention, or layers share projections.
    """
    model_type = architecture_of(model).model_type
    rotary_dim = 0 if model_type in _NO_ROPE else _rotary_dim(model)
    modules = dict(model.named_modules())
    layouts = [_layout(model_type, name, module, modules, rotary_dim) for name, module in attention_modules(model)]
    ids = [id(p) for layout in layouts for p in layout.parameters()]
    if len(ids) != len(set(ids)):
        raise ValueError("Some attention projections are shared between layers; a per-layer fold would scale them "
                         "twice.")
    return layouts


def _layout(model_type: str, name: str, module: nn.Module, modules: dict, rotary_dim: int) -> KVLayout:
    config = module.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if model_type in ("gpt2", "gpt_neox", "bert", "vit"):
        kv_heads = heads  # multi-head attention only
    if model_type in _SEPARATE or model_type in ("qwen3", "gemma3_text"):
        d = module.head_dim
        q, k, v, o = (_linear(module, n, name) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if model_type in ("qwen3", "gemma3_text"):
            one_plus = model_type == "gemma3_text"
            query = [Slot(_norm(module, "q_norm", d, name), 0, torch.arange(d), one_plus)]
            key = [Slot(_norm(module, "k_norm", d, name), 0, torch.arange(d), one_plus)]
        else:
            query, key = _rows(q, 0, heads * d), _rows(k, 0, kv_heads * d)
        value, output = _rows(v, 0, kv_heads * d), [Slot(o.weight, 1, torch.arange(heads * d))]
        qk_norm = model_type in ("qwen3", "gemma3_text")
    elif model_type == "phi3":
        d, fused = module.head_dim, _linear(module, "qkv_proj", name)
        query, key = _rows(fused, 0, heads * d), _rows(fused, heads * d, kv_heads * d)
        value = _rows(fused, (heads + kv_heads) * d, kv_heads * d)
        output, qk_norm = [Slot(_linear(module, "o_proj", name).weight, 1, torch.arange(heads * d))], False
    elif model_type == "gpt2":
        if getattr(module, "is_cross_attention", False):
            raise ValueError(f"{name} is a cross-attention: its keys come from another sequence; not supported.")
        heads = kv_heads = module.num_heads
        d, fused, proj = module.head_dim, _conv1d(module, "c_attn", name), _conv1d(module, "c_proj", name)
        width = heads * d
        query, key, value = (_rows(fused, i * width, width, dim=1) for i in range(3))
        output, qk_norm = [Slot(proj.weight, 0, torch.arange(width))], False
    elif model_type == "gpt_neox":
        d, fused = module.head_size, _linear(module, "query_key_value", name)
        per_head = torch.arange(heads)[:, None] * 3 * d + torch.arange(d)[None, :]  # (H, D): the q rows of each head
        query, key, value = ([Slot(p, 0, (per_head + i * d).flatten()) for p in _weight_and_bias(fused)]
                             for i in range(3))
        output, qk_norm = [Slot(_linear(module, "dense", name).weight, 1, torch.arange(heads * d))], False
    elif model_type == "bert":
        d = module.attention_head_size
        parent = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        dense = getattr(getattr(parent, "output", None), "dense", None)
        if not isinstance(dense, nn.Linear) or getattr(parent, "self", None) is not module:
            raise ValueError(f"{name}: no output projection found at <parent>.output.dense; unsupported BERT layout.")
        query, key, value = (_rows(_linear(module, n, name), 0, heads * d) for n in ("query", "key", "value"))
        output, qk_norm = [Slot(dense.weight, 1, torch.arange(heads * d))], False
    else:  # registered but without a layout here
        raise ValueError(f"K/V balancing has no projection layout for model_type {model_type!r}; "
                         "add one in kv_layouts.py.")
    if heads % kv_heads:
        raise ValueError(f"{name}: {heads} query heads do not group over {kv_heads} KV heads.")
    if rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"{name}: rotary dimension {rotary_dim} does not fit head_dim {d} in pairs.")
    return KVLayout(name, heads, kv_heads, d, rotary_dim, qk_norm, query, key, value, output)


def _rows(projection: nn.Module, start: int, count: int, dim: int = 0) -> list[Slot]:
    """Slots of output channels ``start .. start + count`` of a Linear (weight axis 0) or Conv1D (axis 1) and bias."""
    index = torch.arange(start, start + count)
    weight, *bias = _weight_and_bias(projection)
    return [Slot(weight, dim, index)] + [Slot(b, 0, index) for b in bias]


def _weight_and_bias(projection: nn.Module) -> list[nn.Parameter]:
    return [projection.weight] + ([projection.bias] if projection.bias is not None else [])


def _linear(module: nn.Module, attribute: str, name: str) -> nn.Module:
    return _checked(module, attribute, name, (nn.Linear,))


def _conv1d(module: nn.Module, attribute: str, name: str) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return _checked(module, attribute, name, (Conv1D,))


def _checked(module: nn.Module, attribute: str, name: str, types: tuple) -> nn.Module:
    projection = getattr(module, attribute, None)
    if type(projection) not in types or not projection.weight.dtype.is_floating_point:
        found = type(projection).__name__ if projection is not None else "nothing"
        raise ValueError(
            f"{name}.{attribute} is {found}, expected a floating-point {' or '.join(t.__name__ for t in types)}: "
            "K/V balancing folds scales into plain weights (quantized or replaced projections are not supported; "
            "balance the model before quantizing or adding adapters)."
        )
    return projection


def _norm(module: nn.Module, attribute: str, head_dim: int, name: str) -> nn.Parameter:
    norm = getattr(module, attribute, None)
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.shape != (head_dim,):
        raise ValueError(f"{name}.{attribute}: expected a per-head norm with a ({head_dim},) weight.")
    return weight


def _rotary_dim(model: nn.Module) -> int:
    """``2 * len(inv_freq)`` of the model's rotary embedding(s); they must agree."""
    sizes = {2 * buffer.numel() for name, buffer in model.named_buffers()
             if name.endswith("inv_freq") and not name.split(".")[-1].startswith("original")
             and "original_inv_freq" not in name}
    if len(sizes) != 1:
        raise ValueError(f"Cannot tell the RoPE dimension of this model (inv_freq sizes found: {sorted(sizes)}).")
    return sizes.pop()
