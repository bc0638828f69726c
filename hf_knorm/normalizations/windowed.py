"""A softmax window (and attention sinks) beside any family: ``base + softmax window W + sinks S``.

For query ``i``, the keys of the last ``W`` positions and each sequence's first ``S`` tokens (the attention sinks) are
weighted by softmax over them; the older keys by ``base``, scaled per query head by the window mix ``m_h``
(:mod:`hf_knorm.attention.window` computes it; LoLCATs arXiv 2410.10254, Liger arXiv 2503.01496; sinks: StreamingLLM,
Xiao et al., arXiv 2309.17453). ``W = 0`` is ``base`` itself. The mix is a learnable parameter (``window_mix``, one
value per query head, starting at 1), in ``state_dict`` with the base family's own.

With ``+ sparse K (score)`` a sparse global cache joins the softmax part: for each query and KV head, the ``K`` best
keys older than the window (by a ``score`` fixed per token, :mod:`.sparse_choice`) are weighted by softmax jointly with
the window and the sinks, and only the remaining older keys by ``base`` (LoLA, arXiv 2505.23666;
:mod:`hf_knorm.attention.sparse` computes it).

With ``+ clusters C`` (beside a sparse cache) those remaining older keys are also summarized for softmax: per layer
and KV head, a fixed codebook of ``C`` directions (fitted on the model's keys and saved with its weights) sorts them
into ``C`` clusters, and each cluster joins the softmax as one pseudo-pair, its mean key and mean value, its logit
raised by the log of its size (:mod:`hf_knorm.attention.distant_clusters`). Bounded memory: ``C`` sums of keys and
values per KV head, whatever the length.

Spelling: ``x^3/16 + softmax window 64``, ``relu(x)^3/16 + softmax window 64 + sinks 4``,
``x/1 + softmax window 64 + sinks 4 + sparse 64 (key_norm)``,
``x/1 + softmax window 64 + sinks 4 + sparse 64 (key_norm) + clusters 256``; it parses back to the same object. The
name always spells the sparse cache's score; ``+ sparse K`` without one parses to
:data:`.sparse_choice.DEFAULT_SCORE` (``prefix_kv_diff``), and a record without one reads as
:data:`.sparse_choice.LEGACY_DEFAULT_SCORE` (``key_norm``, what it meant when it was written).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Normalization
from .sink_softmax import SinkSoftmax
from .softmax import Softmax
from .sparse_choice import DEFAULT_SCORE, LEGACY_DEFAULT_SCORE, check_sparse_score

WINDOW_PART = Softmax()
"""What weights the keys inside the window (and the sinks, the sparse cache's pairs, the clusters): softmax."""

MIX = "window_mix"
"""The learnable parameter scaling the part beside the window, one value per query head."""

CODEBOOK = "cluster_codebook"
"""With ``+ clusters C``: each attention module's fixed ``(H_kv, C, D)`` codebook (fitted, not trained)."""


@dataclass(frozen=True)
class Windowed(Normalization):
    """Attributes: ``base`` (what weights the older keys), ``window`` ``W >= 1``, ``sinks`` ``S >= 0``, ``sparse``
    ``K >= 0`` (the sparse global cache: older keys weighted by softmax with the window, 0 = none), ``score``
    (how its keys are chosen, a name of :data:`.sparse_choice.SPARSE_SCORES`; the default's without a cache) and
    ``clusters`` ``C >= 0`` (the remaining older keys summarized by ``C`` pseudo-pairs weighted by softmax too; needs
    the sparse cache; 0 = none)."""

    base: Normalization
    window: int
    sinks: int = 0
    sparse: int = 0
    score: str = DEFAULT_SCORE
    clusters: int = 0

    def __post_init__(self):
        if isinstance(self.sparse, bool) or not isinstance(self.sparse, int) or self.sparse < 0:
            raise ValueError(f"sparse is a number of key/value pairs, an integer >= 0 (0 = no sparse cache), got "
                             f"{self.sparse!r}.")
        check_sparse_score(self.score, self.window if self.sparse else None)
        if not self.sparse:  # no cache, no score: one object per spelling, whichever score a record or call carried
            object.__setattr__(self, "score", DEFAULT_SCORE)
        check_clusters(self.clusters, self.sparse)

    family = "windowed"
    formula = "softmax over the last W keys and the first S; m_h * (the base family, RMS-normalized) over the older keys"
    source = "LoLCATs (arXiv 2410.10254); StreamingLLM's sinks (arXiv 2309.17453)"
    examples = ("x^3/16 + softmax window 64 + sinks 4", "relu(x)^3/16 + softmax window 64")

    @property
    def without_window(self) -> Normalization:
        return self.base

    @property
    def fast_paths(self) -> tuple[str, ...]:
        # window.py composes the two parts: no whole-call softmax route
        return tuple(path for path in self.base.fast_paths if path not in ("sdpa", "flex", "fla_stickbreaking"))

    @property
    def name(self) -> str:
        sinks = f" + sinks {self.sinks}" if self.sinks else ""
        sparse = f" + sparse {self.sparse} ({self.score})" if self.sparse else ""
        clusters = f" + clusters {self.clusters}" if self.clusters else ""
        return f"{self.base.name} + softmax window {self.window}{sinks}{sparse}{clusters}"

    def learnable(self):
        return {**self.base.learnable(), MIX: 1.0}

    def weights(self, scores, allowed, params=None, inplace=False):
        raise ValueError(f"{self.name} weights keys by their position; compute it with "
                         "hf_knorm.attention.window.window_attention (the kernels take its two parts).")

    def to_record(self) -> dict:
        record = {"family": self.family, "base": self.base.to_record(), "window": self.window, "sinks": self.sinks}
        if self.sparse:  # absent: no sparse cache (records written before it read the same); the score always spelled
            record.update(sparse=self.sparse, score=self.score)
        if self.clusters:  # absent: none
            record.update(clusters=self.clusters)
        return record

    @classmethod
    def from_record(cls, record):
        from .registry import from_record

        return cls(base=from_record(record["base"]), window=int(record["window"]), sinks=int(record.get("sinks", 0)),
                   sparse=int(record.get("sparse", 0)), score=str(record.get("score", LEGACY_DEFAULT_SCORE)),
                   clusters=int(record.get("clusters", 0)))

    @classmethod
    def parse(cls, text):
        return None  # the registry reads the " + softmax window" suffix around any family (registry.parse)


def with_window(normalization: Normalization, window: int, sinks: int | None = None) -> Normalization:
    """``normalization`` with a softmax window of ``window`` keys (``0``: without one, the pure normalization) and
    ``sinks`` attention sinks beside it (``None``: the ones ``normalization`` has, else 0). A sparse cache
    ``normalization`` has is kept (:func:`with_sparse` sets one).

    Raises:
        ValueError: ``window`` or ``sinks`` is not an integer >= 0, ``normalization`` is softmax (a softmax window on
            softmax is softmax: patch with ``"softmax"`` alone), it already has another window or other sinks, or
            sinks without a window.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"softmax_window is a number of keys, an integer >= 0 (0 = no window), got {window!r}.")
    if sinks is not None and (isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0):
        raise ValueError(f"attention_sinks is a number of keys, an integer >= 0 (0 = none), got {sinks!r}.")
    if window and normalization.is_softmax:
        raise ValueError(f"softmax_window={window} with softmax: every key is already weighted by softmax. Pass "
                         "softmax_window=0, or another normalization such as 'x^3/16' to weight the keys "
                         "older than the window.")
    if window and isinstance(normalization.without_window, SinkSoftmax):
        raise ValueError(f"softmax_window={window} with {normalization.without_window.name}: the part beside the window is "
                         "RMS-normalized per row, which cancels a sink (it only rescales rows), so the sink would have "
                         "no effect and no gradient. Use another family beside the window, e.g. 'x^3/16' or "
                         "'sigmoid(bias=learned)'.")
    if normalization.window and window != normalization.window:
        raise ValueError(f"{normalization.name} already has a softmax window of {normalization.window}; "
                         f"softmax_window={window} contradicts it. Give the window once.")
    if sinks is not None and normalization.sinks and sinks != normalization.sinks:
        raise ValueError(f"{normalization.name} already has {normalization.sinks} attention sinks; "
                         f"attention_sinks={sinks} contradicts it. Give the sinks once.")
    sinks = normalization.sinks if sinks is None else sinks
    if sinks and not window:
        raise ValueError(f"attention_sinks={sinks} without a softmax window: the sinks are keys that softmax weights "
                         "beside the window. Give softmax_window=W > 0 too, or attention_sinks=0.")
    sparse, score = normalization.sparse, getattr(normalization, "score", DEFAULT_SCORE)
    if sparse and not window:
        raise ValueError(f"{normalization.name} has a sparse cache of {sparse} pairs, which softmax weights beside "
                         "the window: it needs softmax_window=W > 0.")
    base = normalization.without_window
    return Windowed(base=base, window=window, sinks=sinks, sparse=sparse, score=score,
                    clusters=normalization.clusters) if window else base


def with_sparse(normalization: Normalization, sparse: int, score: str = DEFAULT_SCORE) -> Normalization:
    """``normalization`` (which has a softmax window) with a sparse global cache of ``sparse`` older key/value pairs
    per layer and KV head, chosen by ``score`` (``0``: without one). Clusters beside the cache are kept.

    Raises:
        ValueError: ``sparse`` is not an integer >= 0, an unknown or context-dependent score
            (:func:`.sparse_choice.check_sparse_score`), a sparse cache without a softmax window, or ``0`` while
            the normalization has clusters (they summarize the pairs the cache leaves).
    """
    if isinstance(sparse, bool) or not isinstance(sparse, int) or sparse < 0:
        raise ValueError(f"sparse is a number of key/value pairs, an integer >= 0 (0 = no sparse cache), got "
                         f"{sparse!r}.")
    check_sparse_score(score)
    if sparse and not normalization.window:
        raise ValueError(f"A sparse cache of {sparse} pairs without a softmax window: its keys are weighted by "
                         f"softmax jointly with the window's. Give {normalization.name} a window first, e.g. "
                         f"'{normalization.name} + softmax window 64 + sparse {sparse}'.")
    if not normalization.window:
        return normalization
    return Windowed(base=normalization.without_window, window=normalization.window, sinks=normalization.sinks,
                    sparse=sparse, score=score, clusters=normalization.clusters)


def with_clusters(normalization: Normalization, clusters: int) -> Normalization:
    """``normalization`` (which has a softmax window and a sparse cache) with its remaining older keys summarized by
    ``clusters`` pseudo-pairs per layer and KV head (``0``: none; :mod:`hf_knorm.attention.distant_clusters`).

    Raises:
        ValueError: ``clusters`` is not an integer >= 0, or clusters without a sparse cache beside a window.
    """
    check_clusters(clusters, normalization.sparse if normalization.window else 0)
    if not normalization.window:
        return normalization
    return Windowed(base=normalization.without_window, window=normalization.window, sinks=normalization.sinks,
                    sparse=normalization.sparse, score=normalization.score, clusters=clusters)


def check_clusters(clusters, sparse: int) -> None:
    """Raise a ValueError unless ``clusters`` is an integer >= 0, and 0 without a sparse cache."""
    if isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 0:
        raise ValueError(f"clusters is a number of pseudo-pairs per KV head, an integer >= 0 (0 = none), got "
                         f"{clusters!r}.")
    if clusters and not sparse:
        raise ValueError(f"clusters {clusters} summarize the older pairs a sparse cache leaves, beside a softmax "
                         "window: give the window and the cache first, e.g. "
                         f"'x/1 + softmax window 64 + sinks 4 + sparse 256 (prefix_kv_diff) + clusters {clusters}'.")
