"""``SparseWindowStateLayer``: decode a ``p = 1`` model with a softmax window and a sparse global cache
(``x/1 + softmax window W + sinks S + sparse K (score)``) from ``W + S + K`` key/value pairs and a constant-size state.

With a sparse cache (:mod:`hf_knorm.attention.sparse`; LoLA, arXiv 2505.23666), a new token weights by softmax its
``W`` last positions, its sequence's ``S`` first tokens and, per KV head, the ``K`` best older pairs by a per-token
score; every other older pair enters the output only through the state ``S = sum_j k_j v_j^T`` (and its count). A
pair leaving the window either enters the cache (displacing the weakest, which joins the state) or joins the state
itself: the layer holds ``W + S + K`` pairs (each with its score and position) plus a ``D x D_v`` state per KV head,
whatever the length of the context, and decodes what the full forward computes (given the same scores). With
``+ clusters C`` (:mod:`hf_knorm.attention.distant_clusters`) it also keeps the per-cluster sums of the pairs that
joined the state: ``C`` key sums, value sums and counts per KV head.

How it runs. As :class:`~.window_cache.WindowStateLayer` (``update`` returns the window's kept pairs and the step's,
and hands the layer over to the plugin's attention), and the attention also reads :attr:`sparse_pairs` and calls
:meth:`keep_sparse` with the cache after the step before ``write`` (the new state, the window's last ``W`` pairs).
"""

from __future__ import annotations

from ..normalizations.sparse_choice import DEFAULT_SCORE
from .window_cache import WindowStateLayer

__all__ = ["SparseWindowStateLayer"]


class SparseWindowStateLayer(WindowStateLayer):
    """One layer: the window's ``W`` last pairs and the sinks (:class:`~.window_cache.WindowStateLayer`), the sparse
    cache :attr:`sparse_pairs` (:class:`hf_knorm.attention.sparse.SparsePairs`: keys and values ``(B, H_kv, K, D)``,
    their scores, positions and filled slots ``(B, H_kv, K)``), and the state of every other older pair.

    Args:
        layer_idx: the decoder layer.
        window: ``W > 0``.
        sparse: ``K > 0``, the pairs the sparse cache holds per KV head.
        score: the score choosing them (:data:`hf_knorm.normalizations.sparse_choice.SPARSE_SCORES`; by default
            :data:`~hf_knorm.normalizations.sparse_choice.DEFAULT_SCORE`, the parser's and the conversion's).
    """

    def __init__(self, layer_idx: int, window: int, sparse: int, score: str = DEFAULT_SCORE):
        if sparse <= 0:
            raise ValueError(f"A SparseWindowStateLayer keeps a sparse cache of K > 0 pairs, got {sparse}; a model "
                             "without one decodes with a WindowStateLayer.")
        super().__init__(layer_idx, window)
        self.sparse, self.score = sparse, score
        self.sparse_pairs = None  # hf_knorm.attention.sparse.SparsePairs after the first step
        self.score_statistics = None  # a prefix score's running statistics (prefix_kv_diff), after the first step
        self.cluster_state = None  # hf_knorm.attention.distant_clusters.ClusterState, with + clusters C

    def keep_sparse(self, pairs) -> None:
        """Keep the sparse cache after a step (called by the attention, before :meth:`write`)."""
        self.sparse_pairs = pairs

    def keep_score_statistics(self, statistics) -> None:
        """Keep what the score carries to the next step (called by the attention): ``None`` for a per-token score,
        :class:`hf_knorm.normalizations.prefix_kv_diff.PrefixStatistics` for ``prefix_kv_diff``."""
        self.score_statistics = statistics

    def keep_clusters(self, state) -> None:
        """Keep the per-cluster sums after a step (called by the attention, with ``+ clusters C``)."""
        self.cluster_state = state

    def stored_pairs(self) -> int:
        """Key/value pairs held per KV head: the window's, the sinks' and the sparse cache's slots (at most
        ``W + S + K``)."""
        sinks = 0 if self.sinks is None else self.sinks.keys.shape[-2]
        sparse = 0 if self.sparse_pairs is None else self.sparse_pairs.keys.shape[-2]
        return self.kept() + sinks + sparse

    def nbytes(self) -> int:
        """Bytes held by the window, the sinks, the sparse cache (with its scores and positions), the score's
        statistics, the clusters' sums and the state."""
        pairs = () if self.sparse_pairs is None else tuple(self.sparse_pairs)
        statistics = () if self.score_statistics is None else tuple(self.score_statistics)
        clusters = () if self.cluster_state is None else tuple(self.cluster_state)
        return super().nbytes() + sum(tensor.nbytes for tensor in pairs + statistics + clusters)

    def reset(self) -> None:
        super().reset()
        self.sparse_pairs, self.score_statistics, self.cluster_state = None, None, None

    def _select(self, fn) -> None:
        super()._select(fn)
        if self.sparse_pairs is not None:
            self.sparse_pairs = type(self.sparse_pairs)(*(fn(tensor) for tensor in self.sparse_pairs))
        if self.score_statistics is not None:
            self.score_statistics = self.score_statistics.select(fn)
        if self.cluster_state is not None:
            self.cluster_state = type(self.cluster_state)(*(fn(tensor) for tensor in self.cluster_state))
