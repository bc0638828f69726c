"""The registry of supported architectures, keyed by ``config.model_type``.

Supported means tested: every entry has a tiny model built from its config in ``tests/`` (``tests/tiny_models.py``),
and a meta-test checks that each registered type is covered. All of them route attention through Transformers'
``AttentionInterface``, which is how the plugin replaces softmax without touching any model class.

To add an architecture: make sure its attention module calls ``ALL_ATTENTION_FUNCTIONS`` (families such as falcon,
bloom, gpt_neo or mpt do not), add an :class:`ArchitectureSpec` below, and a tiny config in ``tests/tiny_models.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class ArchitectureSpec:
    """What the plugin needs to know about one model family.

    Attributes:
        model_type: ``config.model_type``.
        attention_class: class name of the module that calls the attention interface (one per layer).
        causal: True for decoders (causal self-attention), False for encoders.
    """

    model_type: str
    attention_class: str
    causal: bool


_SPECS = (
    ArchitectureSpec("llama", "LlamaAttention", causal=True),
    ArchitectureSpec("mistral", "MistralAttention", causal=True),
    ArchitectureSpec("qwen2", "Qwen2Attention", causal=True),
    ArchitectureSpec("qwen3", "Qwen3Attention", causal=True),
    ArchitectureSpec("gemma2", "Gemma2Attention", causal=True),
    ArchitectureSpec("gemma3_text", "Gemma3Attention", causal=True),
    ArchitectureSpec("phi3", "Phi3Attention", causal=True),
    ArchitectureSpec("gpt2", "GPT2Attention", causal=True),
    ArchitectureSpec("gpt_neox", "GPTNeoXAttention", causal=True),
    ArchitectureSpec("bert", "BertSelfAttention", causal=False),
    ArchitectureSpec("vit", "ViTAttention", causal=False),
)

SUPPORTED_ARCHITECTURES: dict[str, ArchitectureSpec] = {spec.model_type: spec for spec in _SPECS}


def architecture_of(model_or_config) -> ArchitectureSpec:
    """Return the registry entry of a model (or config).

    Raises:
        ValueError: the model type is not supported; the message names the supported types and how to add one.
    """
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    spec = SUPPORTED_ARCHITECTURES.get(model_type)
    if spec is None:
        raise ValueError(
            f"hf_knorm does not support model_type {model_type!r}. Supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}. "
            "Architectures whose attention does not go through Transformers' AttentionInterface (e.g. falcon, bloom) "
            "cannot be supported; others can be added to hf_knorm/models/architectures.py with a tiny-model test."
        )
    return spec


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return ``(qualified name, module)`` of every attention module of ``model``, in layer order.

    Raises:
        ValueError: the architecture is unsupported, or none of its attention modules were found.
    """
    spec = architecture_of(model)
    found = [(name, module) for name, module in model.named_modules() if type(module).__name__ == spec.attention_class]
    if not found:
        raise ValueError(
            f"No {spec.attention_class} module found in this {spec.model_type} model; the installed Transformers "
            "may have renamed it. hf_knorm is tested with transformers 5.24."
        )
    return found
