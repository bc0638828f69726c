"""The top level (``hf_knorm.__all__``) exports the verbs and their typed settings, objects and reports, exactly; the
helpers live in their subpackages, and their former top-level names (``hf_knorm._MOVED``) still resolve, each with a
DeprecationWarning naming its new home, until 0.3.0."""

import importlib
import warnings

import pytest

import hf_knorm

VERBS = {
    "attention_paths", "balance_kv", "convert", "from_pretrained", "kernels", "list_normalizations",
    "load_default_model", "parse_normalization", "patch", "patched_normalization", "plot_norm_history",
    "push_to_hub", "record_norms", "save_pretrained", "unpatch",
}
TYPES = {
    # the normalization families and their base class
    "Normalization", "Polynomial", "Rectified", "SSMax", "Sigmoid", "SinkSoftmax", "Softmax", "Softpick",
    "StickBreaking",
    # caches, the pipeline, the callback, the settings, the reports and the error the verbs take or return
    "BalanceReport", "ConvertSettings", "HubPushError", "KNormCache", "KNormTextGenerationPipeline", "KVNorms",
    "LayerNorms", "NormLoggerCallback", "NormRecorder", "RecurrentStateCache",
}
MOVED = {  # the helpers, by their home
    "DEFAULT_MODEL_HUB_ID": "assets.default_model",
    "PAPER_NORMALIZATIONS": "normalizations",
    "SUPPORTED_ARCHITECTURES": "models.architectures",
    "architecture_of": "models.architectures",
    "attention_modules": "models.architectures",
    "fit_cluster_codebook": "models.cluster_codebook",
    "key_scales": "balancing.balance",
    "knorm_cache_for": "eviction.pipeline",
    "knorm_defaults": "eviction.defaults",
    "knorm_generate": "eviction.pipeline",
    "load_model": "models.persistence",
    "push_folder": "hub",
    "register": "attention.registration",
    "set_clusters": "models.cluster_codebook",
    "set_knorm_defaults": "eviction.defaults",
    "set_sparse_cache": "models.sparse_cache_size",
    "use_kernels": "attention.backends",
    "value_scales": "balancing.balance",
}


def test_the_top_level_exports_exactly_the_verbs_and_their_types():
    assert sorted(hf_knorm.__all__) == sorted(VERBS | TYPES | {"__version__"})
    assert len(hf_knorm.__all__) == len(set(hf_knorm.__all__))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # an exported name never warns
        for name in hf_knorm.__all__:
            assert getattr(hf_knorm, name) is not None, name
        namespace = {}
        exec("from hf_knorm import *", namespace)  # noqa: S102 (what a star import brings)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(hf_knorm.__all__)
    assert [name for name in VERBS if not callable(getattr(hf_knorm, name))] == []
    assert [name for name in TYPES if not isinstance(getattr(hf_knorm, name), type)] == []


@pytest.mark.parametrize("name", sorted(MOVED))
def test_each_moved_helper_warns_and_still_resolves_to_its_home(name):
    assert hf_knorm._MOVED[name] == MOVED[name]
    home = importlib.import_module(f"hf_knorm.{MOVED[name]}")
    assert name not in hf_knorm.__all__ and name not in vars(hf_knorm)  # reached only through __getattr__
    assert name in getattr(home, "__all__", [name])  # a public name of its home
    with pytest.warns(DeprecationWarning, match=rf"hf_knorm\.{name} moved to hf_knorm\.{MOVED[name]}\.{name}\b.*"
                                                r"removed in 0\.3\.0") as caught:
        resolved = getattr(hf_knorm, name)
    assert resolved is getattr(home, name)
    assert caught[0].filename == __file__  # the warning points at the caller's line (stacklevel)


def test_the_moved_names_replaced_by_a_verb_say_which():
    with pytest.warns(DeprecationWarning, match="or hf_knorm.KNormCache with model.generate"):
        hf_knorm.knorm_generate
    with pytest.warns(DeprecationWarning, match="or the context manager hf_knorm.kernels"):
        hf_knorm.use_kernels
    with pytest.warns(DeprecationWarning, match=r"or hf_knorm.from_pretrained"):
        hf_knorm.load_model


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hf_knorm.not_a_name
