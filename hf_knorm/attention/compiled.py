"""The attention as a PyTorch custom op, so that ``torch.compile`` takes it whole and computes what eager mode does.

Compiled code cannot branch on tensor values without a graph break, and the attention does, for speed: the chunked
kernel skips the keys no row of a chunk may attend (half of the work under a causal mask), and the path choice reads
the mask to know whether the linear kernel computes the same weights (``paths.py``). As custom ops
(``torch.library.custom_op``: ``hf_knorm::attention`` and its backward ``hf_knorm::attention_backward``), that eager
code runs unchanged inside a compiled graph: Dynamo sees one op whose output shape its fake implementation gives, the
compiler fuses what lies around it, and the attention's values are the eager ones.

The op serves the calls of training and inference: no attention dropout, no weights returned, and no tap set (norm
recorder, K/V transform, recurrent state, path log); ``interface.py`` sends the others, under compile, through the
kernels traced with their data-dependent shortcuts left out.

Backward: the chunked kernel's own backward (``kernel.chunked_backward``, from the saved output).

Autocast: a custom op runs under its caller's autocast state (at a compiled graph's runtime, the autocast around the
compiled model), and so do the kernels the ops call; each of them turns autocast off itself (:mod:`.full_precision`),
so the op computes in fp32 as in eager mode.

The linear kernel (``x/c`` with a causal mask) is not in the op where the mask is key padding or ``None``
(:mod:`.masks`, every plain causal model call): its form says the call is causal, so ``interface.py`` traces the
linear kernel itself, forward and backward (autograd), with no data-dependent branch. Only an explicit 4-D mask (a
user's, whose structure traced code cannot read) reaches the op with ``x/c``: there the linear kernel runs in
inference, after the op's eager check, and the quadratic one when gradients are needed (the same weights).
"""

from __future__ import annotations

import torch

from .kernel import chunked_backward, chunked_forward
from .linear_kernel import linear_attention
from ..normalizations import Normalization, parse_normalization
from .paths import choose_path, linear_keys


def compiled_attention(query, key, value, allowed, bias, normalization: Normalization, *, scaling: float | None,
                       softcap: float | None, causal: bool, params: dict | None = None) -> torch.Tensor:
    """The attention of one call through the custom op: output ``(B, q, H_q, D_v)`` in the query dtype.

    Arguments as :func:`hf_knorm.attention.kernel.chunked_attention` takes them (``allowed`` bool or ``None``,
    ``bias`` an additive float mask or ``None``, ``params`` the family's learnable values). The op carries the
    normalization as its spelling (a constant of the graph) and the learnable values as tensors.
    """
    if normalization.window:
        raise ValueError(f"The attention op computes one normalization over the mask; {normalization.name} needs its "
                         "softmax window: hf_knorm.attention.window.window_attention.")
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    softcap = None if softcap is None else float(softcap)
    values = [params[name] for name in normalization.learnable()] if params else []
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *values))
    _BY_NAME.setdefault(normalization.name, normalization)  # what the op reads back from the spelling it carries
    output = attention_op(query, key, value, allowed, bias, values, normalization.name, scaling, softcap, causal,
                          not differentiable)
    return output.to(query.dtype)


_BY_NAME: dict[str, Normalization] = {}
"""The normalizations :func:`compiled_attention` has handed the op, by spelling: the op carries the spelling (a graph
constant; a custom op takes no Python object) and reads the typed object back here, never parsing it."""


def _params(spelling: str, values: list[torch.Tensor]) -> tuple[Normalization, dict[str, torch.Tensor]]:
    normalization = _BY_NAME.get(spelling)
    if normalization is None:  # a graph traced in another process (an exported program): parsed once, then held
        normalization = _BY_NAME.setdefault(spelling, parse_normalization(spelling))
    return normalization, dict(zip(normalization.learnable(), values))


def _nonzero(bias: torch.Tensor | None) -> torch.Tensor | None:
    """An all-zero bias is none (as eager mode's ``split_mask`` has it), which keeps the linear path open."""
    return bias if bias is not None and bool(bias.any()) else None


def _linear_inputs(query, key, value, allowed, bias, normalization, softcap, causal):
    """``(key, value, key_valid)`` for the linear kernel when it computes this call exactly, else ``None``."""
    path = choose_path(normalization, query.shape[2], key.shape[2], allowed, bias, causal=causal, softcap=softcap,
                       dropout=0.0, return_weights=False, has_state=False)
    if not path.linear:
        return None
    return (*linear_keys(query, key, value, allowed, causal), path.key_valid)


@torch.library.custom_op("hf_knorm::attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                 bias: torch.Tensor | None, values: list[torch.Tensor], spelling: str, scaling: float,
                 softcap: float | None, causal: bool, linear_ok: bool) -> torch.Tensor:
    """Output ``(B, q, H_q, D_v)`` in the compute dtype (fp32, fp64 for fp64 inputs). ``values``: the learnable
    values of the family ``spelling`` names, in its order; ``linear_ok``: the linear kernel may compute the call (no
    gradient will be asked for)."""
    normalization, params = _params(spelling, values)
    bias = _nonzero(bias)
    compute = torch.promote_types(query.dtype, torch.float32)
    linear = _linear_inputs(query, key, value, allowed, bias, normalization, softcap, causal) if linear_ok else None
    if linear is not None:
        key, value, key_valid = linear
        return linear_attention(query, key, value, key_valid, normalization, scaling=scaling).to(compute).contiguous()
    return chunked_forward(query, key, value, allowed, normalization, bias=bias, scaling=scaling, softcap=softcap,
                           causal=causal, params=params).contiguous()


@attention_op.register_fake
def _attention_shape(query, key, value, allowed, bias, values, spelling, scaling, softcap, causal, linear_ok):
    batch, q_heads, q_len = query.shape[:3]
    return query.new_empty((batch, q_len, q_heads, value.shape[-1]), dtype=torch.promote_types(query.dtype, torch.float32))


@torch.library.custom_op("hf_knorm::attention_backward", mutates_args=())
def attention_backward_op(grad_output: torch.Tensor, output: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, allowed: torch.Tensor | None, bias: torch.Tensor | None,
                          values: list[torch.Tensor], spelling: str, scaling: float, softcap: float | None,
                          causal: bool) -> list[torch.Tensor]:
    """Gradients of :func:`attention_op` (computed with ``linear_ok=False``) with respect to query, key, value and
    then each of ``values``."""
    normalization, params = _params(spelling, values)
    grads = chunked_backward(grad_output, query, key, value, output, allowed, normalization, bias=_nonzero(bias),
                             scaling=scaling, softcap=softcap, causal=causal, params=params)
    return [grad.contiguous() for grad in grads]


@attention_backward_op.register_fake
def _attention_backward_shape(grad_output, output, query, key, value, allowed, bias, values, *options):
    return [t.new_empty(t.shape) for t in (query, key, value, *values)]  # contiguous, as the real gradients are


def _setup_context(ctx, inputs, output):
    query, key, value, allowed, bias, values, *options, linear_ok = inputs
    ctx.save_for_backward(query, key, value, allowed, bias, output, *values)
    ctx.options, ctx.linear_ok = options, linear_ok


def _backward(ctx, grad_output):
    if ctx.linear_ok:  # compiled_attention passes linear_ok only where no gradient is needed
        raise RuntimeError("hf_knorm::attention was called with linear_ok=True, so it has no gradient.")
    query, key, value, allowed, bias, output, *values = ctx.saved_tensors
    grads = attention_backward_op(grad_output, output, query, key, value, allowed, bias, values, *ctx.options)
    return (*grads[:3], None, None, grads[3:], *[None] * (1 + len(ctx.options)))


attention_op.register_autograd(_backward, setup_context=_setup_context)
