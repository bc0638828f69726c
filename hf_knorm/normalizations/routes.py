"""How a family can be computed: the capabilities the attention paths read, declared by each family in its own file.

The attention dispatcher (:mod:`hf_knorm.attention.backends`) and the kernels never test a family's type; they ask the
normalization what it is:

- :class:`SoftmaxLogits` (:attr:`~.base.Normalization.softmax_logits`): the family is a softmax over modified logits,
  ``w_ij = e^{a_i s_ij} / (e^{sigma_h} + sum_k e^{a_i s_ik})``, with a row factor ``a_i`` (SSMax's
  ``s_h log n_i``, else 1) and an optional sink key of logit ``sigma_h`` and value 0. Any softmax kernel computes it
  exactly on modified inputs: SDPA (:mod:`hf_knorm.attention.sdpa`), FlashAttention, FlexAttention.
- :class:`Pointwise` (:attr:`~.base.Normalization.pointwise`): the weight of a key is an element-wise function of its
  score times a factor of its row's key count, ``w_ij = g(s_ij) r(n_i)``; no row normalization, so a streaming kernel
  carries nothing but its accumulator (the Triton kernel, :mod:`hf_knorm.attention.triton_kernel`), and with
  ``g(s) = s`` the causal sum runs in linear time (:mod:`hf_knorm.attention.linear_kernel`, flash-linear-attention).
  It also gives the hand-written derivative the PyTorch kernel's backward uses, and a plain reference.
- :class:`LogWeight` (:attr:`~.base.Normalization.log_weights`): the weight is non-negative and its logarithm an
  element-wise function of the score, the row's key count and the head's learned values, ``w_ij = e^{l(s_ij)}``. A
  softmax kernel that returns its log-sum-exp computes it exactly (FlexAttention, :mod:`hf_knorm.attention.flex`):
  with ``l`` as the score modification, ``sum_j w_ij v_j = out_i e^{lse_i}``. Odd powers ``s^p`` (negative weights)
  have no such form.
- :class:`LogWeightRatio` (:attr:`~.base.Normalization.log_weight_ratio`): the weight is a ratio of two
  non-negative element-wise weights with a floor, ``w_ij = e^{a(s_ij)} / (sum_k e^{b(s_ik)} + eps e^{m_i})`` with
  ``m_i = max(0, max_k s_ik)`` (softpick). Two softmax passes that return their log-sum-exp compute it exactly
  (FlexAttention): ``a`` as the score modification gives ``out_A`` and ``lse_A`` (and the row's largest ``a``, from
  which ``m_i`` follows), ``b`` gives ``lse_B``, and ``sum_j w_ij v_j = out_A e^{lse_A} / (e^{lse_B} + eps e^{m})``.
- :class:`StickBreak` (:attr:`~.base.Normalization.stick_break`): the weights break a stick from the row's most recent
  key backwards, ``w_ij = sigma(s_ij) prod_{k > j} (1 - sigma(s_ik))``; flash-linear-attention's stick-breaking
  kernel (``fla.ops.stickbreaking_attn``, :mod:`hf_knorm.attention.fla_stick_breaking`) computes it, carrying the
  log of the stick left as it walks a row's keys from the nearest back.
- :attr:`~.base.Normalization.row_normalizer`: what a family with none of these carries along a row (a running maximum
  and a denominator, or the whole row); the chunked kernel computes every family from whole rows.

A family's routes (:attr:`~.base.Normalization.fast_paths`) follow from these: a new family with a GPU route is its
file (declaring the capability) and its registry line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Learnable

ACTIVATIONS = ("power", "relu_power")
"""``g`` of :class:`Pointwise`: ``"power"`` ``s^p`` (odd powers keep the sign, "Rethinking Softmax"), ``"relu_power"``
``max(s, 0)^p`` (ReLU attention, squared ReLU)."""
ROW_RULES = ("constant", "n", "sqrtN")
"""``r(n_i)`` of :class:`Pointwise`: ``1 / c`` (a constant), ``1 / n_i`` or ``1 / sqrt(n_i)``."""


@dataclass(frozen=True)
class Pointwise:
    """``w_ij = g(s_ij) * r(n_i)`` on allowed pairs, 0 elsewhere (masked scores are zeroed before ``g``).

    Attributes:
        activation: ``g``, one of :data:`ACTIVATIONS`.
        power: ``p >= 1``.
        row_rule: ``r``, one of :data:`ROW_RULES`.
        inv_constant: ``1 / c`` for the ``"constant"`` rule (1.0 otherwise).
    """

    activation: str
    power: int
    row_rule: str = "constant"
    inv_constant: float = 1.0

    def __post_init__(self):
        if self.activation not in ACTIVATIONS or self.row_rule not in ROW_RULES or self.power < 1:
            raise ValueError(f"Pointwise weights take an activation of {ACTIVATIONS}, a power >= 1 and a row rule of "
                             f"{ROW_RULES}; got {self.activation!r}, {self.power}, {self.row_rule!r}.")

    @property
    def is_linear(self) -> bool:
        """``w = s / c`` or ``s / sqrt(n)``: linear attention (a running ``D x D_v`` state replaces the keys)."""
        return self.activation == "power" and self.power == 1 and self.row_rule != "n"

    @property
    def kernel_key(self) -> str:
        """What a compiled kernel's code depends on (the constant is a run-time scalar): e.g. ``"x^3/c"``,
        ``"relu(x)^2/n"``."""
        base = "x" if self.activation == "power" else "relu(x)"
        power = "" if self.power == 1 else f"^{self.power}"
        return f"{base}{power}/{'c' if self.row_rule == 'constant' else self.row_rule}"

    @property
    def log_form(self) -> LogWeight | None:
        """The same weights as :class:`LogWeight` where they are never negative (a rectified power; an even power),
        ``None`` for an odd power ``s^p`` (negative weights have no logarithm)."""
        if self.activation == "power" and self.power % 2:
            return None
        return LogWeight("log_power", self.power, rectified=self.activation == "relu_power", row_rule=self.row_rule,
                         inv_constant=self.inv_constant)

    def row_factor(self, counts: torch.Tensor) -> torch.Tensor:
        """``r(n_i)`` for key counts ``counts`` ``(..., q, 1)`` (at least 1), in their dtype."""
        if self.row_rule == "n":
            return counts.reciprocal()
        if self.row_rule == "sqrtN":
            return counts.rsqrt()
        return torch.full_like(counts, self.inv_constant)

    def reference(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The weights in their plainest form (what every fast path is tested against): ``scores`` ``(..., q, kv)``,
        ``allowed`` bool of the same shape."""
        kept = torch.where(allowed, scores, torch.zeros_like(scores))
        if self.activation == "relu_power":
            kept = kept.clamp_min(0.0)
        counts = allowed.sum(-1, keepdim=True).clamp_min(1).to(scores.dtype)
        return kept ** self.power * self.row_factor(counts)

    def derivative(self, scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """``dw/ds``: ``p g(s)^(p-1) g'(s) r(n_i)`` on allowed pairs, 0 elsewhere; of the shape of ``scores``."""
        kept = scores if allowed is None else scores * allowed
        if self.activation == "relu_power":
            kept = kept.clamp_min(0.0)
        if self.power == 1:
            slope = (kept > 0).to(scores.dtype) if self.activation == "relu_power" else torch.ones_like(scores)
            if allowed is not None:
                slope = slope * allowed
        else:
            slope = kept.pow(self.power - 1).mul_(self.power)
        counts = (scores.new_full((*scores.shape[:-1], 1), float(scores.shape[-1])) if allowed is None else
                  allowed.sum(dim=-1, keepdim=True, dtype=scores.dtype).expand(*scores.shape[:-1], 1).clamp_min(1.0))
        return slope.mul_(self.row_factor(counts))


@dataclass(frozen=True)
class SoftmaxLogits:
    """A softmax over modified logits: ``e^{a_i s_ij} / (e^{sigma_h} + sum_k e^{a_i s_ik})``.

    Attributes:
        log_n_scale: ``a_i = s_h log n_i`` with ``s_h`` this number, or learned per head (:class:`~.base.Learnable`:
            the family's learnable value ``scale``, SSMax); ``None``: ``a_i = 1``.
        sink: the sink key's logit ``sigma_h`` (its value 0), a number or learned per head (the family's learnable
            value ``sink``, gpt-oss's sinks); ``None``: no sink.
    """

    log_n_scale: float | Learnable | None = None
    sink: float | Learnable | None = None

    @property
    def is_plain(self) -> bool:
        """Softmax itself: no row factor, no sink."""
        return self.log_n_scale is None and self.sink is None

    def head_scale(self, params: Mapping[str, torch.Tensor] | None) -> torch.Tensor | float:
        """``s_h``: the learned ``(H_q,)`` values (``params["scale"]``) or the number."""
        return params["scale"] if isinstance(self.log_n_scale, Learnable) else self.log_n_scale

    def sink_logits(self, params: Mapping[str, torch.Tensor] | None, heads: int, like: torch.Tensor) -> torch.Tensor:
        """``sigma_h`` ``(H_q,)`` in ``like``'s dtype and on its device."""
        if isinstance(self.sink, Learnable):
            return params["sink"].to(like.dtype)
        return like.new_full((heads,), float(self.sink))


LOG_ACTIVATIONS = ("logsigmoid", "log_power")
"""``f`` of :class:`LogWeight`: ``"logsigmoid"`` ``log sigma(x)`` (sigmoid attention), ``"log_power"`` ``p log|x|``
(``-inf`` at 0; rectified: ``-inf`` for ``x <= 0``)."""
PER_ROW_SHIFT = "-log n"
"""The shift ``b_i = -log n_i`` of :class:`LogWeight` (sigmoid's per-row bias)."""


@dataclass(frozen=True)
class LogWeight:
    """``log w_ij = f(s_ij + b) + log r(n_i)``: the logarithm of a non-negative weight (``-inf`` for a weight 0).

    Attributes:
        activation: ``f``, one of :data:`LOG_ACTIVATIONS`.
        power: ``p >= 1`` of ``"log_power"``.
        rectified: ``"log_power"`` weighs ``s > 0`` only (``relu(s)^p``); else ``|s|^p`` (an even power's ``s^p``).
        shift: ``b`` added to the score first: ``None`` (0), a number, :data:`PER_ROW_SHIFT` (``-log n_i``) or
            learned per head (:class:`~.base.Learnable`: the family's learnable value ``bias``).
        row_rule: ``r``, one of :data:`ROW_RULES`; inv_constant: ``1 / c`` for the ``"constant"`` rule.
    """

    activation: str
    power: int = 1
    rectified: bool = False
    shift: float | str | Learnable | None = None
    row_rule: str = "constant"
    inv_constant: float = 1.0

    def __post_init__(self):
        if (self.activation not in LOG_ACTIVATIONS or self.row_rule not in ROW_RULES or self.power < 1
                or not (isinstance(self.shift, (float, int, Learnable)) or self.shift in (None, PER_ROW_SHIFT))):
            raise ValueError(f"LogWeight takes an activation of {LOG_ACTIVATIONS}, a power >= 1, a shift (None, a "
                             f"number, {PER_ROW_SHIFT!r} or Learnable) and a row rule of {ROW_RULES}; got "
                             f"{self.activation!r}, {self.power}, {self.shift!r}, {self.row_rule!r}.")

    @property
    def needs_counts(self) -> bool:
        """Whether ``l`` reads the row's key count ``n_i``."""
        return self.shift == PER_ROW_SHIFT or self.row_rule != "constant"

    def shift_of(self, log_counts: torch.Tensor | float, values: Mapping[str, torch.Tensor] | None):
        """``b``: ``-log n_i`` from ``log_counts``, the learned ``values["bias"]`` (already indexed or broadcast to
        the scores), the number, or 0."""
        if isinstance(self.shift, Learnable):
            return values["bias"]
        if self.shift == PER_ROW_SHIFT:
            return -log_counts
        return 0.0 if self.shift is None else float(self.shift)

    def log_row_factor(self, log_counts: torch.Tensor | float):
        """``log r(n_i)`` from ``log n_i``."""
        if self.row_rule == "n":
            return -log_counts
        if self.row_rule == "sqrtN":
            return -0.5 * log_counts
        return math.log(self.inv_constant)

    def __call__(self, scores: torch.Tensor, log_counts: torch.Tensor | float,
                 values: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``l(s)``, element-wise: ``scores`` of any shape (a 0-d score inside FlexAttention's ``score_mod``),
        ``log_counts`` ``log n_i`` broadcastable to them, ``values`` the learned values broadcastable to them. Where
        the weight is 0 the result is ``-inf``, and its gradient 0 (no ``log 0`` is differentiated)."""
        shifted = scores + self.shift_of(log_counts, values)
        if self.activation == "logsigmoid":
            logged = F.logsigmoid(shifted)
        else:
            positive = shifted > 0 if self.rectified else shifted != 0
            magnitude = shifted if self.rectified else shifted.abs()
            safe = torch.where(positive, magnitude, torch.ones_like(magnitude))  # log(1) = 0: a finite gradient
            logged = torch.where(positive, self.power * torch.log(safe), torch.full_like(safe, float("-inf")))
        return logged + self.log_row_factor(log_counts)

    def reference(self, scores: torch.Tensor, allowed: torch.Tensor,
                  values: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The weights ``e^{l(s)}`` on allowed pairs, 0 elsewhere (``scores`` ``(..., q, kv)``, ``allowed`` bool of
        that shape): what the declaration must equal (the family's own weights; tested)."""
        counts = allowed.sum(-1, keepdim=True).clamp_min(1).to(scores.dtype)
        return torch.exp(self(scores, counts.log(), values)) * allowed


RATIO_FORMS = ("expm1",)
"""The element-wise weights of :class:`LogWeightRatio`: ``"expm1"``, ``a(s) = log relu(e^s - 1)`` over
``b(s) = log |e^s - 1|`` (softpick)."""


@dataclass(frozen=True)
class LogWeightRatio:
    """``w_ij = e^{a(s_ij)} / (sum_k e^{b(s_ik)} + eps e^{m_i})``, ``m_i = max(0, max_k s_ik)``, on allowed pairs.

    For ``"expm1"`` (softpick, :mod:`.softpick`): ``a(s) = log relu(e^s - 1)``, ``b(s) = log |e^s - 1|`` (``-inf``
    where the weight is 0), so the weight is ``relu(e^s - 1) / (sum_k |e^{s_k} - 1| + eps e^m)``, the family's
    ``relu(e^{s - m} - e^{-m}) / (sum_k |e^{s_k - m} - e^{-m}| + eps)`` (its ``eps`` after the shift by ``m``)
    multiplied through by ``e^m``. ``a`` is increasing where finite, so ``m`` is read back from the row's largest
    ``a``: ``max_k s_k = log(1 + e^{max_k a(s_k)})`` when a score is positive, and ``m = softplus(max_k a) = 0`` when
    none is (``max_k a = -inf``).

    Attributes:
        form: one of :data:`RATIO_FORMS`.
        eps: the floor's ``eps`` (> 0).
    """

    form: str
    eps: float

    def __post_init__(self):
        if self.form not in RATIO_FORMS or not self.eps > 0:
            raise ValueError(f"LogWeightRatio takes a form of {RATIO_FORMS} and eps > 0; got {self.form!r}, "
                             f"{self.eps!r}.")

    def numerator(self, scores: torch.Tensor) -> torch.Tensor:
        """``a(s) = log relu(e^s - 1)``, element-wise (a 0-d score inside FlexAttention's ``score_mod``): ``s +
        log(-expm1(-s))`` for ``s > 0``, ``-inf`` otherwise, with a gradient 0 there (no ``log 0`` differentiated)."""
        positive = scores > 0
        return torch.where(positive, self._log_expm1_abs(scores, positive), torch.full_like(scores, float("-inf")))

    def denominator(self, scores: torch.Tensor) -> torch.Tensor:
        """``b(s) = log |e^s - 1|``, element-wise: ``s + log(-expm1(-s))`` for ``s > 0``, ``log(-expm1(s))`` for
        ``s < 0``, ``-inf`` at 0 (gradient 0 there)."""
        nonzero = scores != 0
        return torch.where(nonzero, self._log_expm1_abs(scores, scores > 0), torch.full_like(scores, float("-inf")))

    @staticmethod
    def _log_expm1_abs(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """``log |e^s - 1|`` where ``s != 0`` (finite, with finite gradients, everywhere: 0 is replaced by 1 first):
        with ``t = |s|``, ``log(1 - e^{-t})`` plus ``t`` where ``s > 0``."""
        magnitude = scores.abs()
        safe = torch.where(magnitude > 0, magnitude, torch.ones_like(magnitude))
        tail = torch.log(-torch.expm1(-safe))  # log(1 - e^{-t}) < 0, finite for t > 0
        return torch.where(positive, safe + tail, tail)

    def row_shift(self, largest_numerator: torch.Tensor) -> torch.Tensor:
        """``m_i = max(0, max_k s_ik)`` from ``max_k a(s_ik)`` (``-inf`` for a row with no positive score):
        ``log(1 + e^x)`` (softplus without its linear cut-off), the inverse of ``a`` on ``s > 0``, and 0 at
        ``-inf``."""
        return torch.logaddexp(largest_numerator, torch.zeros_like(largest_numerator))

    def reference(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The weights from ``a``, ``b`` and ``m`` as declared (``scores`` ``(..., q, kv)``, ``allowed`` bool of that
        shape; a row with no key: 0): what must equal the family's own weights (tested)."""
        minus_inf = torch.full_like(scores, float("-inf"))
        top = torch.where(allowed, self.numerator(scores), minus_inf)
        bottom = torch.where(allowed, self.denominator(scores), minus_inf)
        shift = self.row_shift(top.amax(dim=-1, keepdim=True))
        return top.exp() / (bottom.exp().sum(dim=-1, keepdim=True) + self.eps * shift.exp())


@dataclass(frozen=True)
class StickBreak:
    """Stick-breaking weights (Tan et al., arXiv 2410.17980): ``w_ij = beta_ij prod_{k in K_i, k > j} (1 - beta_ik)``,
    ``beta = sigma(s)``, ``K_i`` the keys row ``i`` may attend (masked keys break nothing).

    Attributes:
        own_key: a causal row attends its own key (``k <= i``: Transformers' causal masks; fla's
            ``attend_current=True``), else only the keys before it (``k < i``).
    """

    own_key: bool = True

    def reference(self, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The weights in log space on allowed pairs, 0 elsewhere (``scores`` ``(..., q, kv)``, ``allowed`` bool of
        that shape): what the declaration must equal (the family's own weights; tested)."""
        remaining = torch.where(allowed, F.logsigmoid(-scores), torch.zeros_like(scores))  # log(1 - beta)
        later = remaining.flip(-1).cumsum(-1).flip(-1) - remaining
        return torch.exp(F.logsigmoid(scores) + later) * allowed
