"""The supported Transformers range and the shims of ``hf_knorm.compat`` for the differences between its releases.

The shims are checked against the Transformers that runs the tests; ``make compat`` runs this file (and the rest of
the compatibility suite) on the oldest and a middle supported release, ``make test`` on the newest.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import DECODER_TYPES, tiny_config, tiny_inputs, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import hf_knorm
from hf_knorm import compat

pytestmark = pytest.mark.compat


def test_the_declared_range_is_the_checked_one():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.findall(r'^ *"transformers([^"]*)",', pyproject, flags=re.MULTILINE) == [compat.SUPPORTED_TRANSFORMERS]


@pytest.mark.parametrize("version", ["5.10.4", "5.17.0", "5.24.0", "5.25.0.dev0", "5.99.1"])
def test_releases_in_the_range_are_accepted(monkeypatch, version):
    monkeypatch.setattr(compat, "installed_transformers_version", lambda: version)
    compat.check_transformers_version()


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.9.0", "6.0.0.dev0", "6.1.0"])
def test_import_outside_the_range_names_the_range(monkeypatch, version):
    monkeypatch.setattr(compat, "installed_transformers_version", lambda: version)
    with pytest.raises(ImportError, match=rf"supports transformers>=5\.10,<6 .*transformers {re.escape(version)} is "):
        importlib.reload(hf_knorm)  # the package's __init__ runs the check before anything else
    assert hf_knorm.patch  # a failed reload leaves the imported package as it was


def test_an_unsupported_release_stops_the_first_import_with_one_clear_line():
    """In a fresh process: the traceback ends in the version check, not deep inside Transformers."""
    script = "import transformers; transformers.__version__ = '4.57.6'; import hf_knorm"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: hf_knorm supports transformers>=5.10,<6 (every 5.x minor from 5.10 on); transformers 4.57.6 is "
        "installed. Install a supported release: pip install 'transformers>=5.10,<6'."
    )


def test_the_cache_keyword_reaches_forward_and_generate():
    """The cache passed with ``cache_kwargs`` is the one the model fills (a wrong keyword is silently ignored by
    ``forward`` before 5.24 and the output would hold a fresh cache)."""
    model = tiny_model("llama")
    ids = tiny_inputs("llama", batch=1, length=5)["input_ids"]
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, **compat.cache_kwargs(cache), use_cache=True)
        assert compat.output_cache(out) is cache and cache.get_seq_length() == 5
        cache = DynamicCache()
        model.generate(input_ids=ids, **compat.cache_kwargs(cache), max_new_tokens=3, min_new_tokens=3, pad_token_id=0)
    assert cache.get_seq_length() == 5 + 3 - 1  # the last generated token is never fed back


@pytest.mark.parametrize("model_type", DECODER_TYPES)
def test_layer_types_agree_with_transformers_own_cache(model_type):
    """Per layer, the type and window ``layer_types_and_kwargs`` reports are those of ``DynamicCache(config=...)``."""
    config = tiny_config(model_type)
    layer_types, layer_kwargs = compat.layer_types_and_kwargs(config)
    layers = DynamicCache(config=config).layers
    assert len(layer_types) == len(layer_kwargs) == len(layers) == config.num_hidden_layers
    for kind, kwargs, layer in zip(layer_types, layer_kwargs, layers):
        sliding = isinstance(layer, DynamicSlidingWindowLayer)
        assert (kind == "sliding_attention") == sliding, (kind, type(layer).__name__)
        if sliding:
            assert kwargs["sliding_window"] == layer.sliding_window == config.sliding_window
