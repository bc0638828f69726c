"""What every attention normalization is: a typed, frozen object of one family.

A normalization turns a row of scores ``s_ij`` (``scaling * q_i . k_j`` plus what the architecture adds: a softcap, an
additive bias) into weights ``w_ij``. Each family lives in its own file of this package and says there:

- its weights (:meth:`Normalization.weights`: the plain definition, which the chunked kernel calls on whole rows and
  the tests take as the reference);
- whether rows are normalized (:attr:`Normalization.row_normalizer`: what a streaming kernel must carry, a running
  maximum and a denominator, or nothing);
- what ``n`` is (:func:`row_counts`): the number of keys row ``i`` may attend, so the same for a causal row of a
  prefill, a padded row (its real keys) and one decoded token against a cache;
- its parameters: fixed ones are fields of the dataclass; learnable ones (:class:`Learnable`) are one value per
  query head, registered on each attention module as an ``nn.Parameter`` (:mod:`hf_knorm.models.parameters`), so they
  are in ``state_dict``, trained by the Trainer and saved with the weights;
- its spelling (:attr:`Normalization.name`), which :func:`hf_knorm.normalizations.parse_normalization` reads back
  to an equal object, and its saved record (:meth:`Normalization.to_record`);
- its routes (:mod:`.routes`): whether it is a softmax over modified logits (:attr:`Normalization.softmax_logits`,
  which SDPA and other softmax kernels compute), or an element-wise weight of the score
  (:attr:`Normalization.pointwise`, which the Triton kernel and, for ``s / c``, the linear-time kernels compute), or
  a non-negative weight with an element-wise logarithm (:attr:`Normalization.log_weights`, which FlexAttention
  computes with the softmax families), or a ratio of two such weights with a floor
  (:attr:`Normalization.log_weight_ratio`: softpick, FlexAttention in two passes), or stick-breaking
  (:attr:`Normalization.stick_break`, which flash-linear-attention's stick-breaking kernel computes); the fast
  paths that compute it exactly (:attr:`Normalization.fast_paths`)
  follow from them. The attention paths read these capabilities and never test a family's type.

The registry (:mod:`.registry`) lists the families; adding one is a new file and one registry line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from .routes import LogWeight, LogWeightRatio, Pointwise, SoftmaxLogits, StickBreak

PARAMETER_PREFIX = "hf_knorm_"
"""A learnable value ``name`` is the attention module's ``nn.Parameter`` ``hf_knorm_<name>``."""

Parameters = Mapping[str, torch.Tensor]
"""A module's learnable values by name, each broadcastable to the scores: ``(H_q, 1, 1)`` against
``(B, H_q, q, kv)``, ``(H_kv, G, 1, 1)`` against the chunked kernel's ``(B, H_kv, G, q, kv)``."""


@dataclass(frozen=True)
class Learnable:
    """A parameter learned per query head, starting at ``init`` (spelled ``learned`` or ``learned(init)``)."""

    init: float

    def spelling(self, default: float) -> str:
        return "learned" if self.init == default else f"learned({_number(self.init)})"


class Normalization:
    """Base of every family (each a frozen dataclass). Subclasses set the class attributes and :meth:`weights`."""

    family: ClassVar[str]
    """The registry key and the first word of the spelling, e.g. ``"sigmoid"``."""
    source: ClassVar[str]
    """Where the family comes from (paper, arXiv id)."""
    formula: ClassVar[str]
    """The weights in one line, ``n_i`` the keys row ``i`` may attend (for model cards and listings)."""
    examples: ClassVar[tuple[str, ...]]
    """Spellings that parse to this family; the first is the one listed
    (``hf_knorm.list_normalizations()``)."""
    row_normalizer: ClassVar[str] = "none"
    """``"none"`` (weights of a key depend on its score alone, or on its row's count ``n``), ``"max+sum"`` (a
    softmax: a streaming kernel carries a running maximum and a denominator), ``"sum"`` (a denominator over the
    row), or ``"row"`` (a weight depends on other keys of its row in order: stick-breaking)."""
    softmax_logits: SoftmaxLogits | None = None
    """How the family is a softmax over modified logits (:class:`.routes.SoftmaxLogits`), or ``None``."""
    pointwise: Pointwise | None = None
    """How each weight is an element-wise function of its score and its row's key count
    (:class:`.routes.Pointwise`), or ``None``."""
    log_weights: LogWeight | None = None
    """How each weight is non-negative with an element-wise logarithm (:class:`.routes.LogWeight`), or ``None``."""
    log_weight_ratio: LogWeightRatio | None = None
    """How each weight is a ratio of two element-wise weights with a floor (:class:`.routes.LogWeightRatio`), or
    ``None``."""
    stick_break: StickBreak | None = None
    """How the weights break a stick along the row (:class:`.routes.StickBreak`), or ``None``."""

    is_softmax: ClassVar[bool] = False
    window: ClassVar[int] = 0
    sinks: ClassVar[int] = 0
    sparse: ClassVar[int] = 0
    clusters: ClassVar[int] = 0

    @property
    def fast_paths(self) -> tuple[str, ...]:
        """The paths computing the family exactly, from its routes: ``"chunked"`` (the PyTorch quadratic kernel, whole
        rows per chunk: any family), ``"sdpa"`` (a softmax over modified logits), ``"triton"`` (element-wise
        weights), ``"flex"`` (FlexAttention: a softmax over modified logits, a non-negative weight's logarithm, or a
        ratio of two such weights),
        ``"linear"`` / ``"fla"`` (``s / c``: linear attention), ``"fla_stickbreaking"`` (flash-linear-attention's
        stick-breaking kernel: :class:`.routes.StickBreak`)."""
        paths = ["chunked"]
        if self.softmax_logits is not None:
            paths.append("sdpa")
        if self.softmax_logits is not None or self.log_weights is not None or self.log_weight_ratio is not None:
            paths.append("flex")
        if self.pointwise is not None:
            paths.append("triton")
            if self.pointwise.is_linear:
                paths += ["linear", "fla"]
        if self.stick_break is not None:
            paths.append("fla_stickbreaking")
        return tuple(paths)

    @property
    def kernel_key(self) -> str:
        """What a compiled kernel's code depends on (the self-check proves one key once per device): the element-wise
        form's (:attr:`.routes.Pointwise.kernel_key`: the constant is a run-time scalar), else the family."""
        return self.pointwise.kernel_key if self.pointwise is not None else self.family

    @property
    def without_window(self) -> Normalization:
        """What weights the keys older than a softmax window: the normalization itself when it has no window."""
        return self

    def unit_constant_twin(self) -> Normalization | None:
        """The same normalization with its constant ``c`` replaced by 1, where ``c`` folds into the queries (an
        element-wise power: ``(alpha s)^p / 1 = s^p / c`` for ``alpha = c^(1/p)``), else ``None``. Conversion trains
        the twin and folds ``c`` afterwards (:mod:`hf_knorm.conversion.twin`)."""
        return None

    @property
    def name(self) -> str:
        """The canonical spelling; ``parse(name)`` gives back an equal object."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name

    def learnable(self) -> dict[str, float]:
        """The learnable parameters, ``{name: initial value}``; one value per query head each."""
        return {}

    def values_on(self, module) -> dict[str, torch.Tensor]:
        """``{name: (H_q,) parameter}`` of the learnable values an attention module holds (``{}`` for none): its
        ``nn.Parameter`` ``hf_knorm_<name>`` each (:mod:`hf_knorm.models.parameters` registers them).

        Raises:
            RuntimeError: the module lacks one (the message says how to get it).
        """
        found = {}
        for name in self.learnable():
            value = module._parameters.get(PARAMETER_PREFIX + name)
            if value is None:
                raise RuntimeError(
                    f"{self.name} learns {name!r} per head, and {type(module).__name__} (layer "
                    f"{getattr(module, 'layer_idx', '?')}) has no {PARAMETER_PREFIX + name} parameter. Patch the model "
                    "with hf_knorm.patch, or load a saved one with hf_knorm imported (the values load with the "
                    "weights).")
            found[name] = value
        return found

    def weights(self, scores: torch.Tensor, allowed: torch.Tensor | None, params: Parameters | None = None,
                inplace: bool = False) -> torch.Tensor:
        """Turn scores into attention weights.

        Args:
            scores: fp32 (or fp64) scores ``(..., q, kv)``; whole rows (every key a row may attend is there).
            allowed: bool mask broadcastable to ``scores`` (True = may attend), or ``None`` (every key).
            params: the learnable values (:data:`Parameters`), for a family that has some.
            inplace: the scores may be overwritten (inference only: the chunked kernel's forward passes it, on a
                buffer of its own); the result may then be ``scores`` itself. Without it, nothing is changed in
                place that autograd needs.

        Returns:
            Weights of the shape of ``scores``; masked pairs are exactly 0, and so is a row with no allowed key.
        """
        raise NotImplementedError

    def to_record(self) -> dict:
        """The saved form: ``{"family": ..., field: value, ...}`` (JSON types; a learnable field as
        ``{"learned": init}``)."""
        record = {"family": self.family}
        for field in fields(self):
            value = getattr(self, field.name)
            record[field.name] = {"learned": value.init} if isinstance(value, Learnable) else value
        return record

    @classmethod
    def from_record(cls, record: Mapping) -> Normalization:
        values = {key: (Learnable(value["learned"]) if isinstance(value, Mapping) else value)
                  for key, value in record.items() if key != "family"}
        return cls(**values)

    @classmethod
    def parse(cls, text: str) -> Normalization | None:
        """This family's object for ``text`` (spaces removed, as typed otherwise), ``None`` when ``text`` is not
        this family's spelling. Raises ``ValueError`` for this family's spelling with a bad value."""
        raise NotImplementedError


def row_counts(scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``n`` of each row, ``(..., q, 1)`` in the scores' dtype: the keys the row may attend (at least 1). A causal
    row ``i`` has ``i + 1``; a padded batch item's row its real keys; a decoded token the keys of its cache."""
    if allowed is None:
        return scores.new_full((*scores.shape[:-1], 1), float(scores.shape[-1]))
    return allowed.sum(dim=-1, keepdim=True, dtype=scores.dtype).expand(*scores.shape[:-1], 1).clamp_min(1.0)


def masked(weights: torch.Tensor, allowed: torch.Tensor | None, inplace: bool = False) -> torch.Tensor:
    """``weights`` with masked pairs set to 0: a new tensor (autograd may need ``weights``), or ``weights`` itself
    with ``inplace``.

    A product by the mask, not ``masked_fill``: the same values where ``weights`` is finite (every family's are, at
    masked pairs too), and several times faster on the CPU (``masked_fill`` takes ~1.1 ns per element, a product by a
    broadcast bool mask ~0.15 ns in place: a chunk of the quadratic kernel holds 2^21 scores).
    """
    if allowed is None:
        return weights
    return weights.mul_(allowed) if inplace else weights * allowed


def minus_inf_masked(scores: torch.Tensor, allowed: torch.Tensor | None, inplace: bool = False) -> torch.Tensor:
    """``scores`` with masked pairs set to ``-inf`` (the logits of a softmax): a new tensor, or ``scores`` itself with
    ``inplace``. In place, a mask shared by the heads (smaller than the scores) is added as its ``0 / -inf`` form,
    which is faster on the CPU than ``masked_fill`` over every head."""
    if allowed is None:
        return scores
    if not inplace:
        return scores.masked_fill(~allowed, float("-inf"))
    if allowed.numel() * 4 > scores.numel():
        return scores.masked_fill_(~allowed, float("-inf"))
    return scores.add_(torch.where(allowed, torch.zeros((), dtype=scores.dtype, device=scores.device), float("-inf")))


def read_value(family: str, key: str, text: str, learnable_default: float | None = None) -> float | Learnable:
    """A number, or (where ``learnable_default`` is given) ``learned`` / ``learned(x)``.

    Raises:
        ValueError: anything else, naming the family, the field and what it takes.
    """
    if learnable_default is not None and text.startswith("learned"):
        rest = text[len("learned"):]
        if not rest:
            return Learnable(learnable_default)
        if rest.startswith("(") and rest.endswith(")"):
            return Learnable(_finite(family, key, rest[1:-1]))
    return _finite(family, key, text)


def _finite(family: str, key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{family}: {key} must be a finite number{' or learned' if key else ''}, got {text!r}.")
    return value


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def arguments(text: str, family: str) -> dict[str, str] | None:
    """``"family(a=1,b=x)"`` -> ``{"a": "1", "b": "x"}``; ``"family"`` -> ``{}``; another family's text -> ``None``.

    Raises:
        ValueError: the family's name followed by something that is not an argument list.
    """
    if not text.lower().startswith(family):
        return None
    rest = text[len(family):]
    if not rest:
        return {}
    if not (rest.startswith("(") and rest.endswith(")")):
        return None
    values = {}
    for item in filter(None, rest[1:-1].split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{family}{rest}: arguments are key=value, got {item!r}.")
        values[key.strip().lower()] = value.strip()
    return values


def check_keys(family: str, given: Mapping[str, str], known: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"{family} takes {', '.join(known) or 'no arguments'}; unknown: {', '.join(unknown)}.")
