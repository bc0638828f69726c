"""``RecurrentStateCache``: decode a ``p = 1`` model (``x/1``, ``x/16``) with a constant-size state instead of K/V.

With ``p = 1`` the attention output of a new token is ``(scaling / c) * q^T S`` with ``S = sum_j k_j v_j^T`` over the
tokens before it and itself (:mod:`hf_knorm.attention.linear_kernel`), so a layer needs ``S``, a ``D x D_v`` matrix
per KV head (fp32), and for ``x/sqrtN`` the count of valid tokens, whatever the length of the context. On the default
model (30 layers, 3 KV heads, head dim 64) that is 1.5 MB per sequence: the fp32 K/V cache of 32 tokens.

Its layers are :class:`~.state.RecurrentStateLayer` (the state) or, for a normalization with a softmax window,
:class:`~.window_cache.WindowStateLayer` (the window's keys and values beside the state).

How it runs through Transformers' Cache API. ``update`` returns only the step's own keys and values to the attention
and hands the layer's state over to the plugin's attention function (:mod:`hf_knorm.attention.taps`, paired by the
identity of the key tensor); the attention reads the state, computes the step's outputs on the linear path (padded
keys excluded through the mask) and writes the new state back. ``get_mask_sizes`` covers the step's tokens alone,
offset by the tokens before them, so the causal and padding masks that Transformers builds stay right (left-padded
batches included); ``get_seq_length`` counts every token, so positions stay true.

Beam search reorders the states; contrastive search selects them. What cannot work is refused: cropping (assisted or
speculative decoding rewinds the cache), a model whose attention is not the plugin's with a ``p = 1`` normalization,
sliding-window layers. A layer whose attention does not take its state is an error at the end of the forward
(:func:`watch_steps`, installed by :func:`hf_knorm.patch` and by ``generate`` when it decodes with a state), or at the
latest at the cache's next ``update``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..attention.interface import ATTENTION_NAME
from ..attention.linear_kernel import is_linear
from ..normalizations import parse_normalization
from ..attention.taps import hand_over_state, pending_handover, taps_set
from ..compat import attn_implementation_of, layer_types_and_kwargs
from .sparse_cache import SparseWindowStateLayer
from .state import RecurrentStateLayer
from .window_cache import WindowStateLayer

__all__ = ["RecurrentStateCache", "decodes_with_state", "state_layer", "unwatch_steps", "watch_steps"]


class RecurrentStateCache(Cache):
    """A cache of linear-attention states for a model patched with ``x/1``, ``x/16`` (any ``p = 1``).

    ``generate`` uses one automatically on such a model (:mod:`hf_knorm.recurrent.generation`); pass one yourself as
    ``cache=RecurrentStateCache(config=model.config)`` (``past_key_values=`` before Transformers 5.24).

    Args:
        config: the model's config. With it the cache checks that the model decodes with the plugin's attention and a
            ``p = 1`` normalization and has no sliding-window layers, and builds one layer per decoder layer (a
            :class:`~.window_cache.WindowStateLayer` for a normalization with a softmax window); without it, layers
            are created on first use (pure states).

    Raises:
        ValueError: the config selects another attention or normalization, or has sliding-window layers.
    """

    def __init__(self, config=None):
        layers = [] if config is None else [state_layer(config, index) for index in range(_checked_layers(config))]
        super().__init__(layers=layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Give layer ``layer_idx``'s state to the attention that follows; returns the step's ``(B, H_kv, q, D)``
        states unchanged.

        Raises:
            RuntimeError: an earlier layer's attention, this step's or the last step's, did not take its state (the
                model's attention is not the plugin's; :func:`watch_steps` reports it at the step's end already).
        """
        while len(self.layers) <= layer_idx:
            self.layers.append(RecurrentStateLayer(len(self.layers)))
        waiting = pending_handover()  # a layer of this cache, this step's or the last one's: its attention did not
        if (isinstance(waiting, RecurrentStateLayer) and waiting.layer_idx < len(self.layers)  # take the state
                and self.layers[waiting.layer_idx] is waiting):
            hand_over_state(None)
            raise _missed(waiting)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def nbytes(self) -> int:
        """Bytes held by every layer's state: constant in the context length."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, RecurrentStateLayer))


def _missed(layer: RecurrentStateLayer) -> RuntimeError:
    return RuntimeError(
        f"Layer {layer.layer_idx}'s attention did not read its recurrent state: a RecurrentStateCache needs a model "
        f"whose attention is hf_knorm's with a p = 1 normalization in every layer (hf_knorm.patch(model, 'x/1')). "
        f"Generate this model with a normal cache."
    )


def watch_steps(model: torch.nn.Module) -> None:
    """Check the state handover at the end of every forward of ``model`` (idempotent; :func:`hf_knorm.patch` calls it
    for ``p = 1`` normalizations, and ``generate`` when it picks a state: :mod:`.generation`).

    A forward hook that runs even when the forward raises (``always_call``): a state still pending then was handed
    over by a layer's ``update`` and never taken by its attention. After a forward that returned, that layer's output
    ignored the past (its attention was not the plugin's): a ``RuntimeError`` naming the layer, even for the last layer
    or a one-layer model, which no later ``update`` would reveal. After a forward that raised between an ``update`` and
    its attention, the handover is cleared, so the process-wide tap count (:func:`hf_knorm.attention.taps.taps_set`)
    drops back instead of keeping every later compiled attention on its slow path.
    """
    if not any(hook is _check_step_end for hook in model._forward_hooks.values()):
        model.register_forward_hook(_check_step_end, always_call=True)


def unwatch_steps(model: torch.nn.Module) -> None:
    """Remove :func:`watch_steps`'s hook."""
    for hook_id in [hook_id for hook_id, hook in model._forward_hooks.items() if hook is _check_step_end]:
        del model._forward_hooks[hook_id]
        model._forward_hooks_always_called.pop(hook_id, None)


def _check_step_end(module, args, output):
    if not taps_set():  # a plain flag (torch.compile reads it without a graph break): nothing pending anywhere
        return None
    waiting = pending_handover()
    if not isinstance(waiting, RecurrentStateLayer):
        return None
    hand_over_state(None)
    if output is None:  # the forward raised (PyTorch passes None): its own error propagates
        return None
    raise _missed(waiting)


def decodes_with_state(config) -> bool:
    """Whether a model of this config can decode with a :class:`RecurrentStateCache` (the plugin's attention, a
    ``p = 1`` normalization, full attention in every layer)."""
    try:
        _checked_layers(config)
    except ValueError:
        return False
    return True


def _checked_layers(config) -> int:
    """The number of decoder layers of a model that can decode with a state; raises ``ValueError`` saying why not."""
    config = config.get_text_config(decoder=True)
    normalization = (getattr(config, ATTENTION_NAME, None) or {}).get("normalization")
    implementation = attn_implementation_of(config)
    if implementation != ATTENTION_NAME or normalization is None:
        raise ValueError(f"RecurrentStateCache needs a model patched by hf_knorm with x/1 or x/16 "
                         f"(hf_knorm.patch(model, 'x/1')); this one runs attention {implementation!r}.")
    if not is_linear(parse_normalization(normalization)):
        raise ValueError(f"RecurrentStateCache needs a p = 1 normalization (x/1, x/16): with {normalization} the "
                         "attention of a new token needs every past key, so decode with a normal cache.")
    layer_types, _ = layer_types_and_kwargs(config)
    windowed = [index for index, kind in enumerate(layer_types) if kind != "full_attention"]
    if windowed:
        raise ValueError(f"RecurrentStateCache holds full causal attention only; layers {windowed} are "
                         f"{layer_types[windowed[0]]!r}. Generate with a normal cache.")
    return len(layer_types)


def state_layer(config, layer_idx: int) -> RecurrentStateLayer:
    """The state layer a model of this config decodes with: a :class:`~.sparse_cache.SparseWindowStateLayer` (the
    window, the sinks and the sparse cache beside the state) when its normalization has a sparse cache, a
    :class:`~.window_cache.WindowStateLayer` (the ``W`` last keys and values beside the state) when it has a softmax
    window, else a :class:`RecurrentStateLayer`."""
    spelling = (getattr(config.get_text_config(decoder=True), ATTENTION_NAME, None) or {}).get("normalization")
    normalization = parse_normalization(spelling) if spelling is not None else None
    if normalization is not None and normalization.sparse:
        return SparseWindowStateLayer(layer_idx, normalization.window, normalization.sparse, normalization.score)
    window = normalization.window if normalization is not None else 0
    return WindowStateLayer(layer_idx, window) if window else RecurrentStateLayer(layer_idx)
