"""A compiled ``x/1`` model generates with its recurrent state: ``torch.compile(model.forward)`` then ``generate``
gives eager's tokens, every attention call on the linear path, and the cache holds states only (no keys).

``aot_eager``: Dynamo's capture and guards (a recompilation per decoding shape), AOTAutograd's graph; inductor's code
for the same linear kernel is compiled in tests/attention/test_window_compile.py (with inductor this test took ~30 s
on this machine's CPU, most of it code generation).
"""

import pytest
import torch

import hf_knorm
from hf_knorm.attention.paths import attention_paths
from hf_knorm.compat import cache_kwargs
from hf_knorm.recurrent.cache import RecurrentStateCache

from tiny_models import tiny_inputs, tiny_model


@pytest.mark.compat
def test_compiled_forward_generates_with_the_recurrent_state():
    torch._dynamo.reset()
    model = hf_knorm.patch(tiny_model("llama"), "x/1")
    inputs = tiny_inputs("llama", length=140)
    inputs["attention_mask"][0, :3] = 0  # left padding in the first row
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    eager = model.generate(**inputs, **options)

    model.forward = torch.compile(model.forward, backend="aot_eager")
    cache = RecurrentStateCache(config=model.config)
    with attention_paths() as counted:
        tokens = model.generate(**inputs, **options, **cache_kwargs(cache))
    torch._dynamo.reset()

    assert torch.equal(tokens, eager)
    assert counted == {"linear": 6 * model.config.num_hidden_layers}  # the prefill and five decoding steps
    for layer in cache.layers:
        assert layer.state.shape == (2, 2, 16, 16)  # (B, H_kv, D, D_v)
        assert layer.keys is None or layer.keys.numel() == 0
    assert cache.get_seq_length() == 145
