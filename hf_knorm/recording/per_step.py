"""Per-layer attention and K/V norms of one optimizer step, accumulated on the device from inside the attention.

:class:`StepNormRecorder` is the recorder :class:`~hf_knorm.training.callback.NormLoggerCallback` activates for the
forward passes of a logging step (every micro-batch of it). The plugin's attention function calls
:meth:`StepNormRecorder.record` once per layer and micro-batch; each call adds a few sums to a per-layer row of a
device tensor, with no host synchronization. :meth:`StepNormRecorder.finish` reduces the rows across processes (one
``all_reduce`` of the sums, one of the maxima) and copies them to the host once.

The statistics, per layer (``STATISTICS``):

- ``attn_fro``: Frobenius norm of each attention matrix ``A`` of shape ``(q, kv)``, one per (batch item, query head),
  post-normalization and post-mask (masked pairs are 0), before attention dropout; the mean over all matrices of
  the step (every micro-batch, every process).
- ``attn_fro_max``: the largest of those matrix norms.
- ``attn_fro_sqrtn``, ``attn_fro_sqrtn_max``: the same for ``||A||_F / sqrt(N)``, ``N`` the number of query rows
  that attend at least one key (the real tokens of the item). Each softmax row is a probability vector, so
  ``||A||_F <= sqrt(N)`` and this ratio is at most 1 under softmax.
- ``key_norm``, ``value_norm``: mean L2 norm of one token's key (value) vector of one KV head, ``(head_dim,)``,
  post-RoPE as the attention reads it, over the real (unpadded) tokens and the KV heads.
- ``kv_ratio``: ``key_norm / value_norm``.

Non-finite values propagate: a NaN or inf anywhere in a layer's matrices or K/V makes that layer's statistic NaN
or inf, on every process.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..attention.masks import attended_keys, attending_rows
from ..attention.taps import activate_recorder, deactivate_recorder

STATISTICS = ("attn_fro", "attn_fro_max", "attn_fro_sqrtn", "attn_fro_sqrtn_max", "key_norm", "value_norm", "kv_ratio")

# Columns of the per-layer sums and maxima.
_FRO, _FRO_SQRTN, _MATRICES, _KEY, _VALUE, _KV_VECTORS = range(6)
_FRO_MAX, _FRO_SQRTN_MAX = range(2)


class StepNormRecorder:
    """Accumulates the per-layer statistics of the forward passes run while it is active.

    Each layer counts at most once per forward pass of ``model``: a forward pre-hook on ``model`` (installed by
    :meth:`start`, removed by :meth:`stop`) numbers its forward passes, and a layer that reports again within the
    same one is not counted. Gradient checkpointing recomputes a layer's forward during the backward pass, where no
    new forward pass of the model has begun, so the recomputation is not counted twice (reentrant and non-reentrant
    checkpointing alike). A model that runs one attention module several times per forward pass (shared layers) is
    therefore counted once per pass.

    Args:
        model: the model whose forward passes are recorded (the Trainer's ``model``; called through ``__call__``).
        layers: its attention modules in layer order (``hf_knorm.models.architectures.attention_modules``).

    Examples:
        >>> recorder = StepNormRecorder(model, [m for _, m in attention_modules(model)])
        >>> recorder.start()
        >>> model(**batch)          # routed through the plugin (patched, or ``routed_through_plugin``)
        >>> recorder.stop()
        >>> recorder.finish()[3]["attn_fro"]
    """

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module]):
        self._model = model
        self._index = {id(module): i for i, module in enumerate(layers)}
        self.num_layers = len(layers)
        self._forwards = 0  # forward passes of the model since start()
        self._reported_in = [-1] * self.num_layers  # the forward pass each layer last reported in
        self._forward_hook = None
        self._sums: torch.Tensor | None = None  # (L, 6)
        self._maxes: torch.Tensor | None = None  # (L, 2)
        self._token = None

    @property
    def active(self) -> bool:
        return self._token is not None

    def start(self) -> None:
        """Clear the accumulators and become the recorder the attention reports to."""
        if self.active:
            raise RuntimeError("This StepNormRecorder is already active.")
        self._sums = self._maxes = None
        self._forwards = 0
        self._reported_in = [-1] * self.num_layers
        self._forward_hook = self._model.register_forward_pre_hook(self._count_forward)
        self._token = activate_recorder(self)

    def stop(self) -> None:
        """Stop receiving reports (the accumulated sums are kept for :meth:`finish`)."""
        if self.active:
            deactivate_recorder(self._token)
            self._token = None
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _count_forward(self, module, args) -> None:
        self._forwards += 1

    def records(self, module) -> bool:
        """Whether ``module`` is one of the layers this recorder was built for."""
        return id(module) in self._index

    def record(self, module, key, value, allowed, frobenius_sq) -> None:
        """Called by the attention function, once per layer and forward pass.

        Args:
            module: the calling attention module.
            key, value: ``(B, H_kv, kv, D)`` as attended (post-RoPE).
            allowed: the mask as the attention read it (:data:`hf_knorm.attention.masks.Mask`): bool ``(B or 1,
                1 or H_q, q, kv)`` (True = attend), key padding, or ``None`` (everything attended; the query rows are
                then the ``kv`` tokens: a training forward pass, self-attention without a cache).
            frobenius_sq: ``(B, H_q)`` squared Frobenius norms of the attention matrices.
        """
        index = self._index.get(id(module))
        if index is None:
            raise RuntimeError(f"{type(module).__name__} is not one of the layers this StepNormRecorder was built for.")
        if self._reported_in[index] == self._forwards:  # gradient checkpointing recomputing it: already counted
            return
        self._reported_in[index] = self._forwards
        batch, heads = frobenius_sq.shape
        kv_len = key.shape[2]
        dtype = torch.float32 if key.device.type == "mps" else torch.float64
        if self._sums is None:
            self._sums = torch.zeros(self.num_layers, 6, dtype=dtype, device=key.device)
            self._maxes = torch.full((self.num_layers, 2), -math.inf, dtype=dtype, device=key.device)

        fro = frobenius_sq.detach().to(dtype).sqrt()  # (B, H_q)
        rows = attending_rows(allowed, batch, heads, kv_len, dtype, key.device)  # (B, H_q)
        counted = rows > 0  # an item with no real token has no attention matrix to speak of
        fro_sqrtn = fro / rows.clamp(min=1).sqrt()

        tokens = attended_keys(allowed, batch, kv_len, key.device)  # (B, kv)
        weights = tokens.to(dtype)[:, None, :]  # (B, 1, kv)
        compute = torch.promote_types(key.dtype, torch.float32)  # per-vector norms in fp32, sums in fp64
        key_norms = key.detach().to(compute).norm(dim=-1).to(dtype)  # (B, H_kv, kv)
        value_norms = value.detach().to(compute).norm(dim=-1).to(dtype)
        zero = fro.new_zeros(())
        sums = torch.stack([
            torch.where(counted, fro, zero).sum(),
            torch.where(counted, fro_sqrtn, zero).sum(),
            counted.sum().to(dtype),
            (key_norms * weights).sum(),
            (value_norms * weights).sum(),
            tokens.sum().to(dtype) * key.shape[1],
        ])
        low = fro.new_full((), -math.inf)
        maxes = torch.stack([torch.where(counted, fro, low).max(), torch.where(counted, fro_sqrtn, low).max()])
        self._sums[index] += sums
        # torch.maximum propagates NaN, so a NaN matrix norm is never hidden by a larger finite one
        self._maxes[index] = torch.maximum(self._maxes[index], maxes)

    def finish(self) -> list[dict[str, float]]:
        """Reduce across processes (when ``torch.distributed`` is initialized) and return one dict per layer.

        Every process must call it at the same step. Means weight every process's matrices and tokens alike, so
        the result equals that of one process holding the whole global batch.

        Raises:
            RuntimeError: a layer received no report (its attention did not run through hf_knorm).
        """
        if self._sums is None:
            raise RuntimeError(
                "No attention layer reported norms during this step: the model's attention did not run through "
                "hf_knorm (was attn_implementation changed after patching?)."
            )
        sums, maxes = self._sums, self._maxes
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            nan_maxes = maxes.isnan().to(sums.dtype)  # MAX reductions need not propagate NaN: count them instead
            packed = torch.cat([sums, nan_maxes], dim=1)
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            maxes = torch.nan_to_num(maxes, nan=-math.inf)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            sums = packed[:, :6]
            maxes = torch.where(packed[:, 6:] > 0, torch.full_like(maxes, math.nan), maxes)
        sums, maxes = sums.cpu().tolist(), maxes.cpu().tolist()
        self._sums = self._maxes = None
        layers = []
        for index, (row, row_max) in enumerate(zip(sums, maxes)):
            if row[_MATRICES] == 0 or row[_KV_VECTORS] == 0:
                raise RuntimeError(
                    f"Attention layer {index} reported no norms during this step: its attention did not run through "
                    "hf_knorm."
                )
            key_norm, value_norm = row[_KEY] / row[_KV_VECTORS], row[_VALUE] / row[_KV_VECTORS]
            layers.append({
                "attn_fro": row[_FRO] / row[_MATRICES],
                "attn_fro_max": row_max[_FRO_MAX],
                "attn_fro_sqrtn": row[_FRO_SQRTN] / row[_MATRICES],
                "attn_fro_sqrtn_max": row_max[_FRO_SQRTN_MAX],
                "key_norm": key_norm,
                "value_norm": value_norm,
                "kv_ratio": _ratio(key_norm, value_norm),
            })
        return layers


def _ratio(a: float, b: float) -> float:
    try:
        return a / b
    except ZeroDivisionError:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a)
