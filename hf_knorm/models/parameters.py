"""A normalization's learnable values as ``nn.Parameter``s of the model's attention modules.

A family with learnable values (a sigmoid's bias, a sink logit, SSMax's scale; a softmax window's mix: see
:meth:`hf_knorm.normalizations.Normalization.learnable`) gets, on every attention module, one ``nn.Parameter`` per
value, of one entry per query head, named ``hf_knorm_<name>`` (``model.layers.0.self_attn.hf_knorm_bias``). So they
are in ``state_dict``, the Trainer trains them (LoRA freezes them with the rest of the base model), and
``save_pretrained`` writes them with the weights. :func:`hf_knorm.patch` adds them (each at the family's initial
value), ``unpatch`` removes them. A model built from a patched config (any ``from_pretrained``, ``from_config``)
gets them when it is built (:func:`register`), so Transformers' own loader reads them from the checkpoint. The same
build hook installs, for the first model built with a ``p = 1`` normalization, the ``generate`` cache choice of
:mod:`hf_knorm.recurrent.generation` (docs/compatibility.md, "What importing hf_knorm changes").
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..attention.linear_kernel import is_linear
from ..compat import add_parameters_when_built
from ..normalizations import Normalization, parse_normalization
from ..normalizations.base import PARAMETER_PREFIX
from ..normalizations.windowed import CODEBOOK, MIX
from ..attention.held import hold
from ..recurrent.generation import register as register_state_decoding
from .architectures import attention_modules

PREFIX = PARAMETER_PREFIX
SECTION = "hf_knorm"
LEGACY_MIX_FIELD = "window_mix"
"""Where releases before the normalization families kept a window mix (the config's section; now a parameter)."""


def query_heads(module: nn.Module) -> int:
    """The query heads of an attention module (its own count where it keeps one, else its config's)."""
    for name in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(module, name, None), int):
            return getattr(module, name)
    return module.config.num_attention_heads


def kv_heads(module: nn.Module) -> int:
    """The KV heads of an attention module (its config's ``num_key_value_heads``, else its query heads)."""
    return getattr(module.config, "num_key_value_heads", None) or query_heads(module)


def add_parameters(model: nn.Module, normalization: Normalization) -> None:
    """Register ``normalization``'s learnable values on each attention module of ``model`` that lacks them, at their
    initial values (:func:`initial_values`), on the device and in the dtype of the module's weights; with
    ``+ clusters C``, the cluster codebook too (zeros until fitted: :mod:`.cluster_codebook`; never trained)."""
    for _, module in attention_modules(model):
        weight = next(module.parameters())
        names = list(normalization.learnable()) + ([CODEBOOK] if normalization.clusters else [])
        for name in names:
            if PREFIX + name not in module._parameters:
                value = initial_values(module, normalization, name).to(weight.device, weight.dtype)
                module.register_parameter(PREFIX + name, nn.Parameter(value, requires_grad=name != CODEBOOK))


def initial_values(module: nn.Module, normalization: Normalization, name: str) -> torch.Tensor:
    """``(H_q,)`` fp32: the family's initial value, or for a window mix kept in a format-1 config, that layer's mix;
    for the cluster codebook, ``(H_kv, C, D)`` zeros (not fitted)."""
    if name == CODEBOOK:
        return torch.zeros(kv_heads(module), normalization.clusters, module.head_dim, dtype=torch.float32)
    legacy = (getattr(module.config, SECTION, None) or {}).get(LEGACY_MIX_FIELD)
    if name == MIX and legacy is not None:
        return torch.tensor(legacy[module.layer_idx], dtype=torch.float32)
    return torch.full((query_heads(module),), float(normalization.learnable()[name]), dtype=torch.float32)


def _configured_normalization(config) -> Normalization | None:
    section = getattr(config, SECTION, None) or {}
    spelling = section.get("normalization") if isinstance(section, dict) else None
    return None if spelling is None else parse_normalization(spelling)


def hold_normalization(model: nn.Module, normalization: Normalization | None) -> None:
    """Make every attention module of ``model`` hold ``normalization`` (``None``: nothing), what the attention reads
    at run time (:mod:`hf_knorm.attention.held`)."""
    for _, module in attention_modules(model):
        hold(module, normalization)


def _add_when_built(model: nn.Module) -> None:
    """The build hook: a model whose config is patched holds its normalization (parsed here, once) and gets the
    values its family learns; one built with a ``p = 1`` normalization makes ``generate`` choose its state cache
    (installed by the first such model)."""
    normalization = _configured_normalization(getattr(model, "config", None))
    if normalization is None:
        return  # a model that never met the plugin: nothing happens
    if is_linear(normalization):
        register_state_decoding()
    try:
        hold_normalization(model, normalization)
        if normalization.learnable():
            add_parameters(model, normalization)
    except ValueError:  # a sub-model holding no attention of a known architecture: its parent adds them
        return


def _initialize_missing(module: nn.Module) -> None:
    """The initialization hook: values a checkpoint lacks start at :func:`initial_values` (not uninitialized)."""
    normalization = None
    for name, parameter in module._parameters.items():
        if name.startswith(PREFIX) and not getattr(parameter, "_is_hf_initialized", False):
            normalization = normalization or _configured_normalization(module.config)
            with torch.no_grad():
                parameter.copy_(initial_values(module, normalization, name[len(PREFIX):]).to(parameter))


def register() -> None:
    """Give every model built from a patched config its learnable values (``import hf_knorm`` calls it: a plain
    ``from_pretrained`` of a patched checkpoint runs no plugin call before its weights load; idempotent)."""
    add_parameters_when_built(_add_when_built, _initialize_missing)


def remove_parameters(model: nn.Module) -> None:
    """Remove every value :func:`add_parameters` registered."""
    for _, module in attention_modules(model):
        for name in [name for name in module._parameters if name.startswith(PREFIX)]:
            del module._parameters[name]


def learned_values(model: nn.Module, name: str) -> list[torch.Tensor]:
    """The ``(H_q,)`` values of ``name`` per attention layer, in layer order (detached copies)."""
    values = []
    for _, module in attention_modules(model):
        parameter = module._parameters.get(PREFIX + name)
        if parameter is None:
            raise ValueError(f"The model's attention has no learned {name!r} ({PREFIX + name}).")
        values.append(parameter.detach().clone())
    return values


def set_learned_values(model: nn.Module, name: str, values) -> None:
    """Write ``values`` (one ``(H_q,)`` sequence per attention layer) into ``name``'s parameters, in place.

    Raises:
        ValueError: the model has no such parameter, or the number of layers or heads is not the model's, or a
            value is not finite.
    """
    modules = [module for _, module in attention_modules(model)]
    if len(values) != len(modules):
        raise ValueError(f"The model has {len(modules)} attention layers; got {name} values for {len(values)}.")
    for index, (layer, module) in enumerate(zip(values, modules)):
        parameter = module._parameters.get(PREFIX + name)
        if parameter is None:
            raise ValueError(f"The model's attention has no learned {name!r} ({PREFIX + name}).")
        layer = torch.as_tensor(layer, dtype=torch.float64)  # python floats are doubles: keep them exactly
        if layer.shape != parameter.shape:
            raise ValueError(f"Layer {index} has {parameter.shape[0]} query heads; got {tuple(layer.shape)} {name} "
                             "values.")
        if not bool(torch.isfinite(layer).all()):
            raise ValueError(f"Layer {index}'s {name} is not finite: {layer.tolist()}.")
        with torch.no_grad():
            parameter.copy_(layer.to(parameter.dtype))
