"""One-call patching: route a model's attention through the plugin with a chosen normalization, and undo it.

The model *instance* is patched, never a class, and nothing but the model: it gets a config of its own (a deep
copy, held by every module that held the old one: :func:`own_config`), which gets a ``hf_knorm`` section
(normalization, the attention implementation it had, plugin version) and the attention implementation ``"hf_knorm"``,
the function :mod:`hf_knorm.attention.registration` registers with Transformers' ``AttentionInterface``. Saving such a
config writes ``"attn_implementation": "hf_knorm"`` into ``config.json`` (the registration makes every save path do
so), which ``from_pretrained`` reads back. ``generate`` decodes a model patched with a ``p = 1`` normalization (``x/1``,
``x/16``) with a constant-size state (:mod:`hf_knorm.recurrent.generation`, from the config: loaded models too).
"""

from __future__ import annotations

import copy
import warnings

import torch.nn as nn
from transformers import PretrainedConfig

from ..attention.held import held_by
from ..attention.interface import ATTENTION_NAME
from ..attention.linear_kernel import is_linear
from ..normalizations import Normalization, parse_normalization, with_window
from ..normalizations.registry import RECORD_FORMAT
from ..attention.paths import LINEAR_POLICIES
from ..compat import attn_implementation_of
from ..recurrent.cache import unwatch_steps, watch_steps
from ..recurrent.generation import register as register_state_decoding
from ..version import __version__
from .architectures import architecture_of, attention_modules
from .parameters import LEGACY_MIX_FIELD, add_parameters, hold_normalization, remove_parameters

SECTION = "hf_knorm"
SECTION_KEYS = ("normalization", "normalization_record", "format", "original_attn_implementation", "linear",
                LEGACY_MIX_FIELD)
"""The section's entries :func:`patch` writes and :func:`unpatch` removes (``version`` stays with other users')."""


def patch(model: nn.Module, normalization: str | Normalization, *, linear: str = "auto",
          softmax_window: int | None = None, attention_sinks: int | None = None) -> nn.Module:
    """Replace softmax in ``model``'s attention by ``normalization``; returns the same model.

    The model gets a config of its own first (:func:`own_config`): ``model.config`` is a new object afterwards, and
    whatever else held the old one (the config the model was built from, other models built from it) is unchanged.

    Args:
        model: a Transformers model of a supported architecture
            (``hf_knorm.models.architectures.SUPPORTED_ARCHITECTURES``).
        normalization: a :class:`~hf_knorm.normalizations.Normalization` (``hf_knorm.normalizations.Sigmoid()``) or
            its spelling (``"sigmoid(bias=-log n)"``, ``"x^3/16"``, ``"x^3/16 + softmax window 64"``; the families
            and their spellings: ``hf_knorm.list_normalizations()``). A family's learnable values become
            ``nn.Parameter``s of each attention module (``hf_knorm_<name>``, :mod:`hf_knorm.models.parameters`), in
            ``state_dict``.
        softmax_window: ``W``: the keys of each query's last ``W`` positions are weighted by softmax over them, the
            older keys by ``normalization`` (:mod:`hf_knorm.attention.window`); decoders only. ``0`` or ``None``: the
            pure normalization (``None`` keeps a window the spelling names). Saved in the config as part of the
            normalization's name (``"x^3/16 + softmax window 64"``).
        attention_sinks: ``S``: each sequence's first ``S`` keys are weighted by softmax with the window and read by
            no polynomial part (StreamingLLM's attention sinks, arXiv 2309.17453); needs a window. ``None`` keeps the
            ones the spelling names (``"x^3/16 + softmax window 64 + sinks 4"``), else 0.
        linear: for a ``p = 1`` normalization, what a call that cannot take the linear-time path does
            (:mod:`hf_knorm.attention.paths`): ``"auto"`` computes it with the quadratic kernel (warning once per
            reason from 4k queries on), ``"require"`` raises. Saved in the config with the normalization.

    Raises:
        ValueError: unsupported architecture, unknown normalization or ``linear`` policy, ``linear="require"`` with a
            normalization that has no linear path, a softmax window or sinks that are not an integer >= 0, a window
            on softmax or on an encoder, sinks without a window or on a model with sliding-window layers, or a model already patched with a different normalization (call :func:`unpatch` first).
            Patching again with the same one warns and does nothing.
    """
    architecture = architecture_of(model)
    normalization = parse_normalization(normalization)
    if softmax_window is not None or attention_sinks is not None:
        window = normalization.window if softmax_window is None else softmax_window
        normalization = with_window(normalization, window, attention_sinks)
    if normalization.window and not architecture.causal:
        raise ValueError(f"{normalization.name}: a softmax window weights the keys before each query, and "
                         f"{architecture.model_type} attends both ways. Patch it without softmax_window.")
    _refuse_sliding_layers(model, normalization)
    if linear not in LINEAR_POLICIES:
        raise ValueError(f"linear={linear!r} is not a policy; choose one of {', '.join(LINEAR_POLICIES)}.")
    if linear == "require" and not is_linear(normalization):
        raise ValueError(f"linear='require' needs a p = 1 normalization (x/1, x/16, x/sqrtN); {normalization.name} "
                         "has no linear-time path.")
    current = patched_normalization(model)
    if current is not None:
        if current == normalization.name:
            warnings.warn(f"The model is already patched with {current}; nothing to do.", stacklevel=2)
            return model
        raise ValueError(
            f"The model is already patched with {current}. Call hf_knorm.unpatch(model) before patching it with "
            f"{normalization.name}: normalizations are not stacked."
        )
    original = attn_implementation_of(model.config)
    own_config(model)  # the section below goes into the model's own config, not one it shares
    for config in _configs(model):
        section = dict(getattr(config, SECTION, None) or {})
        section.update(normalization=normalization.name, normalization_record=normalization.to_record(),
                       format=RECORD_FORMAT, original_attn_implementation=original, version=__version__)
        if linear != "auto":
            section["linear"] = linear
        setattr(config, SECTION, section)
    model.set_attn_implementation(ATTENTION_NAME)
    hold_normalization(model, normalization)  # what the attention reads at run time (attention/held.py)
    add_parameters(model, normalization)
    if is_linear(normalization):  # generate decodes it with a constant-size state (hf_knorm.recurrent.generation)
        register_state_decoding()  # the generate wrap, installed by the first such model (idempotent)
        watch_steps(model)  # a layer that misses its state is an error at the step's end
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Give ``model`` back its own attention implementation exactly; returns the same model.

    The plugin's keys leave the config :func:`patch` gave the model, which stays the model's own (held by the same
    modules): ``model.config.to_dict()`` is what it was before :func:`patch`, and it shares no object with the config
    it was built from.

    Raises:
        ValueError: the model is not patched.
    """
    current = patched_normalization(model)
    if current is None:
        raise ValueError("The model is not patched by hf_knorm; there is nothing to undo.")
    original = model.config.hf_knorm.get("original_attn_implementation") or "sdpa"
    model.set_attn_implementation(original)
    unwatch_steps(model)
    hold_normalization(model, None)
    remove_parameters(model)
    for config in _configs(model):
        section = dict(getattr(config, SECTION, None) or {})
        for key in SECTION_KEYS:
            section.pop(key, None)
        if set(section) <= {"version"}:
            config.__dict__.pop(SECTION, None)
        else:
            setattr(config, SECTION, section)
    return model


def sliding_window_of(attention: nn.Module) -> int | None:
    """The sliding window Transformers hands ``attention``'s calls (``sliding_window=``), ``None`` for a full layer:
    the module's own attribute where it has one (Qwen2, Gemma2/3 set it per layer type), else its config's (Mistral
    and Phi-3 pass ``config.sliding_window`` on every layer)."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(attention.config, "sliding_window", None)


def _refuse_sliding_layers(model: nn.Module, normalization: Normalization) -> None:
    """Raise when ``normalization`` has attention sinks or a sparse cache and ``model`` has a layer with its own sliding
    window: both keep pairs along each sequence (its first tokens; pairs older than the softmax window) that such a
    layer's mask and cache leave behind (the attention functions refuse such a call too, for a model whose config was
    patched elsewhere: :func:`hf_knorm.attention.window.window_path`, :mod:`hf_knorm.attention.sparse`)."""
    if not (normalization.sinks or normalization.sparse):
        return
    sliding = {name: window for name, module in attention_modules(model)
               if (window := sliding_window_of(module)) is not None}
    if not sliding:
        return
    name, window = next(iter(sliding.items()))
    layers = (f"{len(sliding)} attention layers of this {model.config.model_type} model have their own sliding window "
              f"({name}: {window} positions), which leaves them behind.")
    if normalization.sinks:
        also = (" and without the sparse cache (hf-knorm convert --attention-sinks 0 --sparse-cache 0: the softmax "
                "window alone)" if normalization.sparse else " (attention_sinks=0; hf-knorm convert --attention-sinks 0: "
                "the softmax window alone)")
        raise ValueError(f"{normalization.name}: attention sinks are each sequence's first {normalization.sinks} "
                         f"tokens, and {layers} Patch it without attention_sinks{also}, or use a model without "
                         "sliding-window layers.")
    raise ValueError(f"{normalization.name}: a sparse cache keeps pairs older than the softmax window, and {layers} "
                     "Patch it without the sparse cache (hf-knorm convert --sparse-cache 0), or use a model without "
                     "sliding-window layers.")


def own_config(model: nn.Module) -> None:
    """Give ``model`` configs of its own: every config object its modules hold is replaced by a deep copy.

    Why: Transformers' ``from_config(config)`` keeps ``config`` itself as ``model.config`` (and as ``model.model``'s,
    each attention module's, the rotary embedding's), so writing the plugin's section and attention implementation
    into it would patch every model built from that config, before and after (a teacher, a reference model, the next
    model of a sweep). The configs are copied together (one ``copy.deepcopy`` memo), so whatever shared one config
    object shares its one copy, and a sub-config stays the object its parent holds (``config.text_config`` and the
    language model's ``config``), which ``set_attn_implementation`` relies on to reach every sub-model. Attributes
    are replaced where a module holds them (its ``__dict__``): a wrapper that forwards ``config`` to the model it
    wraps (PEFT's ``PeftModel``) reads the copy. ``model.generation_config`` is not a config of the model and stays.
    """
    holders = [(module, name, value) for module in model.modules() for name, value in vars(module).items()
               if isinstance(value, PretrainedConfig)]
    originals = list({id(config): config for _, _, config in holders}.values())
    copies: dict[int, object] = {}
    copy.deepcopy(originals, copies)  # the memo maps id(original) -> copy, sub-configs included
    for module, name, config in holders:
        setattr(module, name, copies[id(config)])


def patched_normalization(model: nn.Module) -> str | None:
    """The normalization ``model`` is patched with (canonical spelling), or ``None``."""
    section = getattr(model.config, SECTION, None) or {}
    return section.get("normalization")


def held_normalization(model: nn.Module) -> Normalization | None:
    """The typed normalization ``model``'s attention computes (what its attention modules hold:
    :mod:`hf_knorm.attention.held`), or ``None`` for a model that is not patched."""
    return next((held_by(module) for _, module in attention_modules(model)), None)


def _configs(model: nn.Module) -> list:
    """The model's config and every distinct config its attention modules read."""
    configs = {id(model.config): model.config}
    for _, module in attention_modules(model):
        configs.setdefault(id(module.config), module.config)
    return list(configs.values())
